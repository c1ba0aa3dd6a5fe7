"""The smoke suite: seconds long, for the test suite. Zero-cost engines; a colocated engine, and P/D
through turnkv with and without session ids. It checks that everything runs, not how fast."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment
from turnkv.bench.stats import fmt_ms, turn_stats
from turnkv.bench.workload import WorkloadSpec

ENGINE = ("--vllm-compat", "0.33", "--time-scale", "0")
WORKLOAD = WorkloadSpec(
    conversations=2,
    turns=3,
    system_tokens=200,
    user_tokens=20,
    answer_tokens=8,
    think_time_s=0.0,
    rate=0.0,
    concurrency=2,
    request_timeout_s=30.0,
    duration_s=60.0,
)


def benches(conversations: int | None = None) -> list[Bench]:
    wl = replace(WORKLOAD, conversations=conversations or WORKLOAD.conversations)
    return [
        Bench(
            Deployment("colocated", engine_flags=ENGINE),
            (
                ConfigPlan(
                    "smoke-colocated",
                    "smoke",
                    "colocated engine, direct",
                    replace(wl, session_header=False),
                    {"policy": "colocated"},
                ),
            ),
        ),
        # smoke-plain sends no session ids, and the gateway finds no conversation from the messages
        Bench(
            Deployment(
                "pd",
                engine_flags=ENGINE,
                gateway_flags=("--policy", "adaptive"),
                gateway_env=(("TURNKV_CONVERSATION_FROM_HISTORY", "false"),),
            ),
            (
                ConfigPlan(
                    "smoke-turnkv",
                    "smoke",
                    "1P1D through turnkv, X-Session-ID",
                    replace(wl, seed=1),
                    {"policy": "adaptive"},
                ),
                ConfigPlan(
                    "smoke-plain",
                    "smoke",
                    "1P1D through turnkv, no session ids",
                    replace(wl, seed=2, session_header=False),
                    {"policy": "plain"},
                ),
            ),
        ),
    ]


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    last = WORKLOAD.turns
    rows = [
        [
            c.name,
            fmt_ms(turn_stats(c.requests, 1).ttft_p50),
            fmt_ms(turn_stats(c.requests, last).ttft_p50),
            sum(1 for r in c.requests if not r.ok),
        ]
        for c in configs
    ]
    table = md_table(["config", "TTFT_1 p50", f"TTFT_{last} p50", "errors"], rows)
    return f"## Smoke summary\n\n{table}\n", {"smoke": [c.name for c in configs]}
