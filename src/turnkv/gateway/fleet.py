"""The engines turnkv routes to, as the gateway sees them: health, version, load, restarts, deadline misses,
what this gateway has in flight there and what its handles pin, read as immutable ``InstanceView``
snapshots (``views``, ``view``).

Background probes (``run``) refresh health and version and read the engines' own metrics through the
engine seam: the process start time (to notice restarts), running and waiting requests and KV usage,
the tokens it computed (when that total last moved: a first-token deadline waits for a busy engine),
KV transfer totals (for the link estimate), prefix-cache settings and hits (for what P still holds), and
the latency histograms' totals, of which two reads give D's step time, P's queue wait and prefill time
(``reuse.load``). A prefill request held here carries the work it was estimated at (P's queue).
Turns report what they see as it happens: a failed connection, a missed or met first-token deadline,
the requests they hold there. Which engine a request goes to is the router's decision
(``turnkv.routing``), made on a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from turnkv.engine.base import EngineProbes, Histo, LoadSample, Transfers
from turnkv.reuse.load import mean_between
from turnkv.routing.base import InstanceView

log = logging.getLogger("turnkv.fleet")
MIN_EXPECTED_HITS = 256  # tokens of expected cache hits before the observed ones are compared with them
MISSES_TO_SUSPEND = 3  # first-token deadlines missed in a row before an engine is taken out of routing
SUSPEND_S = 30.0  # how long; then one more miss takes it out again
PROBES_TO_LOSE = 2  # health probes failed in a row before the waits on an engine are given up (``lost_since``)


@dataclass
class _Engine:
    """One engine's live state; only the fleet writes it."""

    url: str
    role: str
    healthy: bool = True
    in_flight: int = 0
    epoch: float | None = None
    version: str | None = None
    takes_prompt_ids: bool = False
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    capacity_tokens: int | None = None
    deadline_misses: int = 0  # first-token deadlines missed in a row
    suspended_until: float = 0.0  # monotonic; out of routing until then (missed deadlines), whatever /health says
    stream_handles: bool | None = None
    gpus: frozenset[str] = frozenset()
    # how much of the prefix-cache hit the gateway expects actually happens (1: all; 0: cache off or evicting)
    cache_factor: float = 1.0
    expected_hits: float = 0.0
    prefix_caching: bool = True
    block_size_warned: bool = False
    pinned_tokens: int = 0
    pin_budget_tokens: int | None = None
    let_go: int = 0  # KV the gateway's handles still hold there that no record pins (``Fleet.let_go``)
    progressed_at: float = 0.0  # monotonic; when its token counters last moved
    failed_probes: int = 0  # health probes failed in a row
    unreachable_since: float = 0.0  # monotonic; when the first of them was sent (0: its last probe passed)
    scraped: bool = False
    # ours while its metrics were last read (``_Reading``): what its counts may include of this gateway's
    in_flight_scraped: int = 0
    unstarted_scraped: int = 0
    own_kv_scraped: int = 0
    pinned_scraped: int = 0
    let_go_scraped: int = 0
    unstarted: int = 0  # our requests there with no first output yet
    own_kv: int = 0  # the KV our requests' contexts hold there (tokens)
    holds: int = 0  # our requests sent there, ever: those sent while a reading was under way count in it
    kv_held: int = 0  # ... their KV, all together
    step_ms: float | None = None
    queue_wait_ms: float | None = None
    prefill_request_ms: float | None = None
    # this gateway's requests in flight there that carry estimated work: slot id -> (sent at, seconds, tokens)
    queued: dict[int, tuple[float, float, int]] = field(default_factory=dict, repr=False)
    departed_at: float = 0.0  # monotonic; when the last of them ended (P takes them in order: see Slot.served_s)
    # this gateway's decode-local turns there whose first token has not come: slot id -> tokens to prefill
    prefilling: dict[int, int] = field(default_factory=dict, repr=False)
    histos: dict[str, Histo] = field(default_factory=dict, repr=False)  # latency histograms, as last read
    work: float | None = field(default=None, repr=False)  # its tokens computed, as last read
    hits: float | None = field(default=None, repr=False)
    transfers: Transfers | None = field(default=None, repr=False)
    _view: InstanceView | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name != "_view":
            object.__setattr__(self, "_view", None)  # what the last snapshot said no longer holds

    def view(self, now: float) -> InstanceView:
        """A snapshot; the same one again while nothing changed (and no suspension ran out since)."""
        cached = self._view
        if cached is not None and (cached.routable or not cached.healthy or now < self.suspended_until):
            return cached
        q = self.queued.values()
        v = InstanceView(
            url=self.url,
            role=self.role,
            healthy=self.healthy,
            routable=self.healthy and now >= self.suspended_until,
            in_flight=self.in_flight,
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            epoch=self.epoch,
            version=self.version,
            stream_handles=self.stream_handles,
            takes_prompt_ids=self.takes_prompt_ids,
            cache_factor=self.cache_factor,
            capacity_tokens=self.capacity_tokens,
            pinned_tokens=self.pinned_tokens,
            pin_budget_tokens=self.pin_budget_tokens,
            progressed_at=self.progressed_at,
            scraped=self.scraped,
            latency_metrics="itl" in self.histos,
            step_ms=self.step_ms,
            queue_wait_ms=self.queue_wait_ms,
            prefill_request_ms=self.prefill_request_ms,
            queued_prefill_s=sum(w for _, w, _ in q),
            queued_prefill_tokens=sum(t for _, _, t in q),
            queued_prefills=len(q),
            queued_since=min((t0 for t0, _, _ in q), default=0.0),
            in_flight_scraped=self.in_flight_scraped,
            unstarted_scraped=self.unstarted_scraped,
            own_kv_scraped=self.own_kv_scraped,
            pinned_scraped=self.pinned_scraped,
            let_go_tokens=self.let_go,
            let_go_scraped=self.let_go_scraped,
            unstarted=self.unstarted,
            own_kv_tokens=self.own_kv,
            local_prefills=len(self.prefilling),
            local_prefill_tokens=sum(self.prefilling.values()),
            gpus=self.gpus,
        )
        object.__setattr__(self, "_view", v)
        return v


