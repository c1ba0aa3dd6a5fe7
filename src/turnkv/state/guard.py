"""Keeps a failing store off the request path: after a failure, turns skip it for a while.

While the store is down every call raises ``StoreError`` at once, so a turn falls back to plain
P/D without waiting for a timeout; the first call after ``retry_s`` tries the store again, and a
success brings it back. What counts as down: a failure of the store itself (a connection refused
or reset, a command timeout, an error answer). ``StoreBusy``, a call that found every connection
busy past the pool wait, fails that call only and is counted apart (``on_busy``): under load the
store is slow to reach, not gone, and skipping it for ``retry_s`` would turn a burst into seconds
of stateless turns and in-flight markers left behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import Claim, ConversationStore, PinEntry, Pinned
from turnkv.state.record import ConversationRecord

T = TypeVar("T")
log = logging.getLogger("turnkv.store")


class StoreGuard:
    def __init__(
        self,
        store: ConversationStore,
        *,
        retry_s: float,
        on_error: Callable[[str], None] = lambda op: None,
        on_state: Callable[[bool], None] = lambda up: None,
        on_busy: Callable[[str], None] = lambda op: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._retry_s = retry_s
        self._on_error = on_error
        self._on_state = on_state
        self._on_busy = on_busy
        self._clock = clock
        self._down_until = 0.0
        self.up = True

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.up and self._clock() < self._down_until:
            raise StoreError("store is down; retrying later")
        try:
            result = await fn()
        except StoreBusy:
            self._on_busy(op)
            raise
        except StoreError as exc:
            self._on_error(op)
            self._down_until = self._clock() + self._retry_s
            if self.up:
                log.warning("store.down op=%s error=%s", op, exc)
                self.up = False
                self._on_state(False)
            raise
        if not self.up:
            log.warning("store.up op=%s", op)
            self.up = True
            self._on_state(True)
        return result

    async def claim(self, key: str, *, owner: str) -> Claim:
        return await self._call("claim", lambda: self.store.claim(key, owner=owner))

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        await self._call("put", lambda: self.store.put(key, record, ttl_s))

    async def release(self, key: str, *, owner: str) -> None:
        await self._call("release", lambda: self.store.release(key, owner=owner))

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        return await self._call("pinned", lambda: self.store.pinned(decode_urls))

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        return await self._call("evict", lambda: self.store.evict(decode_url, keep_tokens=keep_tokens, why=why))

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        return await self._call("prune", lambda: self.store.prune(decode_url, now=now, epoch=epoch))

    async def put_doc(self, key: str, value: str, ttl_s: float) -> None:
        await self._call("put_doc", lambda: self.store.put_doc(key, value, ttl_s))

    async def get_doc(self, key: str) -> str | None:
        return await self._call("get_doc", lambda: self.store.get_doc(key))

    async def ping(self) -> None:
        await self._call("ping", self.store.ping)

    async def close(self) -> None:
        await self.store.close()
