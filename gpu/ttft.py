#!/usr/bin/env python3
"""Time to first token by turn (1..6) through turnkv, on the 8b shape, per policy; and the NIXL rate.

Engines: gpu/engines.py ``pair8b`` (the kit's Qwen3-8B-shaped model, dummy weights, which is fine for
timing; P on :8100, D on :8200 with the turnkv plugin so that streamed turns capture D's handle),
both on the one H200. ``--p-cache off`` restarts P with ``--no-enable-prefix-caching`` (D keeps its).

Modes, each a fresh conversation per history length (its own random one-token words, so no two
conversations share a prefix):
* ``plain``: through turnkv without a conversation id: vLLM's standard P/D (P recomputes, D pulls P's KV);
* ``always-pull``, ``never-pull``, ``decode-local``, ``adaptive``: turnkv's policies (``X-Session-ID``);
* ``adaptive-pull``: ``adaptive`` with decode-local off, so it chooses between pulling and recomputing;
* ``colocated``: straight to D without P: one instance doing prefill and decode.

Each turn streams (``max_tokens`` answer words, ``ignore_eos``, greedy over one-token words so the
answer re-tokenizes exactly, as a real model's mostly does); TTFT is measured by this client, at the
first chunk with generated text. turnkv's decision headers are kept per turn. NIXL transfers are read
from both engines' /metrics around each conversation (P reads D's blocks when it pulls; D reads P's
every turn), and the engines' "KV Transfer metrics" log lines are collected at the end.

Writes OUT/ttft_<label>.json. A time budget stops starting conversations before the call's limit.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import devlib
import engines

M = devlib.MODEL_NAME
MODES = ("plain", "always-pull", "never-pull", "adaptive", "decode-local", "colocated")
POLICY_PARAMS = {"adaptive-pull": ("adaptive", {"decode_local": False})}
GATEWAY_PORT = 8901
XFER_LINE = re.compile(r"KV Transfer metrics: .*")


def conversation_turns(
    url: str,
    words: list[str],
    allowed: list[int],
    rng: random.Random,
    *,
    history: int,
    turns: int,
    user: int,
    answer: int,
    session: str | None,
) -> list[dict[str, Any]]:
    """One conversation against ``url`` (the gateway, or D itself); a row per turn."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(history))}]
    rows = []
    for k in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(user))})
        body = {
            "model": M,
            "messages": msgs,
            "max_tokens": answer,
            "ignore_eos": True,
            "temperature": 0,
            "allowed_token_ids": allowed,
            "stream": True,
        }
        hdrs = {"x-session-id": session} if session else {}
        rep = devlib.post(url, "/v1/chat/completions", body, headers=hdrs)
        text = "".join(
            ((c.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            for c in devlib.chunks(rep)
            if isinstance(c, dict) and c.get("choices")
        )
        row = {
            "turn": k + 1,
            "status": rep.status,
            "ttft_ms": None if rep.first_token_s is None else round(rep.first_token_s * 1e3, 1),
            "total_ms": round(rep.seconds * 1e3, 1),
            **{h[len("x-turnkv-") :]: v for h, v in rep.headers.items() if h.startswith("x-turnkv-")},
        }
        rows.append(row)
        if rep.status != 200:
            row["error"] = rep.raw[:300]
            break
        msgs.append({"role": "assistant", "content": text})
    return rows


def engine_lines(name: str, start: int) -> list[str]:
    """The "KV Transfer metrics" lines an engine logged after byte ``start`` of its log."""
    f = devlib.STATE_DIR / "logs" / f"{name}.log"
    try:
        with open(f, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [m.group(0) for m in XFER_LINE.finditer(text)]


def log_size(name: str) -> int:
    f = devlib.STATE_DIR / "logs" / f"{name}.log"
    return f.stat().st_size if f.exists() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="cache_on")
    ap.add_argument("--p-cache", choices=["on", "off"], default="on")
    ap.add_argument("--size", default="8b", choices=["8b", "1b"])
    ap.add_argument("--histories", default="4096,16384")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=100)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--ucx",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for both engines, e.g. UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y",
    )
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=480.0,
        help="start no conversation after this many seconds (engine start included)",
    )
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    p_flags = [] if a.p_cache == "on" else ["--no-enable-prefix-caching"]
    specs = engines.pair(a.size, p_flags=p_flags, env=dict(kv.split("=", 1) for kv in a.ucx))
    starts = {s.name: devlib.start_engine(s).get("start_s") for s in specs}
    p, d = specs[0].url, specs[1].url
    pairs = devlib.words_for(p, 3000)
    words = [w for w, _ in pairs]
    allowed = [i for _, i in pairs[:400]]
    rng = random.Random(a.seed)
    logs0 = {s.name: log_size(s.name) for s in specs}
    res: dict[str, Any] = {
        "backend": devlib.backend(),
        "label": a.label,
        "args": vars(a),
        "engine_start_s": starts,
        "engines": {s.name: devlib.vllm_command(s)[0] for s in specs},
        "runs": [],
        "skipped": [],
    }
    settings = {"health_interval_s": 1.0, "scrape_interval_s": 2.0}
    if a.size == "1b":
        settings["kv_bytes_per_token"] = 2 * 28 * 8 * 128 * 2
    modes = [m for m in a.modes.split(",") if m]
    for history in (int(h) for h in a.histories.split(",")):
        for mode in modes:
            for rep in range(a.reps):
                if time.perf_counter() - t_start > a.time_budget_s:
                    res["skipped"].append({"history": history, "mode": mode, "rep": rep})
                    continue
                policy, params = POLICY_PARAMS.get(mode, ("adaptive" if mode in ("plain", "colocated") else mode, {}))
                gw_settings = {**settings, "policy": {"name": policy, "params": params}}
                before = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
                t0 = time.perf_counter()
                kw = {"history": history, "turns": a.turns, "user": a.user_tokens, "answer": a.answer_tokens}
                if mode == "colocated":
                    rows = conversation_turns(d, words, allowed, rng, session=None, **kw)
                else:
                    with devlib.gateway("gw-ttft", GATEWAY_PORT, [p], [d], policy=policy, settings=gw_settings) as gw:
                        session = None if mode == "plain" else f"{mode}-{history}-{uuid.uuid4().hex[:8]}"
                        rows = conversation_turns(gw, words, allowed, rng, session=session, **kw)
                after = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
                run = {
                    "history": history,
                    "mode": mode,
                    "rep": rep,
                    "p_cache": a.p_cache,
                    "turns": rows,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "nixl_p_reads": devlib.nixl_delta(before["p"], after["p"]),
                    "nixl_d_reads": devlib.nixl_delta(before["d"], after["d"]),
                }
                res["runs"].append(run)
                devlib.log(
                    f"{a.label} h={history} {mode}: TTFT ms by turn {[r['ttft_ms'] for r in rows]} "
                    f"(P pulled {run['nixl_p_reads']['bytes'] / 1e6:.0f} MB at "
                    f"{run['nixl_p_reads']['gb_per_s'] or 0:.2f} GB/s)"
                )
                devlib.write_json(devlib.out_dir() / f"ttft_{a.label}.json", res)
    res["kv_transfer_log_lines"] = {s.name: engine_lines(s.name, logs0[s.name])[-40:] for s in specs}
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    devlib.write_json(devlib.out_dir() / f"ttft_{a.label}.json", res)
    print(json.dumps(summary(res), indent=1))
    return 0


def summary(res: dict[str, Any]) -> dict[str, Any]:
    table = {f"{r['history']} {r['mode']}": [t["ttft_ms"] for t in r["turns"]] for r in res["runs"]}
    rates = [
        r[k]["gb_per_s"]
        for r in res["runs"]
        for k in ("nixl_p_reads", "nixl_d_reads")
        if r[k]["gb_per_s"] and r[k]["bytes"] > 10e6
    ]
    return {
        "label": res["label"],
        "ttft_ms_by_turn": table,
        "nixl_gb_per_s": sorted(round(x, 3) for x in rates),
        "skipped": res["skipped"],
        "seconds": res.get("seconds"),
    }


if __name__ == "__main__":
    sys.exit(main())
