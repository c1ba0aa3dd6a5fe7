"""Keeps a failing store off the request path: a circuit breaker (``state.breaker``) per node of the
backing store (``state.base.Nodes``): one for a store on one server (memory, one Redis, Sentinel's
master), one per master of a Redis Cluster, so that a master's outage costs only the conversations
whose keys it serves.

A call goes through the breaker of the node that serves its key (a conversation's, a document's, an
engine's pin index); the store's steps on other nodes go through theirs (``step``). While a node's
breaker is open its calls raise ``StoreError`` (kind ``open``) at once, so a turn falls back to plain
P/D without waiting for a timeout; then one call probes the node, and its success brings it back. One
failed call costs that call only: a breaker opens on an outage's evidence (nothing listening, failures
in a row over time, or a high failure ratio), not on one slow command. ``StoreBusy``, a call that found
every connection busy past the pool wait, fails that call only and is no outcome for the breaker
(``on_busy``): under load the store is slow to reach, not gone.

A Cluster moves a failed master's slots to one of its replicas. A call that an open breaker skips asks
the store to learn its nodes again (``Nodes.refresh``; at most once per node every ``open_s``): once the
slots moved, that call and the ones after it go to the new master, through its own breaker, without
waiting for the old node's next probe; a node that serves no key any more has its breaker forgotten.

A node is also back without a call (``watch``, a task of the app's lifespan): while some breaker is open,
every ``open_s`` each open node gets one PING through the store's own connections (bounded by ``open_s``),
and its answer closes that node's breaker. The calls' probes wait longer after each failed one (up to
``max_open_s``) and come only with calls; the ping does not back off, so the store counts as up within
about ``open_s`` of its return, with or without traffic. A ping without an answer also learns the nodes
again (as a skipped call does), so a failed-over Cluster master or Sentinel's old master is forgotten
without traffic too. While every breaker is closed nothing is pinged (the task waits).

Reported: every failure by operation and kind (``on_error``: ``timeout``, ``connect_timeout``,
``unreachable``, ``error``), calls skipped while open (``on_skip``), each node's breaker (``on_node``:
whether it is open) and whether every node is up (``on_state``), with a log line on each change.
"""

from __future__ import annotations

