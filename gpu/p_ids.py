#!/usr/bin/env python3
"""What P's request costs with the two things a checked pull adds to it: the prompt ids back, a salt of its own.

A pull sent ahead of the token check (``turn.ahead``, policy ``always-pull``) differs from vLLM's multi-turn
proxy's request to P in two fields: ``return_token_ids`` (P returns the prompt ids the check runs on) and a
``cache_salt`` of the turn's own (every request carries the tenant's salt; this one differs per turn). Run 4
and 5 of BENCHMARKS.md §3 found always-pull's P leg 2-3 ms longer at a 2k history. This sends P alone
(the 8b shape, prefix cache off, as in the render-ahead runs) the same prompt four ways, one round per prompt
with the four in rotated order: ``base`` (a fixed salt, as the tenant's), ``ids``, ``salt`` (a new salt per
request) and ``ids+salt``; non-streamed, one answer token, no KV transfer. It reports each variant's median
latency and its per-round ratio to ``base``, and the response size.

Writes OUT/p_ids.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from typing import Any

import devlib
import engines

M = devlib.MODEL_NAME
VARIANTS = ("base", "ids", "salt", "ids+salt")


def body(messages: list[dict[str, str]], variant: str) -> dict[str, Any]:
    b: dict[str, Any] = {"model": M, "messages": messages, "max_tokens": 1, "temperature": 0}
    b["cache_salt"] = f"turnkv-ahead-{uuid.uuid4().hex[:24]}" if "salt" in variant else "turnkv-tenant-fixed"
    if "ids" in variant:
        b["return_token_ids"] = True
    return b


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for h in sorted({r["history"] for r in rows}):
        at = [r for r in rows if r["history"] == h and r["status"] == 200]
        base = {r["round"]: r["ms"] for r in at if r["variant"] == "base"}
        for v in VARIANTS:
            mine = [r for r in at if r["variant"] == v]
            ratios = [r["ms"] / base[r["round"]] for r in mine if r["round"] in base]
            out[f"{h} {v}"] = {
                "n": len(mine),
                "ms_p50": round(statistics.median(r["ms"] for r in mine), 2) if mine else None,
                "per_round_ratio_p50": round(statistics.median(ratios), 4) if ratios else None,
                "bytes_p50": statistics.median(r["bytes"] for r in mine) if mine else None,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--histories", default="2048,16384")
    ap.add_argument("--rounds", default="80,30", help="rounds per history, in the same order")
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--ucx", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--time-budget-s", type=float, default=300.0, help="start no round after this (P's start in)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    spec = engines.pair(
        "8b",
        p_flags=["--no-enable-prefix-caching"],
        env=dict(kv.split("=", 1) for kv in a.ucx),
        max_model_len=a.max_model_len,
    )[0]
    devlib.start_engine(spec)
    p = spec.url
    words = [w for w, _ in devlib.words_for(p, 3000)]
    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"args": vars(a), "rows": rows}
    plan = zip([int(h) for h in a.histories.split(",")], [int(n) for n in a.rounds.split(",")], strict=True)
    for history, rounds in plan:
        for rnd in range(rounds):
            if time.perf_counter() - t_start > a.time_budget_s:
                res.setdefault("cut", []).append({"history": history, "round": rnd})
                break
            messages = [
                {"role": "system", "content": " ".join(rng.choice(words) for _ in range(history))},
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(a.user_tokens))},
            ]
            k = rnd % len(VARIANTS)
            for variant in VARIANTS[k:] + VARIANTS[:k]:
                rep = devlib.post(p, "/v1/chat/completions", body(messages, variant))
                usage = (rep.json.get("usage") if isinstance(rep.json, dict) else None) or {}
                rows.append(
                    {
                        "history": history,
                        "round": rnd,
                        "variant": variant,
                        "status": rep.status,
                        "ms": round(rep.seconds * 1e3, 2),
                        "bytes": len(rep.raw),
                        "prompt_tokens": usage.get("prompt_tokens"),
                    }
                )
        devlib.log(f"p_ids h={history}: {summary([r for r in rows if r['history'] == history])}")
        devlib.write_json(devlib.out_dir() / "p_ids.json", res)
    res["summary"] = summary(rows)
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    devlib.write_json(devlib.out_dir() / "p_ids.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
