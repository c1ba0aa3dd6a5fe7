"""The shared-GPU suite: agents at 64 conversations on one GPU that P and D share, in two waves.

The H200 run it stands for: vLLM 0.26 P and D on one H200 at 0.42 of its memory each, 8k-token system
prompts, 200-token user turns, 128-token answers streamed, 0.5 s think time, no session id (agents as
frameworks call the API), 64 conversations of 3 turns, twice on one gateway; turnkv at its defaults beside
plain P/D (the same gateway with ``conversation_from_history: false``). There turnkv bought TTFT with
everyone's ITL (p99 1.6x and 2.6x plain's, a 2.45 s stall inside a stream), its pins holding D's memory
through every think time.

On the simulator at a quarter of the size: 2k-token system prompts; each engine's KV holds half of what
the conversations' contexts need at once (as the H200's 0.42 did); P and D share one simulated GPU's
compute (``--gpu-share-file``: P's prefills lengthen D's steps) and say they are on one GPU (the gateway's
``shared_gpu: auto`` sees it); H200 timing, CUDA IPC link, vLLM 0.33 streams. Reported per configuration
and wave: turns answered, later turns' TTFT, every stream's ITL (p50, p99, max), D's KV held by pins over
the load (the time-average and the peak of its pinned tokens over its KV size), D's preemptions, and the
later turns' actions; then turnkv's ratios to plain P/D, wave by wave.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, percentile, summarize
from turnkv.bench.watch import time_average
from turnkv.bench.workload import WorkloadSpec

BLOCK = 16
SYSTEM_TOKENS = 2048
TURNS = 3
CONTEXT_TOKENS = SYSTEM_TOKENS + TURNS * (200 + 128)  # a conversation's context at its last turn
WORKLOAD = WorkloadSpec(
    conversations=64,
    turns=TURNS,
    system_tokens=SYSTEM_TOKENS,
    user_tokens=200,
    answer_tokens=128,
    think_time_s=0.5,
    rate=0.0,
    concurrency=64,
    session_header=False,
    request_timeout_s=120.0,
    duration_s=600.0,
)
ENGINE = ("--vllm-compat", "0.33", "--link", "h200-ipc", "--kv-lease-duration", "180")
WATCH = ("sim:pinned_tokens", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting")
PLAIN = ("TURNKV_CONVERSATION_FROM_HISTORY", "false")


def engine_blocks(conversations: int) -> int:
    """KV blocks per engine: half of what the conversations' contexts need at once."""
    return conversations * CONTEXT_TOKENS // BLOCK // 2


def _deployment(blocks: int, *env: tuple[str, str]) -> Deployment:
    return Deployment("pd", engine_flags=(*ENGINE, "--num-gpu-blocks", str(blocks)), gateway_env=env, shared_gpu=True)


def _waves(name: str, desc: str, wl: WorkloadSpec) -> tuple[ConfigPlan, ...]:
    """Two waves of conversations of their own on one gateway, the second started when the first ended."""
    return tuple(
        ConfigPlan(f"{name}-wave{w}", "shared gpu", f"{desc}, wave {w}", replace(wl, seed=w), {"mode": name, "wave": w})
        for w in (1, 2)
    )


def benches(conversations: int | None = None) -> list[Bench]:
    n = conversations or WORKLOAD.conversations
    wl = replace(WORKLOAD, conversations=n, concurrency=n)
    blocks = engine_blocks(n)
    return [
        Bench(_deployment(blocks), _waves("turnkv", "turnkv at its defaults", wl), watch=WATCH),
        Bench(
            _deployment(blocks, PLAIN), _waves("plain", "plain P/D (conversation_from_history false)", wl), watch=WATCH
        ),
    ]


def _itl(records: Sequence[RequestRecord]) -> tuple[float, float, float]:
    itl = [x for r in records if r.ok for x in r.itl_ms]
    return percentile(itl, 50), percentile(itl, 99), max(itl, default=math.nan)


def kv_tokens(c: ConfigResult) -> int:
    """Each engine's KV size in tokens, as the configuration gave it."""
    flags = list(c.target.get("engine_flags", []))
    return int(flags[flags.index("--num-gpu-blocks") + 1]) * BLOCK if "--num-gpu-blocks" in flags else 0


def pinned_share(c: ConfigResult) -> tuple[float, float]:
    """D's KV held by pins over the load: the time-average and the peak of its pinned tokens over its KV size
    (NaN: not watched)."""
    series = [(float(t), float(v)) for t, v in c.meta.get("watched", {}).get("decode", {}).get("sim:pinned_tokens", [])]
    avg, size = time_average(series), kv_tokens(c)
    if avg is None or size <= 0:
        return math.nan, math.nan
    return avg / size, max(v for _, v in series) / size


def _row(c: ConfigResult) -> list[object]:
    later = [r for r in c.requests if r.turn > 1]
    s = summarize(later)
    p50, p99, top = _itl(c.requests)
    avg, peak = pinned_share(c)
    d = c.meta.get("engine_metrics", {}).get("decode", {})
    return [
        c.name,
        f"{sum(1 for r in c.requests if r.ok)}/{len(c.requests)}",
        fmt_ms(s.ttft_p50),
        fmt_ms(s.ttft_p99),
        fmt_ms(p50),
        fmt_ms(p99),
        fmt_ms(top),
        "-" if math.isnan(avg) else f"{avg:.1%}",
        "-" if math.isnan(peak) else f"{peak:.1%}",
        int(d.get("vllm:num_preemptions_total", 0)),
        s.actions_text(),
    ]


def ratios(turnkv: ConfigResult, plain: ConfigResult) -> dict[str, float]:
    """turnkv's figures over plain P/D's for one wave: ITL p99 and max, later turns' TTFT p50."""
    t50, t99, tmax = _itl(turnkv.requests)
    p50, p99, pmax = _itl(plain.requests)
    tt = summarize(r for r in turnkv.requests if r.turn > 1).ttft_p50
    pt = summarize(r for r in plain.requests if r.turn > 1).ttft_p50
    return {"itl_p99": t99 / p99, "itl_max": tmax / pmax, "later_ttft_p50": tt / pt}


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    table = md_table(
        [
            "config",
            "answered",
            "TTFT_2+ p50",
            "TTFT_2+ p99",
            "ITL p50",
            "ITL p99",
            "ITL max",
            "D pinned avg",
            "D pinned peak",
            "D preemptions",
            "later turns' actions",
        ],
        [_row(c) for c in configs],
    )
    by_name = {c.name: c for c in configs}
    rows = []
    for w in (1, 2):
        t, p = by_name.get(f"turnkv-wave{w}"), by_name.get(f"plain-wave{w}")
        if t is not None and p is not None:
            r = ratios(t, p)
            rows.append([f"wave {w}", f"{r['itl_p99']:.2f}x", f"{r['itl_max']:.2f}x", f"{r['later_ttft_p50']:.2f}x"])
    vs = md_table(["turnkv / plain", "ITL p99", "ITL max", "TTFT_2+ p50"], rows) if rows else ""
    size = max((kv_tokens(c) for c in configs), default=0)
    note = (
        f"P and D share one simulated GPU; each holds {size:,} tokens of KV (half of the conversations' contexts "
        f"at their last turn, {CONTEXT_TOKENS:,} tokens each). D pinned: the KV its handles pin, over its KV size "
        "(time-average over the load, and peak).\n"
    )
    return f"## Agents on a shared GPU\n\n{note}\n{table}\n\n{vs}\n", {"shared gpu": [c.name for c in configs]}
