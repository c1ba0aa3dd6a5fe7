"""Keeps the decode KV that stored handles pin within a budget per decode engine, and gives it back
under pressure.

A handle D returns pins its blocks for ``decoder_kv_blocks_ttl`` (480 s) whether or not a next turn
comes; at a few dozen conversations that fills D and new turns wait for blocks that nobody may ever
use. The budget is a share of D's KV capacity (``vllm:cache_config_info``: num_gpu_blocks x
block_size). Before a turn stores a handle that would cross it, the pins idle longest are released
first, among the tenants holding more than their share of the budget (``state.fair``: one tenant's many
conversations cannot push out another's): an agent's next turn follows within seconds of its last, so a
conversation idle for long is the least likely to come back before its handle expires (which also
happens in creation order); the saving a pull brings per byte grows only slowly with the history's
length, so which handle is oldest matters more than which is largest. Under pressure (D's KV usage
high, or requests waiting on D while pins hold memory) pins are released down to a low watermark at
once, when the engine's metrics are read, not at the next turn. Every entry evicted from the store's
index left its record without the handle, so no turn can pull a handle that is being released.

Handles nobody will pull (a stateless turn's, one the policy does not keep) are not released one by one
as they come: each release is a request to a prefill engine, which plain P/D does not pay (it leaves
them all to D's TTL). They are left pinned, as plain P/D leaves them, while they hold at most
``unused_share`` of D's capacity; past that the oldest are released, under pressure all of them first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from turnkv.config import Settings
from turnkv.engine.base import Handle
from turnkv.errors import StoreError
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.release import Releaser
from turnkv.routing.base import InstanceView
from turnkv.state.base import PinEntry, PinIndex

log = logging.getLogger("turnkv.pins")


@dataclass(frozen=True)
class _Unused:
    """A handle nobody will pull, left to D's TTL."""

    expires: float  # monotonic: when D frees it itself
    tokens: int
    handle: Handle
    why: str