@dataclass(frozen=True)
class _Reading:
    """What this gateway had on an engine when a reading of its metrics started. The engine counts the
    requests of the moment it answers, somewhere in the reading: the gateway's own among them are at most
    those in flight at its start and those sent during it."""

    in_flight: int
    unstarted: int
    own_kv: int
    pinned: int
    let_go: int
    holds: int
    kv_held: int

    @classmethod
    def start(cls, e: _Engine) -> _Reading:
        return cls(e.in_flight, e.unstarted, e.own_kv, e.pinned_tokens, e.let_go, e.holds, e.kv_held)

    def settle(self, e: _Engine) -> None:
        """At the reading's end: what the engine's counts may include of this gateway's, kept with them."""
        sent = e.holds - self.holds
        e.in_flight_scraped = self.in_flight + sent
        e.unstarted_scraped = self.unstarted + sent
        e.own_kv_scraped = self.own_kv + (e.kv_held - self.kv_held)
        e.pinned_scraped = max(self.pinned, e.pinned_tokens)
        e.let_go_scraped = max(self.let_go, e.let_go)


class Slot:
    """One request's place in an engine's in-flight count (with the work it was estimated at, for P's
    queue, and the KV its context holds there), given back once."""

    _ids = itertools.count()

    def __init__(
        self,
        engine: _Engine,
        work_s: float = 0.0,
        tokens: int = 0,
        local_prefill: int = 0,
        clock: Callable[[], float] = time.monotonic,
        kv_tokens: int = 0,
    ) -> None:
        self._engine = engine
        self._held = True
        self._started = False
        self._id = next(Slot._ids)
        self._clock = clock
        self._kv = max(kv_tokens, 0)
        self.served_s: float | None = None  # once released, for a request that carried estimated work
        if work_s > 0 or tokens > 0:
            engine.queued[self._id] = (clock(), max(work_s, 0.0), max(tokens, 0))
        if local_prefill > 0:
            engine.prefilling = {**engine.prefilling, self._id: local_prefill}
        engine.holds += 1
        engine.kv_held += self._kv
        engine.own_kv += self._kv
        engine.unstarted += 1
        engine.in_flight += 1  # also tells the engine's snapshot that it changed

    def prefilled(self) -> None:
        """The request's first output came: it runs there (not queued), and a decode-local turn's prefill is
        done on D (its chunks no longer share D's steps)."""
        if not self._started:
            self._started = True
            self._engine.unstarted -= 1
        if self._id in self._engine.prefilling:
            self._engine.prefilling = {k: v for k, v in self._engine.prefilling.items() if k != self._id}

    def release(self) -> None:
        if self._held:
            self._held = False
            queued = self._engine.queued.pop(self._id, None)
            if queued is not None:
                self.served_s = self._served(queued[0])
            self.prefilled()
            self._engine.own_kv -= self._kv
            self._engine.in_flight -= 1

    def _served(self, sent_at: float) -> float:
        """How long the engine worked on this request, its wait behind this gateway's earlier ones left out:
        from when it was sent, or from when the one before it ended if that was later (a FCFS server starts
        the next in line when the last leaves), to now. Over a busy spell these add up to the spell, however
        long the queue: P's call time would count the queue in every request's cost (at a saturated P, the
        prefill estimate learnt from it was 74x its compute)."""
        e, now = self._engine, self._clock()
        served = now - max(sent_at, e.departed_at)
        e.departed_at = max(e.departed_at, now)
        return served


