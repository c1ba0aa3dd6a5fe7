"""Percentiles and per-turn summaries of a configuration's requests (failed requests count as errors)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from turnkv.bench.records import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class TurnStats:
    turn: int
    n: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    itl_p50: float
    itl_p99: float
    latency_p50: float
    actions: dict[str, int] = field(default_factory=dict)

    def actions_text(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.actions.items())) or "-"


def summarize(records: Iterable[RequestRecord]) -> TurnStats:
    recs = list(records)
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [x for r in ok for x in r.itl_ms]
    lat = [r.latency_ms for r in ok if r.latency_ms is not None]
    # a decode-local turn that skipped the render is its own path ("decode_local direct"), and so is a turn
    # sent to P before its render returned ("pull ahead-checked", "recompute ahead-skipped")
    actions = Counter(
        r.decision["action"]
        + (" direct" if r.decision.get("direct") == "true" else "")
        + (f" ahead-{r.decision['ahead']}" if r.decision.get("ahead") else "")
        for r in recs
        if "action" in r.decision
    )
    return TurnStats(
        turn=recs[0].turn if recs and len({r.turn for r in recs}) == 1 else 0,
        n=len(recs),
        errors=len(recs) - len(ok),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        ttft_mean=sum(ttft) / len(ttft) if ttft else math.nan,
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        latency_p50=percentile(lat, 50),
        actions=dict(actions),
    )


def by_turn(records: Iterable[RequestRecord]) -> list[TurnStats]:
    turns: dict[int, list[RequestRecord]] = {}
    for r in records:
        turns.setdefault(r.turn, []).append(r)
    return [summarize(turns[t]) for t in sorted(turns)]


def turn_stats(records: Iterable[RequestRecord], turn: int) -> TurnStats:
    return summarize(r for r in records if r.turn == turn)


def fmt_ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_ratio(x: float) -> str:
    return "-" if math.isnan(x) or math.isinf(x) else f"{x:.2f}x"
