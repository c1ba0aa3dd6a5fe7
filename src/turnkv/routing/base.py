"""The routing contract: what a routing plugin sees of an engine, what it is asked, and what it answers.

One pick runs a profile over one snapshot of the engines of a role: its **filters** keep the
candidates that may serve the request, its **scorers** rate each survivor in [0, 1] (weighted and
summed), and its **picker** chooses among the best. Every plugin is pure and synchronous: the fleet
takes the snapshot (``gateway.fleet``), the router runs the plugins (``router``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One engine as the gateway sees it at one moment."""

    url: str
    role: str  # prefill | decode
    healthy: bool  # its health probe passes
    routable: bool  # healthy, and not suspended for missing first-token deadlines
    in_flight: int  # this gateway's requests running there
    running: int  # the engine's own count, as of its last metrics (this gateway's requests then included)
    waiting: int  # requests it admitted but has not scheduled, as of its last metrics
    kv_usage: float  # share of its KV cache in use, as of its last metrics
    epoch: float | None  # its process start time
    version: str | None
    stream_handles: bool | None  # its streams end with D's handle (seen, or by version)
    takes_prompt_ids: bool  # a decode request may carry the prompt as token ids
    cache_factor: float  # how much of the prefix-cache hits the gateway expects of it do happen
    capacity_tokens: int | None  # its KV cache size
    pinned_tokens: int  # decode KV the gateway's stored handles pin there (as far as it knows)
    pin_budget_tokens: int | None  # what they may pin (None: no budget known)
    progressed_at: float  # monotonic; when its token counters last moved (it computed something), 0: never seen
    # its load as its latency histograms said between its last two reads (``reuse.load``), and as this gateway
    # holds it: None where nothing was observed between the reads
    scraped: bool = False  # its metrics were read at least once
    latency_metrics: bool = False  # it reports an inter-token latency histogram at all
    step_ms: float | None = None  # mean gap between its streams' tokens: its step time
    queue_wait_ms: float | None = None  # mean time its requests waited to be scheduled
    prefill_request_ms: float | None = None  # mean prefill time of its requests (the last one measured)
    queued_prefill_s: float = 0.0  # this gateway's prefills in flight there: their estimated work
    queued_prefill_tokens: int = 0  # ... their new tokens
    queued_prefills: int = 0  # ... how many
    queued_since: float = 0.0  # monotonic; when the oldest of them was sent (0: none)
    # what this gateway had there while its metrics were last read (what those counts may include of its own):
    # its requests in flight, those of them not yet started (no first output: perhaps waiting there), the KV
    # their contexts hold, and what its stored handles pinned
    in_flight_scraped: int = 0
    unstarted_scraped: int = 0
    own_kv_scraped: int = 0
    pinned_scraped: int = 0
    # KV its handles the gateway gave up on still hold there (left for D's TTL, being released or written back),
    # now and while its metrics were last read: no record pins them, but D frees them only when told
    let_go_tokens: int = 0
    let_go_scraped: int = 0
    unstarted: int = 0  # this gateway's requests there with no first output yet, now
    own_kv_tokens: int = 0  # the KV their contexts hold there (prompt tokens), now
    local_prefills: int = 0  # this gateway's decode-local turns prefilling there (sent, no first token yet)
    local_prefill_tokens: int = 0  # ... the tokens they prefill, all together
    gpus: frozenset[str] = frozenset()  # the GPUs it computes on, as it says (NVML UUIDs; empty: not known)

    # Its load now: this gateway's own requests from its own bookkeeping at this moment, and other clients'
    # from the last reading of its metrics with this gateway's requests of that moment taken out. A request
    # of this gateway that has ended since (a conversation's previous turn, at agent speed) counts nowhere.

    @property
    def others(self) -> int:
        """Other clients' requests there (running and waiting), as its metrics last said (0: never read)."""
        return max(0, self.running + self.waiting - self.in_flight_scraped) if self.scraped else 0

    @property
    def others_waiting(self) -> int:
        """Other clients' requests waiting there, as its metrics last said: its waiting count less this
        gateway's requests that had not started then (they may have been the ones waiting)."""
        return min(self.others, max(0, self.waiting - self.unstarted_scraped))

    @property
    def busy(self) -> int:
        """Requests running there now: this gateway's in flight, and other clients' running."""
        return self.in_flight + self.others - self.others_waiting

    @property
    def waiting_now(self) -> int:
        """Requests waiting there now, as far as the gateway can tell: other clients' (this gateway's own
        not yet started count in ``busy``: it cannot tell one queued there from one prefilling)."""
        return self.others_waiting

    @property
    def others_kv_tokens(self) -> int | None:
        """KV other clients' requests hold there, as its metrics last said (None: its KV size is not known):
        its usage less this gateway's requests, pins and handles given up on of that moment."""
        if not self.scraped or self.capacity_tokens is None:
            return None
        ours = self.own_kv_scraped + self.pinned_scraped + self.let_go_scraped
        return max(0, round(self.kv_usage * self.capacity_tokens) - ours)

    @property
    def kv_usage_now(self) -> float:
        """Share of its KV cache in use now: other clients' as last read, and this gateway's requests, pins
        and handles given up on that it still holds, as they are now (a stream that ended left its blocks
        pinned until its handle is released or written back); its usage as last read where its KV size is not
        known."""
        others = self.others_kv_tokens
        if others is None or not self.capacity_tokens:
            return self.kv_usage
        ours = self.own_kv_tokens + self.pinned_tokens + self.let_go_tokens
        return min(1.0, (others + ours) / self.capacity_tokens)


@dataclass(frozen=True)
class RouteRequest:
    """What one pick is for."""

    role: str
    prefer: str | None = None  # the engine that holds the conversation's KV or its prefix
    exclude: frozenset[str] = frozenset()  # tried by this turn already: never again
    avoid: frozenset[str] = frozenset()  # missed a deadline in this turn: only when no other is left
    # what the turn would cost a prefill engine (the ``ttft`` scorer): its prompt (0: not known), what the
    # preferred engine likely caches of it, P's time per token computed, and the clock of ``queued_since``
    prompt_tokens: int = 0
    prefer_cached_tokens: int = 0
    prefill_s_per_token: float = 25e-6
    now: float = 0.0


class Params(BaseModel):
    """A plugin's parameters: validated when the profile is built (at start), unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    pass


class Filter(Protocol):
    """Keeps the candidates that may serve the request (it may return them all, or none)."""

    def filter(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]: ...


class Scorer(Protocol):
    """Rates each candidate in [0, 1], 1 best."""

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]: ...


class Picker(Protocol):
    """Chooses one candidate given their weighted scores (same order); None only when there are none."""

    def pick(
        self, req: RouteRequest, candidates: Sequence[InstanceView], scores: Sequence[float]
    ) -> InstanceView | None: ...
