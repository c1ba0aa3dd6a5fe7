#!/usr/bin/env python3
"""The engine sets the GPU session uses, and a command line to start, stop and list them.

* ``trio``: the history-sensitive model (gpu/make_sharp_model.py) as prefill P on :8100 (prefix caching
  off), decode D0 on :8200 (no plugin) and decode D1 on :8300 (turnkv plugin), 0.25 of the GPU each,
  NIXL with bidirectional KV on all three, request chat templates allowed (the correctness runs send
  the "strip" template per request). For fixtures, the plugin check and correctness.
* ``pair8b``: gpu/make_model.py's 8b model with dummy weights (Qwen3-8B shape), P on :8100 and D on :8200, both with
  the plugin (on D so that streamed turns capture D's handle, on both so that each says which GPU it
  computes on), 0.42 of the GPU's memory each. For TTFT and load.
* ``pair1b``: gpu/make_model.py's 1b model, for link-rate experiments (engine restarts are cheaper).

usage: engines.py up trio|pair8b|pair1b [--p-flags=...] [--ucx NAME=VALUE ...]
       engines.py down [PREFIX] | status
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
from devlib import EngineSpec

SHARP = str(devlib.SHARP_MODEL)


def trio(model: str = SHARP, *, template: str = "keep", base_port: int = 8100, dummy: bool = False) -> list[EngineSpec]:
    """P without prefix caching (as after an eviction: P pulls every block D holds that matches, so the
    reuse path is exercised on every turn), D0 and D1 with it. ``template`` and ``base_port`` matter
    for the simulator only (vLLM gets the strip template per request)."""
    common = {"model": model, "mem": 0.25, "dummy": dummy, "sim_extra": ["--template", template]}
    trust = ["--trust-request-chat-template"]
    b = base_port
    return [
        EngineSpec(
            "p" + ("" if b == 8100 else str(b)),
            "prefill",
            b,
            5600 + b - 8100,
            flags=[*trust, "--no-enable-prefix-caching"],
            **common,
        ),  # type: ignore[arg-type]
        EngineSpec("d0" + ("" if b == 8100 else str(b)), "decode", b + 100, 5601 + b - 8100, flags=trust, **common),  # type: ignore[arg-type]
        EngineSpec(
            "d1" + ("" if b == 8100 else str(b)), "decode", b + 200, 5602 + b - 8100, plugin=True, flags=trust, **common
        ),  # type: ignore[arg-type]
    ]


def start_trio(*, start: bool = True) -> tuple[list[EngineSpec], dict[str, object]]:
    """Start the trio, falling back where something does not start, so that one call still returns
    what it can: gpu/make_model.py's 1b model with dummy weights if the history-sensitive model does not load
    (fixtures and the plugin check stay valid; correctness results then prove nothing), and no
    plugin engine if D1 does not start (its cases are left out). ``start=False`` returns what an
    earlier call of this machine started (recorded in STATE_DIR/trio-state.json)."""
    state_file = devlib.STATE_DIR / "trio-state.json"
    if not start and state_file.exists():
        note = json.loads(state_file.read_text())
        return trio(str(note["model"]), dummy=bool(note["dummy"])), note
    note: dict[str, object] = {"failures": []}
    choices = [(SHARP, False)] + ([(str(devlib.KIT / "model-1b-keep"), True)] if devlib.backend() == "vllm" else [])
    for model, dummy in choices:
        specs = trio(model, dummy=dummy)
        note.update(model=model, dummy=dummy, history_sensitive=not dummy, plugin_engine=True)
        if not start:
            return specs, note
        try:
            for s in specs[:2]:
                devlib.start_engine(s)
        except RuntimeError as exc:
            note["failures"].append(f"{model}: {str(exc)[-1500:]}")  # type: ignore[union-attr]
            devlib.stop_all()
            continue
        try:
            devlib.start_engine(specs[2])
        except RuntimeError as exc:
            note["failures"].append(f"plugin engine: {str(exc)[-1500:]}")  # type: ignore[union-attr]
            note["plugin_engine"] = False
        devlib.STATE_DIR.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(note))
        return specs, note
    raise RuntimeError("no trio could be started: " + json.dumps(note["failures"])[-3000:])


def pair(
    size: str,
    *,
    p_flags: list[str] | None = None,
    d_flags: list[str] | None = None,
    env: dict[str, str] | None = None,
    kv_extra: dict[str, object] | None = None,
    mem: float = 0.42,
    p_sim_extra: list[str] | None = None,
    d_sim_extra: list[str] | None = None,
    gpus: tuple[str, str] | None = None,
    max_model_len: int | None = None,
) -> list[EngineSpec]:
    """``*_sim_extra``: flags for the simulator only (e.g. a small ``--num-gpu-blocks`` on D); ``gpus``: P's
    and D's ``CUDA_VISIBLE_DEVICES`` (None: both on the first GPU, sharing it); ``max_model_len``: both
    engines' ``--max-model-len`` (None: EngineSpec's default, so that engines started without it are reused)."""
    model = str(devlib.KIT / f"model-{size}-keep")
    own = [{"CUDA_VISIBLE_DEVICES": g} for g in gpus] if gpus else [{}, {}]
    base: dict[str, object] = {"model": model, "mem": mem, "kv_extra": dict(kv_extra or {})}
    if max_model_len is not None:
        base["max_model_len"] = max_model_len
    p_common = {**base, "env": {**dict(env or {}), **own[0]}}
    d_common = {**base, "env": {**dict(env or {}), **own[1]}}
    return [
        EngineSpec(
            "p",
            "prefill",
            8100,
            5600,
            plugin=True,  # it says which GPU it computes on: the gateway's shared_gpu auto compares it with D's
            flags=list(p_flags or []),
            sim_extra=list(p_sim_extra or []),
            **p_common,
        ),  # type: ignore[arg-type]
        EngineSpec(
            "d",
            "decode",
            8200,
            5601,
            plugin=True,
            flags=list(d_flags or []),
            sim_extra=list(d_sim_extra or []),
            **d_common,
        ),  # type: ignore[arg-type]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("set", choices=["trio", "pair8b", "pair1b"])
    up.add_argument("--p-flags", default="", help="extra vllm serve flags for P, space-separated")
    up.add_argument("--ucx", nargs="*", default=[], help="NAME=VALUE environment for both engines")
    down = sub.add_parser("down")
    down.add_argument("prefix", nargs="?", default="")
    sub.add_parser("status")
    a = ap.parse_args(argv)
    if a.cmd == "down":
        devlib.stop_all(a.prefix)
        return 0
    if a.cmd == "status":
        for rec in devlib.recorded():
            up = "up" if devlib.healthy(rec["url"]) else "DOWN"
            print(f"{rec['name']:10} pid {rec['pid']:>7} {up:5} {rec['url']}")
        return 0
    env = dict(kv.split("=", 1) for kv in a.ucx)
    if a.set == "trio":
        print(json.dumps(start_trio()[1], indent=1))
        return 0
    for s in pair(a.set[4:], p_flags=a.p_flags.split(), env=env):
        devlib.start_engine(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
