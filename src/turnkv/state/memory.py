"""An in-process conversation store, for a single gateway replica without Redis.

The same contract as the Redis store (``state.base``): ``MemoryRecords`` and ``MemoryPins`` share one
table of conversations and their pin index (a put indexes its pin, a claim and an evict take it out),
``MemoryDocuments`` is a table of its own. All of it runs on one event loop, so each method is atomic by
construction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from turnkv.state.base import IN_FLIGHT_TTL_S, Claim, ClaimStatus, Gate, OneNode, PinEntry, Pinned
from turnkv.state.fair import fair_evictions
from turnkv.state.record import ConversationRecord

Clock = Callable[[], float]


@dataclasses.dataclass
class _Marker:
    owner: str


class _Conversations:
    """Records (or a claiming turn's marker) by key, each with its deadline on the store's clock, and the pin
    index of the records that hold a handle."""

    def __init__(self, clock: Clock, max_entries: int) -> None:
        self.clock = clock
        self.max = max_entries
        self.data: dict[str, tuple[float, ConversationRecord | _Marker]] = {}
        self.pins: dict[str, dict[str, PinEntry]] = {}  # decode url -> conversation key -> entry

    def live(self, key: str) -> tuple[float, ConversationRecord | _Marker] | None:
        item = self.data.get(key)
        if item is not None and item[0] <= self.clock():
            del self.data[key]
            return None
        return item

    def holding(self, key: str, pin_id: str) -> tuple[float, ConversationRecord] | None:
        """The live record of ``key`` when it still holds pin ``pin_id``."""
        item = self.live(key)
        if item is None or not isinstance(item[1], ConversationRecord) or item[1].pin_id != pin_id:
            return None
        return item[0], item[1]

    def index(self, key: str, record: ConversationRecord) -> None:
        if record.handle is not None and record.pin_id is not None:
            self.pins.setdefault(record.decode_url, {})[key] = PinEntry(
                key=key,
                decode_url=record.decode_url,
                tokens=record.num_tokens,
                handle=record.handle,
                pin_id=record.pin_id,
                stored_at=record.created_at,
                expires_at=record.expires_at,
                engine_epoch=record.engine_epoch,
                tenant=record.tenant,
            )

    def unindex(self, key: str, record: ConversationRecord) -> None:
        pins = self.pins.get(record.decode_url)
        if pins is not None:
            pins.pop(key, None)

    def make_room(self, key: str) -> None:
        if len(self.data) < self.max or key in self.data:
            return
        now = self.clock()
        for k in [k for k, (deadline, _) in self.data.items() if deadline <= now]:
            self._drop(k)
        while len(self.data) >= self.max:
            self._drop(min(self.data, key=lambda k: self.data[k][0]))

    def _drop(self, key: str) -> None:
        _, value = self.data.pop(key)
        if isinstance(value, ConversationRecord):
            self.unindex(key, value)

    def clear(self) -> None:
        self.data.clear()
        self.pins.clear()


class MemoryRecords:
    def __init__(self, table: _Conversations) -> None:
        self._t = table

    async def claim(self, key: str, *, owner: str) -> Claim:
        t = self._t
        item = t.live(key)
        if item is None:
            return Claim(ClaimStatus.MISSING)
        if isinstance(item[1], _Marker):
            return Claim(ClaimStatus.IN_FLIGHT)
        t.data[key] = (t.clock() + IN_FLIGHT_TTL_S, _Marker(owner))
        t.unindex(key, item[1])
        return Claim(ClaimStatus.FOUND, item[1])

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        t = self._t
        t.make_room(key)
        old = t.live(key)
        if old is not None and isinstance(old[1], ConversationRecord):
            t.unindex(key, old[1])
        t.data[key] = (t.clock() + ttl_s, record)
        t.index(key, record)

    async def release(self, key: str, *, owner: str) -> None:
        item = self._t.data.get(key)
        if item is not None and isinstance(item[1], _Marker) and item[1].owner == owner:
            del self._t.data[key]

    async def claim_any(self, keys: Sequence[str], *, owner: str, prefer: str | None = None) -> tuple[str, Claim]:
        held = [(k, item[1]) for k in keys if (item := self._t.live(k)) is not None]
        records = [(k, v) for k, v in held if isinstance(v, ConversationRecord)]
        if not records:
            return keys[0], Claim(ClaimStatus.IN_FLIGHT if held else ClaimStatus.MISSING)
        key = next((k for k, v in records if prefer is not None and v.answer_digest == prefer), records[0][0])
        return key, await self.claim(key, owner=owner)

    async def put_any(
        self, keys: Sequence[str], record: ConversationRecord, ttl_s: float, *, owner: str
    ) -> tuple[str, ConversationRecord | None]:
        held = {k: item[1] for k in keys if (item := self._t.live(k)) is not None}
        key = _free(keys, held, owner)
        replaced = held.get(key)
        await self.put(key, record, ttl_s)
        return key, replaced if isinstance(replaced, ConversationRecord) else None


def _free(keys: Sequence[str], held: dict[str, ConversationRecord | _Marker], owner: str) -> str:
    """Where ``put_any`` stores: the first key holding nothing or ``owner``'s marker, else the first holding
    an unclaimed record, else the first."""
    for k in keys:
        v = held.get(k)
        if v is None or (isinstance(v, _Marker) and v.owner == owner):
            return k
    return next((k for k in keys if isinstance(held[k], ConversationRecord)), keys[0])


class MemoryPins:
    def __init__(self, table: _Conversations) -> None:
        self._t = table

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        out: dict[str, Pinned] = {}
        for url in decode_urls:
            pins = self._t.pins.get(url)
            if pins:
                out[url] = Pinned(len(pins), sum(e.tokens for e in pins.values()))
        return out

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        pins = self._t.pins.get(decode_url, {})
        out: list[PinEntry] = []
        for e in fair_evictions(list(pins.values()), keep_tokens):
            del pins[e.key]
            held = self._t.holding(e.key, e.pin_id)
            if held is None:
                continue  # claimed or replaced meanwhile: not ours to release
            self._t.data[e.key] = (held[0], held[1].unpin(why))
            out.append(e)
        return out

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        pins = self._t.pins.get(decode_url, {})
        out: list[PinEntry] = []
        for e in list(pins.values()):
            gone = self._t.holding(e.key, e.pin_id) is None
            other_epoch = epoch is not None and e.engine_epoch is not None and e.engine_epoch != epoch
            if gone or other_epoch or e.expires_at <= now:
                del pins[e.key]
                out.append(e)
        return out


class MemoryDocuments:
    def __init__(self, clock: Clock, max_entries: int) -> None:
        self._clock = clock
        self._max = max_entries
        self._docs: dict[str, tuple[float, str]] = {}

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        self._docs[key] = (self._clock() + ttl_s, value)
        if len(self._docs) > self._max:
            now = self._clock()
            for k in [k for k, (deadline, _) in self._docs.items() if deadline <= now]:
                del self._docs[k]
            while len(self._docs) > self._max:
                del self._docs[min(self._docs, key=lambda k: self._docs[k][0])]

    async def get(self, key: str) -> str | None:
        item = self._docs.get(key)
        if item is None or item[0] <= self._clock():
            self._docs.pop(key, None)
            return None
        return item[1]

    async def delete(self, key: str) -> bool:
        item = self._docs.pop(key, None)
        return item is not None and item[0] > self._clock()

    def clear(self) -> None:
        self._docs.clear()


class MemoryStore:
    def __init__(self, clock: Clock = time.monotonic, max_entries: int = 100_000) -> None:
        self._table = _Conversations(clock, max_entries)
        self.records = MemoryRecords(self._table)
        self.pins = MemoryPins(self._table)
        self.documents = MemoryDocuments(clock, max_entries)
        self.nodes = OneNode("memory")

    def steps_through(self, gate: Gate) -> None:
        return None  # one node: no step falls on another

    async def ping(self, node: str | None = None) -> None:
        return None

    async def close(self) -> None:
        self._table.clear()
        self.documents.clear()
