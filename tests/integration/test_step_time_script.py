"""gpu/step_time.py and gpu/fit_step_time.py against the simulator (TURNKV_GPU_BACKEND=sim): the script
starts its engine, streams, injects prefills, writes its raw result, and the fit reads it. Structure
only; what the fit finds depends on this machine's load."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

GPU = Path(__file__).resolve().parents[2] / "gpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_step_time_against_the_simulator_then_the_fit(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TURNKV_GPU_BACKEND": "sim",
        "TURNKV_GPU_STATE": str(tmp_path / "state"),
        "OUT": str(tmp_path / "out"),
    }
    cmd = [
        sys.executable,
        str(GPU / "step_time.py"),
        "--batches",
        "1,4",
        "--contexts",
        "256",
        "--prefills",
        "256,1024",
        "--reps",
        "1",
        "--port",
        str(_free_port()),
        "--time-budget-s",
        "120",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "step_time.json").read_text())
    assert res["backend"] == "sim" and res["sim_time_scale"] == 1.0 and not res["skipped"]
    assert [(g["batch"], g["context"]) for g in res["groups"]] == [(1, 256), (4, 256)]
    for g in res["groups"]:
        assert "error" not in g
        assert len(g["streams"]) == g["batch"] and all(len(s["times"]) > 20 for s in g["streams"])
        # per prefill size and rep: a fresh prompt, the prefix it then extends, and the extension
        assert [(i["prefill"], i["over"]) for i in g["injections"]] == [
            (256, 0),
            (256, 0),
            (256, 256),
            (1024, 0),
            (256, 0),
            (1024, 256),
        ]
        assert all(i["status"] == 200 and i["sent"] < i["ended"] for i in g["injections"])
    assert all(s["quiet_itl_ms"] is not None for s in res["summary"])
    fit = subprocess.run(
        [
            sys.executable,
            str(GPU / "fit_step_time.py"),
            str(tmp_path / "out" / "step_time.json"),
            "--json",
            str(tmp_path / "fit.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fit.returncode == 0, fit.stderr[-2000:]
    out = json.loads((tmp_path / "fit.json").read_text())
    assert out["fit"]["samples"] == len(out["samples"]) >= 10
    assert "--decode-ctx-ns" in out["flags"] and "turnkv sim --decode-itl-ms" in fit.stdout
