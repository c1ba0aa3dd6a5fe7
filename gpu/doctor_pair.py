#!/usr/bin/env python3
"""``turnkv doctor`` on the H200, UCX on TCP and CUDA IPC side by side: for each variant the 8b pair (P on
:8100, D on :8200, both on the one GPU, bidirectional KV, UCX_LOG_LEVEL=info so the logs name UCX's lanes)
is started with the variant's environment, the doctor runs against it with both engines' logs, and its
report (text, JSON, profile) lands in OUT. The doctor alone is to reproduce what link_rate.py measured:
about 0.45 GB/s on TCP, tens of GB/s (and more P -> D) with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y.

Variants: tcp (nothing set: UCX's choice, TCP on this host), ipc (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y).
With --no-start it runs the doctor once against whatever answers on :8100 and :8200 (label "up").

Writes OUT/doctor_<variant>.json (the report; its "profile" is what turnkv serve --profile loads),
OUT/doctor_<variant>.txt (what an operator reads) and OUT/profile_<variant>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

VARIANTS = {"tcp": {}, "ipc": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}}
P_URL, D_URL = f"http://{devlib.HOST}:8100", f"http://{devlib.HOST}:8200"


def doctor(label: str, out: Path, timeout_s: float, budget_s: float, extra: list[str]) -> int:
    logs = devlib.log_dir()
    python = "python3" if devlib.backend() == "vllm" else sys.executable
    cmd = [
        python,
        "-m",
        "turnkv",
        "doctor",
        "--prefill",
        P_URL,
        "--decode",
        D_URL,
        "--json",
        str(out / f"doctor_{label}.json"),
        "--profile",
        str(out / f"profile_{label}.json"),
        "--log",
        f"prefill={logs / 'p.log'}",
        "--log",
        f"decode={logs / 'd.log'}",
        "--budget-s",
        str(budget_s),
        *extra,
    ]
    env = {**devlib.os.environ, **devlib.gateway_env()}
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        devlib.log(f"doctor {label}: no answer within {timeout_s:.0f} s")
        return 124
    (out / f"doctor_{label}.txt").write_text(done.stdout + ("\n" + done.stderr if done.stderr else ""))
    devlib.log(f"doctor {label}: exit {done.returncode} in {time.monotonic() - t0:.0f} s")
    print(done.stdout[-6000:])
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="tcp,ipc")
    ap.add_argument("--size", default="8b", choices=["1b", "8b"])
    ap.add_argument("--budget-s", type=float, default=90.0, help="the doctor's transfer probe, per variant")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="one doctor run, whole")
    ap.add_argument("--no-start", action="store_true", help="run once against the engines up on :8100 and :8200")
    ap.add_argument("--keep-running", action="store_true", help="leave the last variant's engines up")
    ap.add_argument("doctor_args", nargs="*", help="more flags for turnkv doctor (after --)")
    a = ap.parse_args(argv)
    out = devlib.out_dir()
    if a.no_start:
        return doctor("up", out, a.timeout_s, a.budget_s, a.doctor_args)
    worst = 0
    names = [v for v in a.variants.split(",") if v]
    for i, name in enumerate(names):
        env = {"UCX_LOG_LEVEL": "info", **VARIANTS[name]}
        devlib.stop_all()  # both engines restart with the variant's environment
        specs = engines.pair(a.size, env=env)
        try:
            for s in specs:
                devlib.start_engine(s)
        except RuntimeError as exc:
            (out / f"doctor_{name}.txt").write_text(f"engines did not start: {exc}"[-4000:])
            worst = max(worst, 2)
            continue
        worst = max(worst, doctor(name, out, a.timeout_s, a.budget_s, a.doctor_args))
        if not (a.keep_running and i == len(names) - 1):
            devlib.stop_all()
    return worst


if __name__ == "__main__":
    sys.exit(main())