class PinKeeper:
    def __init__(
        self, settings: Settings, fleet: Fleet, store: PinIndex, releaser: Releaser, metrics: GatewayMetrics, log: Any
    ) -> None:
        self._s = settings
        self._dm = settings.decode_memory
        self._fleet = fleet
        self._store = store
        self._releaser = releaser
        self._metrics = metrics
        self._log = log
        # pinned tokens per engine: as the store last said, plus what this process stored since
        self._estimate: dict[str, int] = {}
        self._handles: dict[str, int] = {}
        self._urgent: asyncio.Queue[str] = asyncio.Queue()
        self._unused: dict[str, deque[_Unused]] = {}  # per engine, oldest first
        self._unused_tokens: dict[str, int] = {}
        self.on_change: Callable[[str], None] = lambda url: None  # pins on ``url`` went down

    # -- budgets -----------------------------------------------------------------------------
    def capacity(self, url: str) -> int | None:
        inst = self._fleet.view(url)
        cap = inst.capacity_tokens if inst is not None else None
        return cap if cap is not None else self._dm.capacity_tokens

    def budget(self, url: str) -> int | None:
        cap = self.capacity(url)
        return None if cap is None else int(cap * self._dm.pin_budget_share)

    def _set(self, url: str, tokens: int) -> None:
        """What this process believes is pinned on ``url``; the fleet's views say it too (for routing),
        and fewer pins may let turns waiting for decode admission in (``on_change``)."""
        before = self._estimate.get(url, 0)
        self._estimate[url] = tokens
        self._fleet.pinned(url, tokens, self.budget(url))
        if tokens < before:
            self.on_change(url)

    def crowded(self, inst: InstanceView, tokens: int) -> bool:
        """Whether a new pin of ``tokens`` would hold blocks that requests waiting on D need: they wait,
        D's KV is nearly full (what they wait for is memory, not a batch slot), and stored pins would pass
        the low watermark with it."""
        cap = self.capacity(inst.url)
        pinned = self._estimate.get(inst.url, 0) + tokens
        if inst.waiting <= 0 or inst.kv_usage < self._dm.pressure_kv_usage or cap is None:
            return False
        return pinned > cap * self._dm.pressure_keep_share

    def under_pressure(self, inst: InstanceView) -> bool:
        """D's cache is nearly full, or requests wait on D while stored pins hold more than the low watermark."""
        if inst.kv_usage >= self._dm.pressure_kv_usage:
            return True
        cap = self.capacity(inst.url)
        pinned = self._estimate.get(inst.url, 0)  # stored pins: handles nobody will pull count in kv_usage only
        return inst.waiting > 0 and cap is not None and pinned > cap * self._dm.pressure_keep_share

    # -- on the turn's path ------------------------------------------------------------------
    async def make_room(self, url: str, tokens: int) -> None:
        """Before a new pin of ``tokens`` is stored on ``url``: when it would cross the budget (as far as
        this process knows), release the pins idle longest until it fits. When the engine's pin index
        cannot be asked (its store node is down: a Cluster master failing over) the pin goes in over the
        budget rather than cost its conversation the record, which may live on a node that is up; the
        next pin tries again, and what no evict reaches meanwhile D's own TTL frees."""
        budget = self.budget(url)
        est = self._estimate.get(url, 0) + tokens
        if budget is None or est <= budget:
            self._set(url, est)
            return
        try:
            entries = await self._store.evict(url, keep_tokens=max(budget - tokens, 0), why="budget")
        except StoreError as exc:
            self._metrics.pins_over_budget.inc()
            self._log.info("pins.over_budget", decode=url, tokens=est, budget=budget, kind=exc.kind)
            self._set(url, est)
            return
        self.release(entries, "budget")
        self._set(url, min(est, budget))

    def pinned(self, url: str) -> int:
        """Tokens pinned on ``url``, as far as this process knows."""
        return self._estimate.get(url, 0)

    def release(self, entries: Iterable[PinEntry], why: str) -> None:
        for e in entries:
            self._releaser.submit(e.handle, why, e.decode_url, e.tokens)
            self._set(e.decode_url, max(0, self._estimate.get(e.decode_url, 0) - e.tokens))

    # -- handles nobody will pull -------------------------------------------------------------
    def unused(self, url: str, handle: Handle, tokens: int, why: str) -> None:
        """A handle on ``url`` that no turn will pull: left pinned for D's own TTL to free while unused
        handles hold at most ``unused_share`` of its capacity (unknown capacity: none); past that the
        oldest are released."""
        cap = self.capacity(url)
        budget = int(cap * self._dm.unused_share) if cap is not None else 0
        if tokens > budget:
            self._releaser.submit(handle, why, url, tokens)
            return
        now = time.monotonic()
        q = self._unused.setdefault(url, deque())
        q.append(_Unused(now + self._s.decoder_kv_blocks_ttl, tokens, handle, why))
        self._unused_tokens[url] = self._unused_tokens.get(url, 0) + tokens
        self._fleet.let_go(url, tokens)  # still D's KV in use, until released or past its TTL
        self._metrics.unused_left.labels(why).inc()
        self._trim_unused(url, budget, now)

    def _trim_unused(self, url: str, keep_tokens: int, now: float) -> int:
        """Forget the unused handles on ``url`` that D freed itself (past its TTL), then release the oldest
        until they hold at most ``keep_tokens``; how many were released."""
        q = self._unused.get(url)
        if not q:
            return 0
        held = self._unused_tokens.get(url, 0)
        released = 0
        while q and (held > keep_tokens or q[0].expires <= now):
            e = q.popleft()
            held -= e.tokens
            self._fleet.let_go(url, -e.tokens)
            if e.expires > now:
                self._releaser.submit(e.handle, e.why, url, e.tokens)  # held until the release is sent
                released += 1
        self._unused_tokens[url] = held
        return released

    def unused_tokens(self, url: str) -> int:
        """Tokens that handles nobody will pull still pin on ``url``, as far as this process knows."""
        return self._unused_tokens.get(url, 0)

    def release_unused(self) -> int:
        """Release every unused handle still pinned (at shutdown); how many."""
        now = time.monotonic()
        return sum(self._trim_unused(url, 0, now) for url in list(self._unused))

    def urgent(self, url: str) -> None:
        """Relieve ``url`` now (its first-token deadline passed, or its metrics show pressure)."""
        self._urgent.put_nowait(url)

    def on_scraped(self, inst: InstanceView) -> None:
        if inst.role == "decode" and self.under_pressure(inst):
            self.urgent(inst.url)

    # -- background --------------------------------------------------------------------------
    async def relieve(self, url: str) -> int:
        """Release pins on ``url`` down to the low watermark; how many were released."""
        unused = self._trim_unused(url, 0, time.monotonic())  # nobody's: the first to go
        cap = self.capacity(url)
        keep = int(cap * self._dm.pressure_keep_share) if cap is not None else 0
        try:
            entries = await self._store.evict(url, keep_tokens=keep, why="pressure")
        except StoreError:
            return unused
        self.release(entries, "pressure")
        if entries or unused:
            self._log.warning(
                "pins.pressure",
                decode=url,
                released=len(entries),
                tokens=sum(e.tokens for e in entries),
                keep_tokens=keep,
                unused_released=unused,
            )
        return len(entries) + unused

    async def check(self) -> None:
        """One janitor pass: forget dead entries, refresh the totals, and hold every engine to its budget."""
        urls = self._fleet.urls("decode")
        now = time.time()
        for url in list(self._unused):
            self._trim_unused(url, self._unused_tokens.get(url, 0), time.monotonic())  # forget what D freed
        try:
            for inst in self._fleet.views("decode"):
                await self._store.prune(inst.url, now=now, epoch=inst.epoch)
            pinned = await self._store.pinned(urls)
        except StoreError:
            return
        for url in urls:
            p = pinned.get(url)
            self._set(url, p.tokens if p else 0)
            self._handles[url] = p.handles if p else 0
            budget = self.budget(url)
            if budget is not None and self._estimate[url] > budget:
                try:
                    entries = await self._store.evict(url, keep_tokens=budget, why="budget")
                except StoreError:
                    return
                self.release(entries, "budget")
            engine = self._fleet.view(url)
            if engine is not None and self.under_pressure(engine):
                await self.relieve(url)
        self.report()

    def report(self) -> None:
        m, bpt = self._metrics, self._s.kv_bytes_per_token
        for url in self._fleet.urls("decode"):
            tokens = self._estimate.get(url, 0)
            m.pinned_tokens.labels(url).set(tokens)
            m.pinned_bytes.labels(url).set(tokens * bpt)
            m.pinned_handles.labels(url).set(self._handles.get(url, 0))
            cap, budget = self.capacity(url), self.budget(url)
            m.pinned_capacity_bytes.labels(url).set(cap * bpt if cap is not None else 0)
            m.pinned_budget_bytes.labels(url).set(budget * bpt if budget is not None else 0)

    async def run(self) -> None:
        """Janitor passes every ``janitor_interval_s``; urgent relief as soon as it is asked for."""
        next_check = 0.0
        while True:
            wait = max(0.0, next_check - time.monotonic())
            try:
                try:
                    url = await asyncio.wait_for(self._urgent.get(), wait)
                except TimeoutError:
                    next_check = time.monotonic() + self._dm.janitor_interval_s
                    await self.check()
                    continue
                await self.relieve(url)
            except Exception:  # a bug in one pass must not end the janitor: log it, go on
                log.exception("pins.janitor_failed")

    async def release_all(self) -> int:
        """At shutdown, with a store nobody else reads: give every pin back (bounded by the caller)."""
        n = 0
        for url in self._fleet.urls("decode"):
            try:
                entries = await self._store.evict(url, keep_tokens=0, why="shutdown")
            except StoreError:
                continue
            self.release(entries, "shutdown")
            n += len(entries)
        return n