import asyncio
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
        on_node: Callable[[str, bool], None] = lambda node, is_open: None,
        on_busy: Callable[[str], None] = lambda op: None,
        on_skip: Callable[[str], None] = lambda op: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.nodes = store.nodes
        self.policy = policy
        self._breakers: dict[str, Breaker] = {}
        self._open: set[str] = set()
        self._refresh_after: dict[str, float] = {}  # node -> when a skipped call may learn the nodes again
        self._opened = asyncio.Event()  # set while some breaker is open (``watch``)
        self.records = GuardedRecords(self, store.records)
        self.pins = GuardedPins(self, store.pins)
        self.documents = GuardedDocuments(self, store.documents)
        self._on_error = on_error
        self._on_state = on_state
        self._on_node = on_node
        self._on_busy = on_busy
        self._on_skip = on_skip
        self._clock = clock
        store.steps_through(self.step)

    @property
    def up(self) -> bool:
        """False while some node's breaker is open (from its opening until a probe finds it back)."""
        return not self._open

    def down(self) -> list[str]:
        """The nodes whose breakers are open."""
        return sorted(self._open)

    def breaker(self, node: str) -> Breaker:
        b = self._breakers.get(node)
        if b is None:
            b = self._breakers[node] = Breaker(self.policy)
        return b

    async def call(self, op: str, fn: Callable[[], Awaitable[T]], where: Callable[[], str]) -> T:
        """``fn``, the store operation ``op``, through the breaker of the node ``where()`` names."""
        if self._open:
            self._forget_gone()
        node = where()
        breaker = self.breaker(node)
        admitted = breaker.admit(self._clock())
        if admitted is Admit.SKIP and await self._relearned(node):
            node = where()
            breaker = self.breaker(node)
            admitted = breaker.admit(self._clock())
        return await self._through(node, breaker, admitted, op, fn)

    async def step(self, node: str, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """A step of a store operation on another node than the operation's (the store's ``Gate``)."""
        breaker = self.breaker(node)
        return await self._through(node, breaker, breaker.admit(self._clock()), op, fn)

    async def _through(
        self, node: str, breaker: Breaker, admitted: Admit, op: str, fn: Callable[[], Awaitable[T]]
    ) -> T:
        if admitted is Admit.SKIP:
            self._on_skip(op)
            raise StoreError(f"store node {node} is down; retrying later", kind="open")
        try:
            result = await fn()
        except StoreBusy:
            self._on_busy(op)
            breaker.abandoned(admitted)
            raise
        except StoreError as exc:
            if exc.kind == "open":  # a step on another node was skipped: nothing said about this one
                breaker.abandoned(admitted)
                raise
            self._on_error(op, exc.kind)
            if breaker.state is State.CLOSED:
                log.info("store.failure op=%s node=%s kind=%s error=%s", op, node, exc.kind, exc)
            self._changed(node, breaker, breaker.failed(self._clock(), exc.kind, admitted), op, exc)
            raise
        except BaseException:
            breaker.abandoned(admitted)
            raise
        self._changed(node, breaker, breaker.succeeded(self._clock(), admitted), op, None)
        return result

    def _changed(
        self, node: str, breaker: Breaker, change: Transition | None, op: str, error: StoreError | None
    ) -> None:
        if change is None or self._breakers.get(node) is not breaker:  # no change, or a node forgotten meanwhile
            return
        if change.state is State.CLOSED:
            self._open.discard(node)
            log.warning("store.up op=%s node=%s why=%s", op, node, change.why)
        else:
            self._open.add(node)
            self._opened.set()
            kind = error.kind if error is not None else None
            log.warning("store.down op=%s node=%s why=%s kind=%s error=%s", op, node, change.why, kind, error)
        self._on_node(node, node in self._open)
        self._on_state(self.up)

    async def _relearned(self, node: str) -> bool:
        """Whether the store learned its nodes again now, for a call that ``node``'s open breaker would
        skip: at most once per node every ``open_s``. A failed attempt is logged; the call is skipped."""
        now = self._clock()
        if now < self._refresh_after.get(node, 0.0):
            return False
        self._refresh_after[node] = now + self.policy.open_s
        try:
            await self.nodes.refresh()
        except StoreError as exc:
            log.info("store.refresh_failed node=%s kind=%s error=%s", node, exc.kind, exc)
            return False
        self._forget_gone()
        return True

    def _forget_gone(self) -> None:
        """Forget the breakers of nodes that serve no key any more (a failed-over master)."""
        serving = self.nodes.serving()
        gone = [n for n in self._breakers if n not in serving]
        for node in gone:
            del self._breakers[node]
            self._refresh_after.pop(node, None)
            if node in self._open:
                self._open.discard(node)
                log.warning("store.node_gone node=%s why=serves_no_keys", node)
                self._on_node(node, False)
                self._on_state(self.up)

    async def watch(self) -> None:
        """Until cancelled: while some node's breaker is open, ping each open node every ``open_s``; an
        answer closes its breaker (logged ``store.up ... why=ping_answered``)."""
        while True:
            if not self._open:
                self._opened.clear()
                await self._opened.wait()
            await asyncio.sleep(self.policy.open_s)  # the cadence: the breaker's shortest skip
            await asyncio.gather(*(self._ping(node) for node in self.down()))

    async def _ping(self, node: str) -> None:
        breaker = self._breakers.get(node)
        if breaker is None or breaker.state is State.CLOSED:
            return
        try:
            async with asyncio.timeout(self.policy.open_s):
                await self.store.ping(node)
        except (StoreError, TimeoutError) as exc:  # still down (or a busy pool: tried again next time)
            log.debug("store.ping_failed node=%s error=%s", node, exc)
            await self._relearned(node)
            return
        self._changed(node, breaker, breaker.answered(), "ping", None)

    async def ping(self) -> None:
        await self.call("ping", self.store.ping, lambda: min(self.nodes.serving()))

    async def close(self) -> None:
        await self.store.close()


class GuardedRecords:
    def __init__(self, guard: StoreGuard, records: Records) -> None:
        self._call = guard.call
        self._node = guard.nodes.of_conversation
        self._records = records

    async def claim(self, key: str, *, owner: str) -> Claim:
        return await self._call("claim", lambda: self._records.claim(key, owner=owner), lambda: self._node(key))

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        await self._call("put", lambda: self._records.put(key, record, ttl_s), lambda: self._node(key))

    async def release(self, key: str, *, owner: str) -> None:
        await self._call("release", lambda: self._records.release(key, owner=owner), lambda: self._node(key))

    async def claim_any(self, keys: Sequence[str], *, owner: str, prefer: str | None = None) -> tuple[str, Claim]:
        # a pool is one hash slot: its first key's node
        return await self._call(
            "claim", lambda: self._records.claim_any(keys, owner=owner, prefer=prefer), lambda: self._node(keys[0])
        )

    async def put_any(
        self, keys: Sequence[str], record: ConversationRecord, ttl_s: float, *, owner: str
    ) -> tuple[str, ConversationRecord | None]:
        return await self._call(
            "put", lambda: self._records.put_any(keys, record, ttl_s, owner=owner), lambda: self._node(keys[0])
        )


class GuardedPins:
    def __init__(self, guard: StoreGuard, pins: PinIndex) -> None:
        self._call = guard.call
        self._node = guard.nodes.of_index
        self._pins = pins

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        """Each node's engines through that node's breaker (the nodes at once); any failure fails the whole."""
        by_node: dict[str, list[str]] = {}
        for url in dict.fromkeys(decode_urls):
            by_node.setdefault(self._node(url), []).append(url)

        async def on(urls: list[str]) -> dict[str, Pinned]:
            return await self._call("pinned", lambda: self._pins.pinned(urls), lambda: self._node(urls[0]))

        if len(by_node) <= 1:
            return await on(next(iter(by_node.values()))) if by_node else {}
        out: dict[str, Pinned] = {}
        for part in await asyncio.gather(*(on(urls) for urls in by_node.values()), return_exceptions=True):
            if isinstance(part, BaseException):
                raise part
            out.update(part)
        return out

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        return await self._call(
            "evict",
            lambda: self._pins.evict(decode_url, keep_tokens=keep_tokens, why=why),
            lambda: self._node(decode_url),
        )

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        return await self._call(
            "prune", lambda: self._pins.prune(decode_url, now=now, epoch=epoch), lambda: self._node(decode_url)
        )


class GuardedDocuments:
    def __init__(self, guard: StoreGuard, documents: Documents) -> None:
        self._call = guard.call
        self._node = guard.nodes.of_document
        self._documents = documents

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        await self._call("put_doc", lambda: self._documents.put(key, value, ttl_s), lambda: self._node(key))

    async def get(self, key: str) -> str | None:
        return await self._call("get_doc", lambda: self._documents.get(key), lambda: self._node(key))

    async def delete(self, key: str) -> bool:
        return await self._call("delete_doc", lambda: self._documents.delete(key), lambda: self._node(key))
