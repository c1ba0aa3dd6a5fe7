"""The before/after check behind BENCHMARKS.md section 3, run 5: one c64 load of the overhead suite.

Deploys what the suite deploys for ``turnkv-stateless`` or ``turnkv-redis`` (or the bare relay) with
``turnkv.bench.scenarios.base.deploy`` (gateway alone on CPU 1, everything else on CPU 0), runs the
suite's warm-up, then N single-turn streamed requests 64 at a time, and prints the gateway's CPU per
request from /proc. ``--spy`` records a py-spy profile of the gateway meanwhile (OUT/spy.txt, raw).
Run it alternately against two trees (the older one first on PYTHONPATH):

    PYTHONPATH=/path/to/before/src .venv/bin/python docs/bench/overhead-run5/ab_c64.py stateless OUT 1280
    .venv/bin/python docs/bench/overhead-run5/ab_c64.py stateless OUT 1280
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from turnkv.bench import procs
from turnkv.bench.runner import run_load
from turnkv.bench.scenarios import overhead as o
from turnkv.bench.scenarios.base import Deployment, deploy, scrape


def main(mode: str, out: Path, n: int, spy: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if mode == "relay":
        dep = Deployment("relay", engine_flags=o.ZERO, pin=True)
    else:
        dep = o._turnkv(o.ZERO, redis=mode == "redis", pin=True)
    session = mode == "redis"
    load = replace(o.BASE, concurrency=64, conversations=n, session_header=session, seed=5)
    with deploy(dep, out) as d:
        procs.pin(os.getpid(), {0})
        asyncio.run(run_load(replace(o.WARMUP, session_header=session), d.target, label="warm-up", show_progress=False))
        assert d.gateway is not None
        pid = d.gateway.proc.pid
        recorder = None
        if spy:
            exe = Path(sys.executable).with_name("py-spy")  # pip install py-spy, in the same environment
            cmd = [str(exe), "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(out / "spy.txt")]
            recorder = subprocess.Popen([*cmd, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.pin(recorder.pid, {0})
            time.sleep(1.0)  # attached before the load starts
        cpu0, t0 = procs.tree_cpu_seconds(pid), time.perf_counter()
        records = asyncio.run(run_load(load, d.target, label=mode, show_progress=False))
        cpu, wall = procs.tree_cpu_seconds(pid) - cpu0, time.perf_counter() - t0
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(30)
        errors = sum(1 for r in records if not r.ok)
        seen = scrape(d.gateway.url, ["turnkv_handle_releases", "turnkv_unused"]) if mode != "relay" else {}
        print(
            f"{mode}: {len(records)} requests, {errors} failed, gateway CPU {cpu * 1e3 / len(records):.3f} ms/request, "
            f"wall {wall:.1f} s {seen}"
        )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), "--spy" in sys.argv)
