"""The four-hop suite: the fifth-turn conversations over four hops (a render service, tokens-only P and D,
derender) against the same conversations over two hops, link by link.

Same workload and seed on both (16k-token history, P's prefix cache cold, policy always-pull and adaptive,
streamed turns): the analysis holds TTFT_5 side by side (target: four hops within 1.10x of two) and checks
that every turn took the same decision (action and reason) on both. Both sides pay for templating what they
render (``--text-us-per-token``, the render service's fitted cost); the four-hop gateway derenders with the
simulator's tokenizer in its process (``four_hop.tokenizer: sim``). Every answer's equality with a colocated
engine is checked by the tests (tests/integration/test_four_hop.py), not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from turnkv.bench.records import ConfigResult
from turnkv.bench.report import md_table
from turnkv.bench.scenarios.base import Bench
from turnkv.bench.scenarios.fifth_turn import LINKS, TURN, _pd
from turnkv.bench.stats import fmt_ms, fmt_ratio, turn_stats

HISTORY = 16000
POLICIES = ("always-pull", "adaptive")
TARGET = 1.10
# both sides pay for templating and tokenizing what they render (the render service's fitted cost, per token):
# on two hops P (and a 0.26 D) render the client's messages themselves, on four hops the render service does
TEXT = ("--text-us-per-token", "2.42")


def _bench(link: str, policy: str, four_hop: bool, conversations: int | None) -> Bench:
    b = _pd(HISTORY, link, "cold", policy, conversations)
    hops = "four-hop" if four_hop else "two-hop"
    how = "four hops (render service, tokens-only P and D)" if four_hop else "two hops"
    plans = tuple(
        replace(
            p,
            name=f"{p.name}-{hops}",
            group=f"16k {link} {policy}",
            description=f"{p.description}, {how}",
            tags={**p.tags, "hops": hops},
        )
        for p in b.plans
    )
    d = b.deployment
    env = (*d.gateway_env, ("TURNKV_FOUR_HOP__TOKENIZER", "sim")) if four_hop else d.gateway_env
    dep = replace(d, four_hop=four_hop, engine_flags=(*d.engine_flags, *TEXT), gateway_env=env)
    return replace(b, deployment=dep, plans=plans)


def benches(conversations: int | None = None) -> list[Bench]:
    return [
        _bench(link, policy, four_hop, conversations)
        for link in LINKS
        for policy in POLICIES
        for four_hop in (False, True)
    ]


def _decisions(c: ConfigResult) -> dict[tuple[int, int], tuple[str, str]]:
    return {(r.conversation, r.turn): (r.decision.get("action", ""), r.decision.get("reason", "")) for r in c.requests}


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    pairs: dict[tuple[str, str], dict[str, ConfigResult]] = {}
    for c in configs:
        t = c.meta.get("tags", {})
        if "hops" in t:
            pairs.setdefault((t["link"], t["policy"]), {})[t["hops"]] = c
    rows, checks = [], []
    for (link, policy), by in pairs.items():
        two, four = by.get("two-hop"), by.get("four-hop")
        if two is None or four is None:
            continue
        s2, s4 = turn_stats(two.requests, TURN), turn_stats(four.requests, TURN)
        ratio = s4.ttft_p50 / s2.ttft_p50 if s2.ttft_p50 else math.nan
        d2, d4 = _decisions(two), _decisions(four)
        same = sum(1 for k in d2 if d4.get(k) == d2[k])
        rows.append(
            [
                link,
                policy,
                fmt_ms(s2.ttft_p50),
                fmt_ms(s4.ttft_p50),
                fmt_ratio(ratio),
                f"{same}/{len(d2)}",
                f"{s2.errors}/{s4.errors}",
            ]
        )
        checks.append(f"- {link} {policy}: TTFT_5 {fmt_ratio(ratio)} {'<=' if ratio <= TARGET else '>'} {TARGET}x")
    head = ["link", "policy", "two hops TTFT_5 p50", "four hops TTFT_5 p50", "four / two", "same decisions", "errors"]
    text = "## Four hops against two\n\n" + md_table(head, rows) + "\n\n" + "\n".join(checks) + "\n"
    return text, {}
