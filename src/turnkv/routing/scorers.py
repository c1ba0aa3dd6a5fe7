"""Routing scorers: how good each engine is for a pick, in [0, 1].

``load``: the least loaded scores 1, others (least + 1) / (theirs + 1), by the gateway's own requests in
flight (``signal: in_flight``, the default: it moves with every request) or by what is running there
(``busy``). ``affinity``: 1 for the engine that holds the conversation, unless it has more than
``slack`` requests in flight above the least loaded one, or (with ``queue_slack_ms``) requests wait on it
that much longer than on the least queued one (``reuse.load.decode_queue``): a conversation whose D is
overloaded moves to another D, its turn through P pulling the old D's blocks.
``pin-headroom``: the share of a decode engine's pin budget still free (1 when no budget is known, and for
prefill engines). ``ttft``: for prefill engines, the turn's estimated wait there, least / theirs (10 ms
added to both): P's queue (``reuse.load``: this gateway's prefills in flight at their estimated work, and
P's other requests) plus the prompt's tokens at P's time per token, less what the conversation's P likely
caches; decode engines all score 1.
``load`` and ``affinity`` take ``roles``: for an engine of another role they score 0 (no say).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from turnkv.reuse.load import decode_queue, prefill_queue
from turnkv.routing.base import InstanceView, NoParams, Params, RouteRequest

Role = Literal["prefill", "decode"]


def _both() -> list[Role]:
    return ["prefill", "decode"]


class LoadParams(Params):
    signal: Literal["in_flight", "busy", "queued"] = Field(
        "in_flight",
        description="in_flight: this gateway's requests there; busy: the engine's running count when more; "
        "queued: busy plus the requests waiting there (its /metrics)",
    )
    roles: list[Role] = Field(default_factory=_both, description="the picks it scores")


class Load:
    """``load``; params: ``signal``."""

    def __init__(self, params: LoadParams) -> None:
        self.signal = params.signal
        self.roles = frozenset(params.roles)

    def _load(self, c: InstanceView) -> int:
        if self.signal == "queued":
            return c.busy + c.waiting
        return c.busy if self.signal == "busy" else c.in_flight

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        if req.role not in self.roles:
            return [0.0] * len(candidates)
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
    roles: list[Role] = Field(default_factory=_both, description="the picks it scores")
    queue_slack_ms: float | None = Field(
        None,
        ge=0,
        description="how much longer requests may wait on the conversation's engine than on the least "
        "queued one for it to keep the conversation (none: its queue is not looked at)",
    )


class Affinity:
    """``affinity``; params: ``slack``, ``roles``, ``queue_slack_ms``."""

    STEP_MS = 8.0  # an engine's step where it measured none, for its queue (the cost model's fixed step)

    def __init__(self, params: AffinityParams) -> None:
        self.slack = params.slack
        self.roles = frozenset(params.roles)
        self.queue_slack_ms = params.queue_slack_ms

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        if req.prefer is None or req.role not in self.roles:
            return [0.0] * len(candidates)
        least = min((c.in_flight for c in candidates), default=0)
        queued = [self.queue_ms(c) for c in candidates]
        shortest = min(queued, default=0.0)
        return [
            1.0
            if c.url == req.prefer
            and c.in_flight <= least + self.slack
            and (self.queue_slack_ms is None or q <= shortest + self.queue_slack_ms)
            else 0.0
            for c, q in zip(candidates, queued, strict=True)
        ]

    def queue_ms(self, c: InstanceView) -> float:
        if self.queue_slack_ms is None:
            return 0.0
        ms, _ = decode_queue(c, self.STEP_MS)
        return ms or 0.0


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


class Ttft:
    """``ttft``; no params."""

    SOFTEN_S = 0.010  # two idle engines differ by their estimates' noise, not by a factor

    def __init__(self, params: NoParams) -> None:
        pass

    def wait_s(self, req: RouteRequest, c: InstanceView) -> float:
        """The turn's estimated wait on ``c``: its queue, then what the turn computes there."""
        queue_ms, _ = prefill_queue(c, req.now)
        cached = req.prefer_cached_tokens if c.url == req.prefer else 0
        return (queue_ms or 0.0) / 1e3 + max(0, req.prompt_tokens - cached) * req.prefill_s_per_token

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        if req.role != "prefill":
            return [1.0] * len(candidates)
        waits = [self.wait_s(req, c) for c in candidates]
        least = min(waits, default=0.0)
        return [(least + self.SOFTEN_S) / (w + self.SOFTEN_S) for w in waits]