class Fleet:
    def __init__(
        self, prefill: list[str], decode: list[str], block_size: int = 16, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.block_size = block_size
        self._clock = clock  # monotonic seconds
        self._engines = {u: _Engine(u, "prefill") for u in prefill} | {u: _Engine(u, "decode") for u in decode}
        self._roles = {r: [e for e in self._engines.values() if e.role == r] for r in ("prefill", "decode")}
        self.on_restart: Callable[[InstanceView], None] = lambda view: None
        self._watchers: dict[str, set[Callable[[], None]]] = {}  # by url: told when it is found lost
        self.on_scraped: Callable[[InstanceView], None] = lambda view: None  # after each read of its metrics
        # (role of the engine that read, mean bytes, mean seconds, transfers)
        self.on_link_sample: Callable[[str, float, float, float], None] = lambda r, b, s, c: None

    # -- snapshots ---------------------------------------------------------------------------------
    def now(self) -> float:
        """The fleet's clock (monotonic seconds): the time its views and slots are read against."""
        return self._clock()

    def views(self, role: str) -> tuple[InstanceView, ...]:
        now = self._clock()
        return tuple(e.view(now) for e in self._roles.get(role, ()))

    def view(self, url: str | None) -> InstanceView | None:
        e = self._engines.get(url) if url else None
        return e.view(self._clock()) if e is not None else None

    def urls(self, role: str) -> list[str]:
        return [e.url for e in self._roles.get(role, ())]

    def size(self, role: str) -> int:
        return len(self._roles.get(role, ()))

    # -- what turns report -----------------------------------------------------------------------
    def hold(
        self, url: str, work_s: float = 0.0, tokens: int = 0, *, local_prefill: int = 0, kv_tokens: int = 0
    ) -> Slot:
        """Count a request in flight on ``url`` until the slot is released; a prefill says the work it was
        estimated at (seconds of P, new tokens): what a next turn would queue behind; a decode-local turn
        the tokens D prefills for it (``local_prefill``), counted until its first token
        (``Slot.prefilled``): what a next decode-local turn's chunks share D's steps with; a decode the KV
        its context holds on D (``kv_tokens``)."""
        return Slot(self._engines[url], work_s, tokens, local_prefill, self._clock, kv_tokens)

    @contextlib.contextmanager
    def busy(self, url: str, work_s: float = 0.0, tokens: int = 0) -> Iterator[Slot]:
        slot = self.hold(url, work_s, tokens)
        try:
            yield slot
        finally:
            slot.release()

    def watch(self, url: str, told: Callable[[], None]) -> Callable[[], None]:
        """Have ``told`` called each time ``url`` fails a health probe once lost (``lost_since``): a wait on it
        may give up. Returns the call that ends the watch."""
        watchers = self._watchers.setdefault(url, set())
        watchers.add(told)
        return lambda: watchers.discard(told)

    def lost_since(self, url: str) -> float | None:
        """When ``url`` stopped answering (the fleet's clock), once it failed ``PROBES_TO_LOSE`` health probes
        in a row; None while it answers."""
        e = self._engines.get(url)
        return e.unreachable_since if e is not None and e.failed_probes >= PROBES_TO_LOSE else None

    def mark_failed(self, url: str) -> None:
        e = self._engines.get(url)
        if e is not None and e.healthy:
            log.warning("instance.unhealthy url=%s", url)
            e.healthy = False

    def missed_deadline(self, url: str) -> None:
        """A first-token deadline passed on this engine; a few in a row take it out of routing until its
        health probe passes again."""
        e = self._engines.get(url)
        if e is None:
            return
        e.deadline_misses += 1
        if e.deadline_misses >= MISSES_TO_SUSPEND and e.healthy and self._clock() >= e.suspended_until:
            log.warning(
                "instance.suspended url=%s reason=first_token_deadline misses=%d for_s=%.0f",
                url,
                e.deadline_misses,
                SUSPEND_S,
            )
            e.suspended_until = self._clock() + SUSPEND_S
            e.deadline_misses = MISSES_TO_SUSPEND - 1

    def met_deadline(self, url: str | None) -> None:
        e = self._engines.get(url) if url else None
        if e is not None:
            e.deadline_misses = 0

    def expect_hits(self, url: str | None, tokens: int) -> None:
        """The gateway expects ``tokens`` of prefix-cache hits on ``url`` (compared with what it reports)."""
        e = self._engines.get(url) if url else None
        if e is not None:
            e.expected_hits += tokens

    def saw_stream_handle(self, url: str, seen: bool) -> None:
        """Whether a stream of this engine that should have ended with a handle did: what its streams carry."""
        e = self._engines.get(url)
        if e is not None:
            e.stream_handles = seen

    def pinned(self, url: str, tokens: int, budget: int | None) -> None:
        """What the gateway's stored handles pin on ``url`` (``gateway.pins``), and what they may."""
        e = self._engines.get(url)
        if e is not None:
            e.pinned_tokens, e.pin_budget_tokens = tokens, budget

    def let_go(self, url: str | None, tokens: int) -> None:
        """``tokens`` more (or, negative, fewer) of KV on ``url`` held by handles the gateway gave up on that D
        has not freed yet: left for its TTL, waiting to be released, or being written back. A finished
        stream's blocks stay pinned until then, so they count in its KV in use now (``kv_usage_now``)."""
        e = self._engines.get(url) if url else None
        if e is not None and tokens:
            e.let_go = max(0, e.let_go + tokens)

    # -- background refresh ------------------------------------------------------------------
    async def probe(self, engine: EngineProbes, url: str) -> None:
        e = self._engines[url]
        sent = self._clock()
        ok = await engine.health(url)
        if ok != e.healthy:
            log.warning("instance.healthy url=%s" if ok else "instance.unhealthy url=%s", url)
        e.healthy = ok
        if ok:
            e.failed_probes, e.unreachable_since = 0, 0.0
        else:
            e.unreachable_since = e.unreachable_since or sent
            e.failed_probes += 1
            if e.failed_probes >= PROBES_TO_LOSE:
                for told in list(self._watchers.get(url, ())):
                    told()
        if ok and e.version is None:
            info = await engine.info(url, e.role)
            if info is not None:
                e.version, e.takes_prompt_ids = info.version, info.takes_prompt_ids
                if info.gpus != e.gpus:
                    log.info("instance.gpus url=%s role=%s gpus=%s", url, e.role, ",".join(sorted(info.gpus)))
                    e.gpus = info.gpus
                if info.stream_handles:
                    e.stream_handles = True

    async def scrape(self, engine: EngineProbes, url: str) -> None:
        reading = _Reading.start(self._engines[url])
        sample = await engine.load(url)
        if sample is not None:
            self.apply_load(url, sample, reading)

    def apply_load(self, url: str, sample: LoadSample, reading: _Reading | None = None) -> None:
        """Take a reading of the engine's metrics in (``reading``: what the gateway had there when it
        started; none: as it has now)."""
        e = self._engines[url]
        reading = reading or _Reading.start(e)
        if sample.prefix_caching_off:
            e.cache_factor = 0.0  # nothing the gateway expects P to have cached is there
            e.prefix_caching = False
        if sample.capacity_tokens is not None:
            e.capacity_tokens = sample.capacity_tokens
        bs = sample.block_size
        if bs is not None and bs != self.block_size and not e.block_size_warned:
            e.block_size_warned = True
            log.warning("instance.block_size_mismatch url=%s engine=%s gateway=%s", url, bs, self.block_size)
        if sample.epoch is not None:
            restarted = e.epoch is not None and sample.epoch != e.epoch
            e.epoch = sample.epoch
            if restarted:
                log.warning("instance.restarted url=%s", url)
                e.version = None  # read /version again: it may run another release, plugin or GPU now
                self.on_restart(e.view(self._clock()))
        e.running, e.waiting, e.kv_usage = sample.running, sample.waiting, sample.kv_usage
        self._latencies(e, sample)
        e.scraped = True
        reading.settle(e)
        work = sample.tokens_computed
        if work is not None:
            if e.work is not None and work > e.work:
                e.progressed_at = self._clock()  # it computed something since the last reading: busy, not stuck
            e.work = work
        self._cache_factor(e, sample.prefix_cache_hits)
        self.on_scraped(e.view(self._clock()))
        cur = sample.transfers
        if cur is None:
            return
        prev, e.transfers = e.transfers, cur
        if prev is not None and cur.count > prev.count:
            dc = cur.count - prev.count
            self.on_link_sample(e.role, (cur.bytes - prev.bytes) / dc, (cur.seconds - prev.seconds) / dc, dc)

    @staticmethod
    def _latencies(e: _Engine, sample: LoadSample) -> None:
        """D's step time and P's queue wait between this read and the last (``reuse.load``); P's mean
        prefill time is kept from the last read that measured one."""
        prev = e.histos
        read = (("itl", sample.itl), ("queue", sample.queue_time), ("prefill", sample.prefill_time))
        cur = {k: h for k, h in read if h is not None}
        e.histos = cur
        step = mean_between(prev.get("itl"), cur.get("itl"))
        wait = mean_between(prev.get("queue"), cur.get("queue"))
        e.step_ms = None if step is None else step * 1e3
        e.queue_wait_ms = None if wait is None else wait * 1e3
        prefill = mean_between(prev.get("prefill"), cur.get("prefill"))
        if prefill is not None:
            e.prefill_request_ms = prefill * 1e3
        elif "prefill" not in cur:
            e.prefill_request_ms = None

    @staticmethod
    def _cache_factor(e: _Engine, hits: float | None) -> None:
        """Compare the prefix-cache hits the engine reports with those the gateway expected of it."""
        if hits is None:
            return
        prev, e.hits = e.hits, hits
        if prev is None or hits < prev:  # first reading, or the engine restarted
            e.expected_hits = 0.0
            return
        if e.expected_hits >= MIN_EXPECTED_HITS and e.prefix_caching:
            seen = min(1.0, (hits - prev) / e.expected_hits)
            e.cache_factor = 0.5 * e.cache_factor + 0.5 * seen
            e.expected_hits = 0.0

    async def run(self, engine: EngineProbes, health_s: float, scrape_s: float) -> None:
        """Probe health every ``health_s`` and read metrics every ``scrape_s``, until cancelled."""
        ticks = max(1, round(scrape_s / health_s))
        for n in itertools.count():
            urls = list(self._engines)
            await asyncio.gather(*(self.probe(engine, u) for u in urls))
            if n % ticks == 0:
                await asyncio.gather(*(self.scrape(engine, u) for u in urls))
            await asyncio.sleep(health_s)
