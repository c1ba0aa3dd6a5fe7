"""``turnkv bench profile``: where the gateway's CPU goes, from cProfile, under the overhead suite's load.

Starts zero-cost engines and a gateway whose event-loop thread runs under cProfile (this module
is also the gateway's entry point: ``python -m turnkv.bench.profile PROF_FILE serve ...``; SIGUSR1
writes the profile and exits), sends the load, and writes the raw profile plus the top functions
by own time and by cumulative time. cProfile slows Python code down about 2x: read the shares,
not the absolute times.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pstats
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from turnkv import launch
from turnkv.bench.client import Target
from turnkv.bench.redis_server import RedisServer
from turnkv.bench.runner import run_load
from turnkv.bench.scenarios.overhead import BASE, D_MEMORY, GATEWAY, GW_ENV, ZERO


def profile_gateway(out: Path, *, requests: int, concurrency: int, session: bool, redis: bool = False) -> str:
    """``redis``: the store is a redis-server of the run's own (session ids are sent then)."""
    out.mkdir(parents=True, exist_ok=True)
    prof = out / "gateway.prof"
    session = session or redis
    store = RedisServer().start() if redis else None
    p = launch.sim("prefill", "prefill", *ZERO, log_dir=out)
    d = launch.sim("decode", "decode", *ZERO, *D_MEMORY, log_dir=out)
    try:
        with open(out / "gateway.log", "w") as log:
            gw = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "turnkv.bench.profile",
                    str(prof),
                    "serve",
                    "--prefill",
                    p.url,
                    "--decode",
                    d.url,
                    *GATEWAY,
                    *(("--redis-url", store.url) if store else ()),
                    "--port",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "TURNKV_DECISION_HEADERS": "full", **dict(GW_ENV)},
                start_new_session=True,
            )
        try:
            assert gw.stdout is not None
            url = json.loads(gw.stdout.readline())["listening"]
            wl = replace(BASE, conversations=requests, concurrency=concurrency, session_header=session, seed=31)
            records = asyncio.run(run_load(wl, Target(url=url), label="profile", show_progress=False))
        finally:
            gw.send_signal(signal.SIGUSR1)
            gw.wait(30)
    finally:
        d.stop()
        p.stop()
        if store is not None:
            store.close()
    buf = io.StringIO()
    errors = sum(1 for r in records if not r.ok)
    buf.write(
        f"{len(records)} requests ({errors} failed), {concurrency} concurrent, "
        f"{'with' if session else 'without'} session ids{', Redis store' if redis else ''}\n"
    )
    stats = pstats.Stats(str(prof), stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    text = buf.getvalue()
    (out / "profile.txt").write_text(text)
    return text


def _profiled_main(prof: str, argv: list[str]) -> None:
    """The ``turnkv`` command under the profiler. Its module is looked up by name (the command runs this
    module, not the other way round), and loaded before the profiler starts, so the profile is the
    gateway's work and not its imports."""
    import cProfile
    import importlib

    command = importlib.import_module("turnkv.cli")
    profiler = cProfile.Profile()

    def dump(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(prof)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    profiler.enable()
    command.main(argv)


if __name__ == "__main__":
    _profiled_main(sys.argv[1], sys.argv[2:])
