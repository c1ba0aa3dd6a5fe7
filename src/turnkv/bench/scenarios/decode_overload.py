"""The decode-overload suite: more conversations at once than the decode engine's KV can hold.

The H200 load run that failed (BENCHMARKS.md section 6): 64 conversations of 8k-token histories, twice
what D's KV holds, D at 98-99% KV with nothing running for minutes. This suite gives the simulated
engines the same proportions at a quarter of the size (2k-token system prompts, D's KV holding about
half of what the conversations' contexts need at once, P's as large, CUDA IPC link, H200 timing) and
compares plain P/D, turnkv adaptive with decode admission off (the default, ``admit_share`` 0: every
turn sent to D at once, as in that run) and on (``admit_share`` 0.9). What it shows: turns answered,
failed and not answered within the client's deadline, TTFT and ITL, and D's preemptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, summarize
from turnkv.bench.workload import WorkloadSpec

BLOCK = 16
SYSTEM_TOKENS = 2048
CONTEXT_TOKENS = SYSTEM_TOKENS + 3 * (200 + 128)  # a conversation's context at its third turn
WORKLOAD = WorkloadSpec(
    conversations=64,
    turns=3,
    system_tokens=SYSTEM_TOKENS,
    user_tokens=200,
    answer_tokens=128,
    think_time_s=0.5,
    rate=0.0,
    concurrency=64,
    request_timeout_s=120.0,
    duration_s=600.0,
)
ENGINE = ("--vllm-compat", "0.33", "--link", "h200-ipc", "--kv-lease-duration", "180")
FAST_SCRAPE = (("TURNKV_SCRAPE_INTERVAL_S", "1"), ("TURNKV_DECODE_MEMORY__JANITOR_INTERVAL_S", "1"))


def engine_blocks(conversations: int) -> int:
    """KV blocks per engine: half of what the conversations' contexts need at once."""
    return conversations * CONTEXT_TOKENS // BLOCK // 2


def _deployment(kind: str, blocks: int, *env: tuple[str, str]) -> Deployment:
    return Deployment(
        kind,
        engine_flags=(*ENGINE, "--num-gpu-blocks", str(blocks)),
        gateway_flags=("--policy", "adaptive"),
        gateway_env=(*FAST_SCRAPE, *env),
    )


def benches(conversations: int | None = None) -> list[Bench]:
    wl = replace(WORKLOAD, conversations=conversations or WORKLOAD.conversations)
    wl = replace(wl, concurrency=wl.conversations)
    blocks = engine_blocks(wl.conversations)

    def plan(name: str, desc: str, policy: str) -> tuple[ConfigPlan]:
        return (ConfigPlan(name, "decode overload", desc, replace(wl, seed=1), {"policy": policy}),)

    return [
        Bench(
            # without bidirectional KV: a proxy that ignores D's handles would leave them pinned
            replace(
                _deployment("pd-direct", blocks),
                engine_flags=(*ENGINE, "--num-gpu-blocks", str(blocks), "--no-bidirectional"),
            ),
            plan("plain", "plain P/D", "plain"),
        ),
        Bench(_deployment("pd", blocks), plan("no-admission", "turnkv adaptive, decode admission off", "adaptive")),
        Bench(
            _deployment("pd", blocks, ("TURNKV_DECODE_MEMORY__ADMIT_SHARE", "0.9")),
            plan("admission", "turnkv adaptive, decode admission on", "adaptive"),
        ),
    ]


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    rows = []
    for c in configs:
        first = summarize(r for r in c.requests if r.turn == 1)
        later = summarize(r for r in c.requests if r.turn > 1)
        statuses: dict[str, int] = {}
        for r in c.requests:
            if r.error:
                key = str(r.status or "no answer")
                statuses[key] = statuses.get(key, 0) + 1
        d = c.meta.get("engine_metrics", {}).get("decode", {})
        rows.append(
            [
                c.name,
                len(c.requests),
                first.errors + later.errors,
                ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())) or "-",
                fmt_ms(first.ttft_p50),
                fmt_ms(first.ttft_p99),
                fmt_ms(later.ttft_p50),
                fmt_ms(later.ttft_p99),
                fmt_ms(later.itl_p99),
                f"{int(d.get('vllm:num_preemptions_total', 0))}",
            ]
        )
    table = md_table(
        [
            "config",
            "turns",
            "failed",
            "failures by status",
            "TTFT_1 p50",
            "TTFT_1 p99",
            "TTFT_2-3 p50",
            "TTFT_2-3 p99",
            "ITL p99",
            "D preemptions",
        ],
        rows,
    )
    note = (
        f"Each engine holds half of what the conversations' contexts need at once ({CONTEXT_TOKENS:,} tokens "
        f"each at their third turn); a failed turn is an error or no answer within "
        f"{WORKLOAD.request_timeout_s:.0f} s.\n"
    )
    return f"## Decode overload\n\n{note}\n{table}\n", {"decode overload": [c.name for c in configs]}
