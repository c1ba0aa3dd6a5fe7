"""The decode-memory suite: many conversations on a decode engine too small to pin them all.

Simulated H200 timing over the ``rdma400`` link (where pulls pay, so the policy keeps handles), a
decode engine whose KV holds about two thirds of what every conversation's handle pins by its last
turn, and two waves of conversations, the second started when the first ends. It compares: plain
P/D; turnkv restricted to pull-or-recompute with no budget and no pressure relief (every handle kept:
what turnkv did before); the same with the default budget and relief; and the default adaptive
policy (decode-local turns keep no handle). What it shows: turns that hang or fail, TTFT and ITL,
how many later turns pulled, and the most KV the decode engine held pinned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, summarize
from turnkv.bench.workload import WorkloadSpec

ENGINE = ("--vllm-compat", "0.33", "--link", "rdma400")
DECODE_BLOCKS = 4000  # 64k tokens of KV on D
WORKLOAD = WorkloadSpec(
    conversations=24,
    turns=5,
    system_tokens=2000,
    user_tokens=200,
    answer_tokens=64,
    think_time_s=0.5,
    rate=0.0,
    concurrency=24,
    request_timeout_s=60.0,
    duration_s=300.0,
)
FAST_JANITOR = (("TURNKV_DECODE_MEMORY__JANITOR_INTERVAL_S", "1"), ("TURNKV_SCRAPE_INTERVAL_S", "1"))
PULL_OR_RECOMPUTE = ("TURNKV_POLICY__PARAMS", '{"decode_local": false}')


def _deployment(kind: str, *env: tuple[str, str]) -> Deployment:
    return Deployment(
        kind,
        engine_flags=ENGINE,
        decode_flags=("--num-gpu-blocks", str(DECODE_BLOCKS)),
        gateway_flags=("--policy", "adaptive"),
        gateway_env=(*FAST_JANITOR, *env),
    )


def _waves(name: str, desc: str, policy: str, wl: WorkloadSpec) -> tuple[ConfigPlan, ConfigPlan]:
    """Two waves of conversations of their own, one after the other."""
    tags = {"policy": policy}
    return (
        ConfigPlan(f"{name}-wave1", "decode memory", f"{desc}, first wave", replace(wl, seed=1), tags),
        ConfigPlan(f"{name}-wave2", "decode memory", f"{desc}, second wave", replace(wl, seed=2), tags),
    )


def benches(conversations: int | None = None) -> list[Bench]:
    wl = replace(WORKLOAD, conversations=conversations or WORKLOAD.conversations)
    return [
        # plain P/D as deployed without bidirectional KV (a proxy that ignores D's handles would leave them
        # pinned for decoder_kv_blocks_ttl, and this decode engine full)
        Bench(
            replace(_deployment("pd-direct"), engine_flags=(*ENGINE, "--no-bidirectional")),
            _waves("plain", "plain P/D", "plain", wl),
        ),
        # turnkv as it was: every handle kept pinned, no budget, no pressure relief
        Bench(
            _deployment(
                "pd",
                PULL_OR_RECOMPUTE,
                ("TURNKV_DECODE_MEMORY__PIN_BUDGET_SHARE", "1.0"),
                ("TURNKV_DECODE_MEMORY__PRESSURE_KV_USAGE", "1.01"),
            ),
            _waves("no-budget", "turnkv pull-or-recompute, no budget", "adaptive", wl),
        ),
        Bench(
            _deployment("pd", PULL_OR_RECOMPUTE),
            _waves("budget", "turnkv pull-or-recompute, budget 0.5", "adaptive", wl),
        ),
        Bench(_deployment("pd"), _waves("adaptive", "turnkv adaptive (default)", "adaptive", wl)),
    ]


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    rows = []
    for c in configs:
        first = summarize(r for r in c.requests if r.turn == 1)
        later = summarize(r for r in c.requests if r.turn > 1)
        full = sum(1 for r in c.requests if r.turn > 1 and r.decision.get("outcome") in ("full", "partial"))
        engines = c.meta.get("engine_metrics", {}).get("decode", {})
        peak = engines.get("sim:pinned_tokens_peak")
        rows.append(
            [
                c.name,
                first.n + later.n,
                first.errors + later.errors,
                fmt_ms(first.ttft_p50),
                fmt_ms(later.ttft_p50),
                fmt_ms(later.ttft_p99),
                fmt_ms(later.itl_p50),
                fmt_ms(later.itl_p99),
                f"{full}/{later.n}",
                "-" if peak is None else f"{int(peak):,}",
            ]
        )
    table = md_table(
        [
            "config",
            "turns",
            "failed",
            "TTFT_1 p50",
            "TTFT_2-5 p50",
            "TTFT_2-5 p99",
            "ITL p50",
            "ITL p99",
            "pulled (later turns)",
            "D pinned tokens, peak",
        ],
        rows,
    )
    note = (
        f"D holds {DECODE_BLOCKS * 16:,} tokens of KV; the budget (share 0.5) is "
        f"{DECODE_BLOCKS * 16 // 2:,}. A failed turn is an error or no answer within "
        f"{WORKLOAD.request_timeout_s:.0f} s.\n"
    )
    return f"## Decode memory\n\n{note}\n{table}\n", {"decode memory": [c.name for c in configs]}
