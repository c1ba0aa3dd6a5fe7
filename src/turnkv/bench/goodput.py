"""Goodput under SLOs, as vLLM's ``bench serve --goodput`` counts it, and when a load sweep stops.

A turn meets the SLOs when it answered, its TTFT is within ``ttft_ms`` and its TPOT (the time from
its first token to its last over the tokens after the first, vLLM's definition) within ``tpot_ms``.
Goodput is the turns that met both per second of offered load: the conversations' arrival window
(conversations / rate). Every configuration at a rate is offered the same conversations, so their
goodputs compare the turns each served within the SLOs, and below saturation goodput is the offered
turn rate. vLLM divides by the run's wall time instead (first request to last answer), which in runs
of tens of seconds is mostly the tail of the last conversations; that figure is kept too
(``goodput_wall``). Attainment is the share of the turns sent that met both (a failed turn misses
both); turns never sent (their conversation failed earlier) count against goodput only. Per load point the summary
also keeps TTFT of first turns and of later turns apart (a later turn is where reuse shows), TPOT,
and ITL over every token gap of every stream.

Times in the records are the client's real milliseconds; a simulator run with ``--time-scale s``
sleeps s times the simulated durations, so dividing by ``time_scale`` states everything in simulated
time (and shrinks what the gateway's and the simulator's own CPU add, by the same factor).

The sweep raises the conversation arrival rate step by step and stops a given number of steps after
colocated serving's ITL p99 collapsed (went past ``COLLAPSE_TPOT_FACTOR`` times the TPOT SLO: a
stall that long in more than 1% of the token gaps), after its last rate, or when its time is spent.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from turnkv.bench.records import RequestRecord
from turnkv.bench.stats import percentile

COLLAPSE_TPOT_FACTOR = 2.0


@dataclass(frozen=True)
class Slo:
    """vLLM's ``--goodput ttft:2000 tpot:30``."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 30.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("SLOs must be positive")

    @property
    def collapse_itl_ms(self) -> float:
        return COLLAPSE_TPOT_FACTOR * self.tpot_ms


def tpot_ms(r: RequestRecord) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (tokens - 1); None for a failed turn."""
    if not r.ok or r.ttft_ms is None or r.latency_ms is None:
        return None
    n = r.completion_tokens if r.completion_tokens is not None else len(r.itl_ms) + 1
    return (r.latency_ms - r.ttft_ms) / (n - 1) if n > 1 else 0.0


def meets(r: RequestRecord, slo: Slo, time_scale: float = 1.0) -> bool:
    tpot = tpot_ms(r)
    return (
        tpot is not None
        and r.ttft_ms is not None
        and r.ttft_ms / time_scale <= slo.ttft_ms
        and tpot / time_scale <= slo.tpot_ms
    )


@dataclass(frozen=True)
class PointStats:
    """One configuration at one arrival rate (times in simulated ms, rates per simulated second)."""

    rate: float  # conversations arriving per second
    turns: int  # turns sent
    errors: int
    duration_s: float  # first request sent to last answer ended
    goodput: float  # turns that met both SLOs per second of arrivals (conversations / rate)
    goodput_wall: float  # the same per second of duration_s (vLLM's --goodput)
    throughput: float  # turns answered per second of duration_s
    attainment: float  # share of the turns sent that met both SLOs
    ttft_first_p50: float
    ttft_first_p99: float
    ttft_later_p50: float
    ttft_later_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float
    itl_max: float
    actions: dict[str, int] = field(default_factory=dict)  # turnkv's actions on later turns

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def point_stats(
    records: Iterable[RequestRecord], *, rate: float, conversations: int, slo: Slo, time_scale: float = 1.0
) -> PointStats:
    """``rate``: conversations per (simulated) second; ``conversations``: how many were offered."""
    recs = list(records)
    ok = [r for r in recs if r.ok]
    k = time_scale if time_scale > 0 else 1.0

    def pct(xs: Sequence[float], q: float) -> float:
        return percentile(xs, q) / k if xs else math.nan

    first = [r.ttft_ms for r in ok if r.turn == 1 and r.ttft_ms is not None]
    later = [r.ttft_ms for r in ok if r.turn > 1 and r.ttft_ms is not None]
    tpots = [t for t in (tpot_ms(r) for r in ok) if t is not None]
    itl = [x for r in ok for x in r.itl_ms]
    ends = [r.start_s + (r.latency_ms or 0.0) / 1e3 for r in recs]
    duration = (max(ends) - min(r.start_s for r in recs)) / k if recs else 0.0
    good = sum(1 for r in recs if meets(r, slo, k))
    actions = Counter(
        r.decision["action"] + (" direct" if r.decision.get("direct") == "true" else "")
        for r in recs
        if r.turn > 1 and "action" in r.decision
    )
    return PointStats(
        rate=rate,
        turns=len(recs),
        errors=len(recs) - len(ok),
        duration_s=duration,
        goodput=good * rate / conversations if conversations > 0 and rate > 0 else math.nan,
        goodput_wall=good / duration if duration > 0 else 0.0,
        throughput=len(ok) / duration if duration > 0 else 0.0,
        attainment=good / len(recs) if recs else math.nan,
        ttft_first_p50=pct(first, 50),
        ttft_first_p99=pct(first, 99),
        ttft_later_p50=pct(later, 50),
        ttft_later_p99=pct(later, 99),
        tpot_p50=pct(tpots, 50),
        tpot_p99=pct(tpots, 99),
        itl_p50=pct(itl, 50),
        itl_p99=pct(itl, 99),
        itl_max=max(itl) / k if itl else math.nan,
        actions=dict(actions),
    )


def collapsed(itl_p99_ms: float, slo: Slo) -> bool:
    """Whether colocated serving's ITL has collapsed at this load (NaN: nothing measured, so yes)."""
    return math.isnan(itl_p99_ms) or itl_p99_ms > slo.collapse_itl_ms


def next_rate(
    rates: Sequence[float],
    done: Sequence[float],
    collapsed_at: float | None,
    *,
    past: int,
    elapsed_s: float,
    budget_s: float,
) -> float | None:
    """The next rate of the sweep, or None to stop: after the last rate, ``past`` rates after the first
    one where colocated collapsed, or once ``elapsed_s`` has reached ``budget_s``."""
    if elapsed_s >= budget_s:
        return None
    left = [r for r in rates if r not in done]
    if not left:
        return None
    if collapsed_at is not None and sum(1 for r in done if r > collapsed_at) >= past:
        return None
    return left[0]


def geometric_rates(start: float, factor: float, count: int) -> list[float]:
    """``count`` rates from ``start``, each ``factor`` times the one before (rounded to 3 digits)."""
    if start <= 0 or factor <= 1 or count < 1:
        raise ValueError("rates need start > 0, factor > 1 and count >= 1")
    return [float(f"{start * factor**i:.3g}") for i in range(count)]
