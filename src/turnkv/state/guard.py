"""Keeps a failing store off the request path: the circuit breaker (``state.breaker``) in front of it, one
breaker for the three parts of the store (``records``, ``pins``, ``documents``: one backing store).

While the breaker is open every call raises ``StoreError`` (kind ``open``) at once, so a turn falls
back to plain P/D without waiting for a timeout; then one call probes the store, and its success
brings it back. One failed call costs that call only: the breaker opens on an outage's evidence
(nothing listening, failures in a row over time, or a high failure ratio), not on one slow command.
``StoreBusy``, a call that found every connection busy past the pool wait, fails that call only
and is no outcome for the breaker (``on_busy``): under load the store is slow to reach, not gone.

Reported: every failure by operation and kind (``on_error``: ``timeout``, ``connect_timeout``,
``unreachable``, ``error``), calls skipped while open (``on_skip``), and the breaker's state
(``on_state``), with a log line on each change saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import Claim, ConversationStore, Documents, PinEntry, PinIndex, Pinned, Records
from turnkv.state.breaker import Admit, Breaker, BreakerPolicy, State, Transition
from turnkv.state.record import ConversationRecord

T = TypeVar("T")
log = logging.getLogger("turnkv.store")


class StoreGuard:
    def __init__(
        self,
        store: ConversationStore,
        *,
        policy: BreakerPolicy,
        on_error: Callable[[str, str], None] = lambda op, kind: None,
        on_state: Callable[[bool], None] = lambda up: None,
        on_busy: Callable[[str], None] = lambda op: None,
        on_skip: Callable[[str], None] = lambda op: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.breaker = Breaker(policy)
        self.records = GuardedRecords(self, store.records)
        self.pins = GuardedPins(self, store.pins)
        self.documents = GuardedDocuments(self, store.documents)
        self._on_error = on_error
        self._on_state = on_state
        self._on_busy = on_busy
        self._on_skip = on_skip
        self._clock = clock

    @property
    def up(self) -> bool:
        """False from the breaker's opening until a probe finds the store back."""
        return self.breaker.state is State.CLOSED

    def _changed(self, change: Transition | None, op: str, error: StoreError | None) -> None:
        if change is None:
            return
        up = change.state is State.CLOSED
        if up:
            log.warning("store.up op=%s why=%s", op, change.why)
        else:
            kind = error.kind if error is not None else None
            log.warning("store.down op=%s why=%s kind=%s error=%s", op, change.why, kind, error)
        self._on_state(up)

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn``, the store operation ``op``, through the breaker."""
        admitted = self.breaker.admit(self._clock())
        if admitted is Admit.SKIP:
            self._on_skip(op)
            raise StoreError("store is down; retrying later", kind="open")
        try:
            result = await fn()
        except StoreBusy:
            self._on_busy(op)
            self.breaker.abandoned(admitted)
            raise
        except StoreError as exc:
            self._on_error(op, exc.kind)
            if self.up:
                log.info("store.failure op=%s kind=%s error=%s", op, exc.kind, exc)
            self._changed(self.breaker.failed(self._clock(), exc.kind, admitted), op, exc)
            raise
        except BaseException:
            self.breaker.abandoned(admitted)
            raise
        self._changed(self.breaker.succeeded(self._clock(), admitted), op, None)
        return result

    async def ping(self) -> None:
        await self.call("ping", self.store.ping)

    async def close(self) -> None:
        await self.store.close()


class GuardedRecords:
    def __init__(self, guard: StoreGuard, records: Records) -> None:
        self._call = guard.call
        self._records = records

    async def claim(self, key: str, *, owner: str) -> Claim:
        return await self._call("claim", lambda: self._records.claim(key, owner=owner))

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        await self._call("put", lambda: self._records.put(key, record, ttl_s))

    async def release(self, key: str, *, owner: str) -> None:
        await self._call("release", lambda: self._records.release(key, owner=owner))


class GuardedPins:
    def __init__(self, guard: StoreGuard, pins: PinIndex) -> None:
        self._call = guard.call
        self._pins = pins

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        return await self._call("pinned", lambda: self._pins.pinned(decode_urls))

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        return await self._call("evict", lambda: self._pins.evict(decode_url, keep_tokens=keep_tokens, why=why))

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        return await self._call("prune", lambda: self._pins.prune(decode_url, now=now, epoch=epoch))


class GuardedDocuments:
    def __init__(self, guard: StoreGuard, documents: Documents) -> None:
        self._call = guard.call
        self._documents = documents

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        await self._call("put_doc", lambda: self._documents.put(key, value, ttl_s))

    async def get(self, key: str) -> str | None:
        return await self._call("get_doc", lambda: self._documents.get(key))
