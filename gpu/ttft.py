#!/usr/bin/env python3
"""Time to first token by turn (1..6) through turnkv, on the 8b shape, per policy; and the NIXL rate.

Engines: gpu/engines.py ``pair8b`` (gpu/make_model.py's Qwen3-8B-shaped model, dummy weights, which is fine for
timing; P on :8100, D on :8200 with the turnkv plugin so that streamed turns capture D's handle),
both on the one H200. ``--p-cache off`` restarts P with ``--no-enable-prefix-caching`` (D keeps its).

Modes, each a fresh conversation per history length (its own random one-token words, so no two
conversations share a prefix):
* ``plain``: through turnkv without a conversation id: vLLM's standard P/D (P recomputes, D pulls P's KV);
* ``always-pull``, ``never-pull``, ``decode-local``, ``adaptive``: turnkv's policies (``X-Session-ID``);
* ``adaptive-pull``: ``adaptive`` with decode-local off, so it chooses between pulling and recomputing;
* ``vllm-multiturn``: the gateway as vLLM's multi-turn proxy (policy ``vllm-multiturn``: every later turn
  pulls the previous handle with the messages, nothing checked): the baseline for the two below;
* ``always-pull-beside``: ``always-pull`` with the gateway setting ``ahead_check: render`` (the token check
  on a render call sent beside P's leg), where ``always-pull`` as shipped checks the prompt ids P returns;
* ``colocated``: straight to D without P: one instance doing prefill and decode.

``--order modes`` (the default) runs history by history, mode by mode, the reps of a mode back to back;
``--order rounds`` runs history by history, rep by rep, every mode once per rep (A B C A B C), so that the
modes alternate against this GPU's drift; ``--order abba`` as rounds, every other rep in reverse (A B B A),
so that no mode always runs first in its round (what comes of a conversation's place shows up as such).
Each run row says its history, mode, rep and round, the conversation id it sent, the byte range of the
gateway's log (STATE_DIR/logs/gw-ttft.log) its turns were logged in, and those turn events (ahead,
render_ms, prefill_ms, ...); each turn's row its NIXL reads on P and on D. The summary gives, per history and
mode, the median TTFT of turns 2..N over all reps, and its ratio to ``vllm-multiturn``'s at that history.

Each turn streams (``max_tokens`` answer words, ``ignore_eos``, greedy over one-token words so the
answer re-tokenizes exactly, as a real model's mostly does); TTFT is measured by this client, at the
first chunk with generated text. turnkv's decision headers are kept per turn. NIXL transfers are read
from both engines' /metrics around each conversation (P reads D's blocks when it pulls; D reads P's
every turn), and the engines' "KV Transfer metrics" log lines are collected at the end.

Writes OUT/ttft_<label>.json (after every conversation). A time budget (counted from this script's start,
engine start included) stops starting conversations before the call's limit: none starts past it, nor one
that the slowest conversation seen so far at its history (or, before any, at a shorter one) would carry
past it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
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
# mode -> (the gateway's policy, the policy's params, more gateway settings); plain and colocated send no
# conversation id (colocated no gateway at all): their policy is never asked
MODE_TABLE: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # plain P/D: no conversation at all (the gateway would otherwise find each one from its history, as load.py says)
    "plain": ("adaptive", {}, {"conversation_from_history": False}),
    "colocated": ("adaptive", {}, {}),
    "always-pull": ("always-pull", {}, {}),
    "never-pull": ("never-pull", {}, {}),
    "adaptive": ("adaptive", {}, {}),
    "decode-local": ("decode-local", {}, {}),
    "adaptive-pull": ("adaptive", {"decode_local": False}, {}),
    "vllm-multiturn": ("vllm-multiturn", {}, {}),
    "always-pull-beside": ("always-pull", {}, {"ahead_check": "render"}),
}
BASELINE = "vllm-multiturn"  # the summary's ratios are to this mode's median at the same history
GATEWAY = "gw-ttft"
GATEWAY_PORT = 8901
# what each turn event of the gateway's log keeps in the JSON
GW_FIELDS = (
    "turn",
    "outcome",
    "action",
    "reason",
    "ahead",
    "render_ms",
    "prefill_ms",
    "ttft_ms",
    "tokens_planned_pull",
    "tokens_cached",
    "prompt_tokens",
    "capture",
    "divergence",
)
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
    engines: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One conversation against ``url`` (the gateway, or D itself); a row per turn. With ``engines`` (P's and
    D's URLs) each row also gets the turn's NIXL reads on each (their /metrics read between turns)."""
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
        before = [devlib.metrics(e) for e in engines or ()]
        rep = devlib.post(url, "/v1/chat/completions", body, headers=hdrs)
        text = "".join(
            ((c.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            for c in devlib.chunks(rep)
            if isinstance(c, dict) and c.get("choices")
        )
        row: dict[str, Any] = {
            "turn": k + 1,
            "status": rep.status,
            "ttft_ms": None if rep.first_token_s is None else round(rep.first_token_s * 1e3, 1),
            "total_ms": round(rep.seconds * 1e3, 1),
            **{h[len("x-turnkv-") :]: v for h, v in rep.headers.items() if h.startswith("x-turnkv-")},
        }
        if engines is not None:
            after = [devlib.metrics(e) for e in engines]
            row["nixl_p"], row["nixl_d"] = (devlib.nixl_delta(b, a) for b, a in zip(before, after, strict=True))
        rows.append(row)
        if rep.status != 200:
            row["error"] = rep.raw[:300]
            break
        msgs.append({"role": "assistant", "content": text})
    return rows


def engine_lines(name: str, start: int) -> list[str]:
    """The "KV Transfer metrics" lines an engine logged after byte ``start`` of its log."""
    return [m.group(0) for m in XFER_LINE.finditer(devlib.log_text(name, start))]


def gateway_turns(start: int, end: int) -> list[dict[str, Any]]:
    """The turn events the gateway logged between bytes ``start`` and ``end`` of its log, trimmed to GW_FIELDS."""
    events = devlib.log_events(GATEWAY, start, max(end - start, 0))
    return [{k: ev.get(k) for k in GW_FIELDS} for ev in events if ev.get("event") == "turn"]


def run_order(histories: list[int], modes: list[str], reps: int, order: str) -> list[tuple[int, str, int]]:
    """(history, mode, rep) in the order they run: ``modes``: the reps of a mode back to back; ``rounds``: one
    of each mode per rep (A B C A B C); ``abba``: as rounds, odd reps in reverse (A B C C B A)."""
    if order in ("rounds", "abba"):
        flip = order == "abba"
        return [(h, m, r) for h in histories for r in range(reps) for m in (modes[::-1] if flip and r % 2 else modes)]
    return [(h, m, r) for h in histories for m in modes for r in range(reps)]


def estimate_s(runs: list[dict[str, Any]], history: int) -> float:
    """How long a conversation at ``history`` may take: the slowest seen at it, else the slowest at a shorter
    history (not scaled: a conversation's time is mostly fixed costs, the gateway's start and the decode
    steps, and the step's limit leaves 75 s past the budget for the rest); 0 before any ran."""
    same = [r["seconds"] for r in runs if r["history"] == history]
    shorter = [r["seconds"] for r in runs if r["history"] < history]
    return float(max(same or shorter or [0.0]))


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
    ap.add_argument(
        "--order",
        choices=["modes", "rounds", "abba"],
        default="modes",
        help="modes: per history, each mode's reps back to back; rounds: per history, per rep, each mode once; "
        "abba: rounds, every other one in reverse",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="both engines' --max-model-len (default: devlib.EngineSpec's, 32768)",
    )
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
    t_start = time.perf_counter()  # the budget counts from here: engine start included
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODE_TABLE]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {', '.join(MODE_TABLE)}")
    histories = [int(h) for h in a.histories.split(",") if h]
    p_flags = [] if a.p_cache == "on" else ["--no-enable-prefix-caching"]
    specs = engines.pair(
        a.size, p_flags=p_flags, env=dict(kv.split("=", 1) for kv in a.ucx), max_model_len=a.max_model_len
    )
    starts, waited = {}, {}
    for s in specs:  # start_s: the engine's own start (an earlier call's, where it was kept up and reused)
        t_engine = time.perf_counter()
        starts[s.name] = devlib.start_engine(s).get("start_s")
        waited[s.name] = round(time.perf_counter() - t_engine, 1)
    p, d = specs[0].url, specs[1].url
    pairs = devlib.words_for(p, 3000)
    words = [w for w, _ in pairs]
    allowed = [i for _, i in pairs[:400]]
    rng = random.Random(a.seed)
    logs0 = {s.name: devlib.log_size(s.name) for s in specs}
    res: dict[str, Any] = {
        "backend": devlib.backend(),
        "label": a.label,
        "args": vars(a),
        "engine_start_s": starts,
        "engine_wait_s": waited,  # this call's wait for each engine (about 0 where it was reused)
        "engines": {s.name: devlib.vllm_command(s)[0] for s in specs},
        "runs": [],
        "skipped": [],
    }
    # full decision headers: each turn's row also gets P's time (x-turnkv-prefill-ms), its cached and
    # planned-pull token counts, the prompt's length
    settings: dict[str, Any] = {"health_interval_s": 1.0, "scrape_interval_s": 2.0, "decision_headers": "full"}
    if a.size == "1b":
        settings["kv_bytes_per_token"] = 2 * 28 * 8 * 128 * 2
    plan = run_order(histories, modes, a.reps, a.order)
    for i, (history, mode, rep) in enumerate(plan):
        elapsed = time.perf_counter() - t_start
        est = estimate_s(res["runs"], history)
        if elapsed > a.time_budget_s or elapsed + est > a.time_budget_s:
            why = "budget" if elapsed > a.time_budget_s else f"would end past the budget (est. {est:.0f} s)"
            res["skipped"].append({"history": history, "mode": mode, "rep": rep, "why": why})
            continue
        policy, params, extra = MODE_TABLE[mode]
        gw_settings = {**settings, **extra, "policy": {"name": policy, "params": params}}
        before = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
        t0 = time.perf_counter()
        kw = {"history": history, "turns": a.turns, "user": a.user_tokens, "answer": a.answer_tokens}
        session = None if mode in ("plain", "colocated") else f"{mode}-{history}-r{rep}-{uuid.uuid4().hex[:8]}"
        gw_log: list[int] | None = None
        if mode == "colocated":
            rows = conversation_turns(d, words, allowed, rng, session=None, **kw)
        else:
            gw_log = [devlib.log_size(GATEWAY), 0]
            with devlib.gateway(GATEWAY, GATEWAY_PORT, [p], [d], policy=policy, settings=gw_settings) as gw:
                rows = conversation_turns(gw, words, allowed, rng, session=session, engines=(p, d), **kw)
            gw_log[1] = devlib.log_size(GATEWAY)  # stopped: its last turn event is written
        after = {"p": devlib.metrics(p), "d": devlib.metrics(d)}
        run = {
            "history": history,
            "mode": mode,
            "rep": rep,
            "seq": i,  # position in the run order
            "order": a.order,
            "p_cache": a.p_cache,
            "policy": None if mode in ("plain", "colocated") else policy,
            "gateway_settings": extra,
            "session": session,
            "started_s": round(t0 - t_start, 1),
            "turns": rows,
            "seconds": round(time.perf_counter() - t0, 1),
            "nixl_p_reads": devlib.nixl_delta(before["p"], after["p"]),
            "nixl_d_reads": devlib.nixl_delta(before["d"], after["d"]),
            "gateway_log": None if gw_log is None else {"file": f"logs/{GATEWAY}.log", "bytes": gw_log},
            "gateway_turns": [] if gw_log is None else gateway_turns(*gw_log),
        }
        res["runs"].append(run)
        aheads = [r.get("ahead") for r in rows[1:]]
        devlib.log(
            f"{a.label} h={history} {mode} rep {rep}: TTFT ms by turn {[r['ttft_ms'] for r in rows]} "
            f"ahead {aheads} render ms {[t['render_ms'] for t in run['gateway_turns'][1:]]} "
            f"(P pulled {run['nixl_p_reads']['bytes'] / 1e6:.0f} MB at "
            f"{run['nixl_p_reads']['gb_per_s'] or 0:.2f} GB/s)"
        )
        devlib.write_json(devlib.out_dir() / f"ttft_{a.label}.json", res)
    res["kv_transfer_log_lines"] = {s.name: engine_lines(s.name, logs0[s.name])[-40:] for s in specs}
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    res["summary"] = by_history_mode(res["runs"])
    devlib.write_json(devlib.out_dir() / f"ttft_{a.label}.json", res)
    print(json.dumps(summary(res), indent=1))
    return 0


def later_ttfts(run: dict[str, Any]) -> list[float]:
    """TTFT of a run's turns 2..N that answered."""
    return [t["ttft_ms"] for t in run["turns"][1:] if t.get("ttft_ms") is not None and t["status"] == 200]


def by_history_mode(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per history and mode: the median TTFT of turns 2..N over all reps (each turn one sample), the
    median of the reps' own medians, how many turns and reps, turnkv's decisions on those turns, and the
    ratio of the median to ``vllm-multiturn``'s at the same history (None where it did not run)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["history"], r["mode"]), []).append(r)
    out: dict[str, dict[str, Any]] = {}
    medians: dict[tuple[int, str], float | None] = {}
    for (history, mode), rs in sorted(groups.items()):
        per_run = [later_ttfts(r) for r in rs]
        later = [x for v in per_run for x in v]
        per_rep = [statistics.median(v) for v in per_run if v]
        med = statistics.median(later) if later else None
        medians[(history, mode)] = med
        decisions: dict[str, int] = {}
        for r in rs:
            for t in r["turns"][1:]:
                k = f"{t.get('outcome')}/{t.get('action')}/ahead={t.get('ahead')}"
                decisions[k] = decisions.get(k, 0) + 1
        renders = [g["render_ms"] for r in rs for g in r.get("gateway_turns", [])[1:] if g.get("render_ms") is not None]
        out[f"{history} {mode}"] = {
            "history": history,
            "mode": mode,
            "reps": len(rs),
            "later_turns": len(later),
            "ttft_ms_median_turns_2_n": None if med is None else round(med, 1),
            "ttft_ms_median_of_rep_medians": round(statistics.median(per_rep), 1) if per_rep else None,
            "ttft_ms_min_max": [min(later), max(later)] if later else None,
            "decisions_turns_2_n": decisions,
            "gateway_render_ms_median": round(statistics.median(renders), 2) if renders else None,
        }
    for row in out.values():
        base = medians.get((row["history"], BASELINE))
        med = medians[(row["history"], row["mode"])]
        row[f"ratio_to_{BASELINE}"] = round(med / base, 3) if med is not None and base else None
    return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
    table = {f"{r['history']} {r['mode']} rep {r['rep']}": [t["ttft_ms"] for t in r["turns"]] for r in res["runs"]}
    rates = [
        r[k]["gb_per_s"]
        for r in res["runs"]
        for k in ("nixl_p_reads", "nixl_d_reads")
        if r[k]["gb_per_s"] and r[k]["bytes"] > 10e6
    ]
    rows = res.get("summary") or by_history_mode(res["runs"])
    return {
        "label": res["label"],
        "median_ttft_ms_turns_2_n": {
            k: f"{v['ttft_ms_median_turns_2_n']} ms over {v['later_turns']} turns of {v['reps']} reps, "
            f"{v[f'ratio_to_{BASELINE}']}x {BASELINE}"
            for k, v in rows.items()
        },
        "ttft_ms_by_turn": table,
        "nixl_gb_per_s": sorted(round(x, 3) for x in rates),
        "skipped": res["skipped"],
        "seconds": res.get("seconds"),
    }


if __name__ == "__main__":
    sys.exit(main())
