"""Routing scorers: how good each engine is for a pick, in [0, 1].

``load``: the least loaded scores 1, others (least + 1) / (theirs + 1), by the gateway's own requests in
flight (``signal: in_flight``, the default: it moves with every request) or by what is running there
(``busy``). ``affinity``: 1 for the engine that holds the conversation, unless it has more than
``slack`` requests in flight above the least loaded one. ``pin-headroom``: the share of a decode
engine's pin budget still free (1 when no budget is known, and for prefill engines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from turnkv.routing.base import InstanceView, NoParams, Params, RouteRequest


class LoadParams(Params):
    signal: Literal["in_flight", "busy"] = "in_flight"


class Load:
    """``load``; params: ``signal``."""

    def __init__(self, params: LoadParams) -> None:
        self.signal = params.signal

    def _load(self, c: InstanceView) -> int:
        return c.busy if self.signal == "busy" else c.in_flight

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        loads = [self._load(c) for c in candidates]
        least = min(loads, default=0)
        return [(least + 1) / (x + 1) for x in loads]


class AffinityParams(Params):
    slack: int = Field(
        8,
        ge=0,
        description="requests in flight the conversation's engine may have above the "
        "least loaded one and still be chosen",
    )


class Affinity:
    """``affinity``; params: ``slack``."""

    def __init__(self, params: AffinityParams) -> None:
        self.slack = params.slack

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        if req.prefer is None:
            return [0.0] * len(candidates)
        least = min((c.in_flight for c in candidates), default=0)
        return [1.0 if c.url == req.prefer and c.in_flight <= least + self.slack else 0.0 for c in candidates]


class PinHeadroom:
    """``pin-headroom``; no params."""

    def __init__(self, params: NoParams) -> None:
        pass

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        out = []
        for c in candidates:
            budget = c.pin_budget_tokens
            out.append(1.0 if not budget else max(0.0, 1.0 - c.pinned_tokens / budget))
        return out
