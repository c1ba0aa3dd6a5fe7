"""An in-process conversation store, for a single gateway replica without Redis.

The same contract as the Redis store (``state.base``); all of it runs on one event loop, so each
method is atomic by construction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from turnkv.state.base import IN_FLIGHT_TTL_S, Claim, ClaimStatus, PinEntry, Pinned
from turnkv.state.record import ConversationRecord


@dataclasses.dataclass
class _Marker:
    owner: str


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = 100_000) -> None:
        self._clock = clock
        self._max = max_entries
        # key -> (deadline on the store's clock, record or a claiming turn's marker)
        self._data: dict[str, tuple[float, ConversationRecord | _Marker]] = {}
        self._pins: dict[str, dict[str, PinEntry]] = {}  # decode url -> conversation key -> entry
        self._docs: dict[str, tuple[float, str]] = {}

    def _live(self, key: str) -> tuple[float, ConversationRecord | _Marker] | None:
        item = self._data.get(key)
        if item is not None and item[0] <= self._clock():
            del self._data[key]
            return None
        return item

    def _unindex(self, key: str, record: ConversationRecord) -> None:
        pins = self._pins.get(record.decode_url)
        if pins is not None:
            pins.pop(key, None)

    async def claim(self, key: str, *, owner: str) -> Claim:
        item = self._live(key)
        if item is None:
            return Claim(ClaimStatus.MISSING)
        if isinstance(item[1], _Marker):
            return Claim(ClaimStatus.IN_FLIGHT)
        self._data[key] = (self._clock() + IN_FLIGHT_TTL_S, _Marker(owner))
        self._unindex(key, item[1])
        return Claim(ClaimStatus.FOUND, item[1])

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        if len(self._data) >= self._max and key not in self._data:
            self._evict_oldest()
        old = self._live(key)
        if old is not None and isinstance(old[1], ConversationRecord):
            self._unindex(key, old[1])
        self._data[key] = (self._clock() + ttl_s, record)
        if record.handle is not None:
            self._pins.setdefault(record.decode_url, {})[key] = PinEntry(
                key=key,
                decode_url=record.decode_url,
                tokens=record.num_tokens,
                handle=record.handle,
                pin_id=str(record.pin_id),
                stored_at=record.created_at,
                expires_at=record.expires_at,
                engine_epoch=record.engine_epoch,
            )

    async def release(self, key: str, *, owner: str) -> None:
        item = self._data.get(key)
        if item is not None and isinstance(item[1], _Marker) and item[1].owner == owner:
            del self._data[key]

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        out: dict[str, Pinned] = {}
        for url in decode_urls:
            pins = self._pins.get(url)
            if pins:
                out[url] = Pinned(len(pins), sum(e.tokens for e in pins.values()))
        return out

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        pins = self._pins.get(decode_url, {})
        total = sum(e.tokens for e in pins.values())
        out: list[PinEntry] = []
        for e in sorted(pins.values(), key=lambda e: e.stored_at):
            if total <= keep_tokens:
                break
            del pins[e.key]
            total -= e.tokens
            item = self._live(e.key)
            if item is None or not isinstance(item[1], ConversationRecord) or item[1].pin_id != e.pin_id:
                continue  # claimed or replaced meanwhile: not ours to release
            self._data[e.key] = (item[0], item[1].unpin(why))
            out.append(e)
        return out

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        pins = self._pins.get(decode_url, {})
        out: list[PinEntry] = []
        for e in list(pins.values()):
            item = self._live(e.key)
            gone = item is None or not isinstance(item[1], ConversationRecord) or item[1].pin_id != e.pin_id
            other_epoch = epoch is not None and e.engine_epoch is not None and e.engine_epoch != epoch
            if gone or other_epoch or e.expires_at <= now:
                del pins[e.key]
                out.append(e)
        return out

    async def put_doc(self, key: str, value: str, ttl_s: float) -> None:
        self._docs[key] = (self._clock() + ttl_s, value)
        if len(self._docs) > self._max:
            now = self._clock()
            for k in [k for k, (deadline, _) in self._docs.items() if deadline <= now]:
                del self._docs[k]
            while len(self._docs) > self._max:
                del self._docs[min(self._docs, key=lambda k: self._docs[k][0])]

    async def get_doc(self, key: str) -> str | None:
        item = self._docs.get(key)
        if item is None or item[0] <= self._clock():
            self._docs.pop(key, None)
            return None
        return item[1]

    def _evict_oldest(self) -> None:
        now = self._clock()
        for key in [k for k, (deadline, _) in self._data.items() if deadline <= now]:
            self._drop(key)
        while len(self._data) >= self._max:
            self._drop(min(self._data, key=lambda k: self._data[k][0]))

    def _drop(self, key: str) -> None:
        _, value = self._data.pop(key)
        if isinstance(value, ConversationRecord):
            self._unindex(key, value)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._data.clear()
        self._pins.clear()
        self._docs.clear()
