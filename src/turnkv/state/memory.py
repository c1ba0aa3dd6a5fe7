"""An in-process conversation store, for a single gateway replica without Redis."""

from __future__ import annotations

import time
from collections.abc import Callable

from turnkv.state.base import IN_FLIGHT_TTL_S, Claim, ClaimStatus, Pinned
from turnkv.state.record import ConversationRecord


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 100_000) -> None:
        self._clock = clock
        self._max = max_entries
        self._data: dict[str, tuple[float, ConversationRecord | None]] = {}  # key -> (deadline, record|marker)

    def _live(self, key: str) -> tuple[float, ConversationRecord | None] | None:
        item = self._data.get(key)
        if item is not None and item[0] <= self._clock():
            del self._data[key]
            return None
        return item

    async def claim(self, key: str) -> Claim:
        item = self._live(key)
        if item is None:
            return Claim(ClaimStatus.MISSING)
        if item[1] is None:
            return Claim(ClaimStatus.IN_FLIGHT)
        self._data[key] = (self._clock() + IN_FLIGHT_TTL_S, None)
        return Claim(ClaimStatus.FOUND, item[1])

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        if len(self._data) >= self._max and key not in self._data:
            self._evict()
        self._data[key] = (self._clock() + ttl_s, record)

    async def release(self, key: str) -> None:
        item = self._data.get(key)
        if item is not None and item[1] is None:
            del self._data[key]

    async def pinned(self, now: float) -> dict[str, Pinned]:
        out: dict[str, Pinned] = {}
        for key in list(self._data):
            item = self._live(key)
            if item is None or item[1] is None or item[1].expires_at <= now:
                continue
            r = item[1]
            p = out.get(r.decode_url, Pinned(0, 0))
            out[r.decode_url] = Pinned(p.handles + 1, p.tokens + r.num_tokens)
        return out

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, (deadline, _) in self._data.items() if deadline <= now]:
            del self._data[key]
        while len(self._data) >= self._max:
            del self._data[min(self._data, key=lambda k: self._data[k][0])]

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._data.clear()
