"""One store's way to Redis: its turn at the connections (at most ``max_connections`` operations at once;
``StoreBusy`` past ``pool_timeout_s``), its keys (``{...}``: the Cluster hash tag), the node that serves a
key (one server's or Sentinel's one name; a Cluster master's ``host:port``), its Lua scripts (run by SHA,
loaded again after Redis lost them), the steps an operation takes on another node than its own (through
that node's breaker: ``aside``, ``spread``), and the one translation of every redis-py error into
``StoreError`` with its kind (``timeout``, ``connect_timeout``, ``unreachable``, ``error``).

In a Cluster nothing is sent in a redis-py pipeline: its pipeline answers one node's connection error by
closing the connections to every node (and waiting 0.25 s), which would fail the calls in flight on the
masters that are up. Several scripts run as single commands at once instead (``CLUSTER_CONCURRENCY``);
a single command's connection error only makes the client learn the slots again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MaxConnectionsError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import SLOT, Gate
from turnkv.state.redis.clients import REDIS_ERRORS, NoConnectTurn, hold_open

T = TypeVar("T")
log = logging.getLogger("turnkv.store")
UNKNOWN_NODE = "cluster"  # a Cluster key's node before the client learned the slots
CLUSTER_CONCURRENCY = 32  # a Cluster batch's scripts in flight at once (single commands, not a pipeline)


@dataclasses.dataclass(frozen=True)
class Script:
    source: str
    sha: str = dataclasses.field(init=False)  # computed once, not on every call

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


Call = tuple[Script, Sequence[str], Sequence[str | int | float]]


async def _direct(node: str, op: str, fn: Callable[[], Awaitable[T]]) -> T:
    """The gate of a store nobody guards: every step runs."""
    return await fn()


@dataclasses.dataclass(frozen=True)
class Index:
    """One decode engine's pin index: its id and its keys (sorted set, entries, token total, tokens per
    tenant)."""

    id: str
    keys: tuple[str, str, str, str]


class RedisConnection:
    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        namespace: str,
        max_connections: int,
        pool_timeout_s: float,
        closers: Sequence[Any] = (),
        node: str = "redis",
        refresh_within_s: float = 1.0,
    ) -> None:
        """``node``: the name of the one node a store on one server (or Sentinel's master) has;
        ``refresh_within_s``: the longest a Cluster's slots take to learn again (``refresh``)."""
        if "{" in namespace or "}" in namespace:
            raise ValueError("the Redis namespace may not contain { or }: they would change the hash slots")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.node = node
        self.gate: Gate = _direct
        self._one_node = frozenset({node})
        self._refresh_within_s = refresh_within_s
        self.namespace = namespace
        self.max_connections = max_connections
        self.closers = list(closers)
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s

    # --- keys ---

    def conversation_key(self, key: str) -> str:
        """``ns:c:{key}``; a pool's slot ``base#i`` is ``ns:c:{base}#i``, in its base's hash slot."""
        base, sep, slot = key.partition(SLOT)
        return f"{self.namespace}:c:{{{base}}}{sep}{slot}"

    def doc_key(self, key: str) -> str:
        return f"{self.namespace}:d:{{{key}}}"

    def index(self, decode_url: str) -> Index:
        return self.index_by_id(hashlib.blake2b(decode_url.encode(), digest_size=8).hexdigest())

    def index_by_id(self, index_id: str) -> Index:
        base = f"{self.namespace}:pins:{{{index_id}}}"
        return Index(index_id, (f"{base}:z", f"{base}:e", f"{base}:t", f"{base}:n"))

    # --- operations ---

    @contextlib.asynccontextmanager
    async def op(self, op: str) -> AsyncIterator[None]:
        """One operation's turn at the connections, and the translation of every redis-py error."""
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreBusy(f"redis {op}: no connection free within {self._pool_timeout_s} s") from None
        try:
            with self.errors(op):
                if isinstance(self.client, RedisCluster):
                    # a no-op once the client knows the slots; without it, commands that start while
                    # it is still learning them (first use, or after a reset on MOVED or a failover)
                    # go to an arbitrary node and come back MOVED: redis-py (8.1) picks their route
                    # before it waits for the slots
                    await self.client.initialize()
                yield
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def errors(self, op: str) -> Iterator[None]:
        """Every redis-py error as ``StoreError`` with its kind (``StoreBusy`` for a full pool)."""
        try:
            yield
        except (MaxConnectionsError, NoConnectTurn) as exc:  # a pool below max_connections; not an outage either
            raise StoreBusy(f"redis {op}: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}", kind=_kind(exc)) from exc
        except Exception as exc:
            # redis-py (8.1) closes a Cluster node's free connections after a failure there while another
            # call may take one: that call's send finds no socket (AttributeError, or the event loop's
            # RuntimeError). One failed call, not a node that is gone (kind error). Ours would be a bug:
            # raised as it is.
            if not _through_redis_py(exc):
                raise
            raise StoreError(f"redis {op} failed: connection closed under the command: {exc!r}") from exc

    # --- nodes ---

    def node_of(self, redis_key: str) -> str:
        """The node that serves ``redis_key``, as far as the client knows now."""
        if not isinstance(self.client, RedisCluster):
            return self.node
        try:
            node = self.client.get_node_from_key(redis_key)
        except SlotNotCoveredError:
            return UNKNOWN_NODE
        return node.name if node is not None else UNKNOWN_NODE

    def serving(self) -> frozenset[str]:
        """The nodes that serve keys now: a Cluster's masters as the client knows them."""
        if not isinstance(self.client, RedisCluster):
            return self._one_node
        return frozenset(n.name for n in self.client.get_primaries()) or frozenset({UNKNOWN_NODE})

    async def refresh(self) -> None:
        """A Cluster client learns the slots again (from the first node that answers, within
        ``refresh_within_s``); nothing to learn elsewhere. Raises ``StoreError``."""
        if not isinstance(self.client, RedisCluster):
            return
        with self.errors("refresh"):
            async with asyncio.timeout(self._refresh_within_s):
                await self.client.nodes_manager.initialize()

    async def aside(self, here: str, op: str, call: Call, *, leaves: str) -> Any | None:
        """``call``, a step of an operation on node ``here``, where losing it costs the operation nothing
        (``leaves`` says what it leaves behind instead: an orphan entry, an unindexed pin). On another node
        it goes through that node's breaker. ``None`` when it failed or was skipped (logged)."""
        script, keys, args = call

        async def run() -> Any:
            with self.errors(op):
                return await self.eval(script, keys, args)

        node = self.node_of(keys[0])
        try:
            return await (run() if node == here else self.gate(node, op, run))
        except StoreError as exc:
            if exc.kind != "open":  # a step skipped while its node counts as down is counted, not logged
                log.info("store.step_failed op=%s node=%s leaves=%s kind=%s error=%s", op, node, leaves, exc.kind, exc)
            return None

    async def spread(self, here: str, op: str, calls: Sequence[Call]) -> list[Any]:
        """``calls`` (each on one slot), an operation's steps on its node ``here`` and on others: those on
        ``here`` as part of the operation (their failure fails it), each other node's together through
        its breaker, where a failure (or a node that counts as down) gives ``None`` for each of its calls
        (logged). On one server: ``batch``."""
        if not isinstance(self.client, RedisCluster):
            return await self.batch(calls)
        by_node: dict[str, list[int]] = {}
        for i, (_, keys, _) in enumerate(calls):
            by_node.setdefault(self.node_of(keys[0]), []).append(i)
        out: list[Any] = [None] * len(calls)

        async def on(node: str, idx: list[int]) -> None:
            async def run() -> list[Any]:
                with self.errors(op):
                    return await self.batch([calls[i] for i in idx])

            try:
                results = await (run() if node == here else self.gate(node, op, run))
            except StoreError as exc:
                if node == here:
                    raise
                if exc.kind != "open":
                    log.info(
                        "store.step_failed op=%s node=%s steps=%d kind=%s error=%s", op, node, len(idx), exc.kind, exc
                    )
                return
            for i, r in zip(idx, results, strict=True):
                out[i] = r

        for failed in await asyncio.gather(*(on(node, idx) for node, idx in by_node.items()), return_exceptions=True):
            if isinstance(failed, BaseException):  # the operation's own node: once every node's steps ended
                raise failed
        return out

    async def twice_on_timeout(self, op: str, fn: Callable[[], Awaitable[T]], *, idempotent: bool = True) -> T:
        """``fn`` as one operation, run again once where that cannot do harm: when no connection could
        be opened for it (``connect_timeout``: nothing was sent), and for an ``idempotent`` one when its
        answer timed out (on another connection: redis-py drops one whose answer it gave up on). In a
        Cluster (whose client retries nothing itself) also when the node refused the connection (nothing
        was sent: the client learns the slots again first, so a failed-over master's keys go to the new
        one), and for an ``idempotent`` one after any connection error."""
        try:
            async with self.op(op):
                return await fn()
        except StoreError as exc:
            if not self._harmless_again(exc, idempotent):
                raise
            log.info("store.retry op=%s reason=%s", op, exc.kind)
        async with self.op(op):
            return await fn()

    def _harmless_again(self, exc: StoreError, idempotent: bool) -> bool:
        if exc.kind == "connect_timeout":
            return True
        if exc.kind == "timeout":
            return idempotent
        if exc.kind == "unreachable" and isinstance(self.client, RedisCluster):
            refused = isinstance(exc.__cause__, RedisConnectionError) and "connecting" in str(exc.__cause__)
            return idempotent or refused
        return False

    async def eval(self, script: Script, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        client = cast(Any, self.client)
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted, failed over, or flushed its scripts
            # EVAL runs it and caches it on the node of its keys (SCRIPT LOAD on a Cluster client goes to
            # every master, a failed one included)
            return await client.eval(script.source, len(keys), *keys, *args)

    async def batch(self, calls: Sequence[Call]) -> list[Any]:
        """The scripts in one pipeline (not a transaction); those that met NOSCRIPT are loaded and run
        again, the others are not run twice. In a Cluster: as single commands at once (at most
        ``CLUSTER_CONCURRENCY``). One script is sent as itself: the same round trip without building a
        pipeline (a put without a handle). The first failure is raised, once all have ended."""
        if len(calls) == 1:
            return [await self.eval(*calls[0])]
        if isinstance(self.client, RedisCluster):
            results = await self._each(calls)
        else:
            results = await self._pipeline(calls)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                for source in dict.fromkeys(calls[i][0].source for i in missing):
                    await cast(Any, self.client).script_load(source)
                for i, r in zip(missing, await self._pipeline([calls[i] for i in missing]), strict=True):
                    results[i] = r
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _each(self, calls: Sequence[Call]) -> list[Any]:
        """Each script as a single command, at most ``CLUSTER_CONCURRENCY`` at once; failures as results."""
        turns = asyncio.Semaphore(CLUSTER_CONCURRENCY)

        async def one(call: Call) -> Any:
            async with turns:
                return await self.eval(*call)

        return list(await asyncio.gather(*(one(c) for c in calls), return_exceptions=True))

    async def _pipeline(self, calls: Sequence[Call]) -> list[Any]:
        async with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                # not pipe.evalsha: redis-py refuses it in Cluster pipelines, for scripts whose keys
                # may span slots; ours each touch one slot, which routes them like any keyed command
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    # --- the connections themselves ---

    async def ping(self) -> None:
        async def run() -> None:
            await self.client.ping()

        await self.twice_on_timeout("ping", run)

    async def ping_node(self, node: str) -> None:
        """One PING, not retried, to ``node``: a Cluster's node by its name, else the one server (or the
        master Sentinel names). Raises ``StoreError`` (kind ``error`` for a node the Cluster client does
        not know)."""
        async with self.op("ping"):
            if not isinstance(self.client, RedisCluster):
                await self.client.ping()
                return
            target = self.client.get_node(node_name=node)
            if target is None:
                raise StoreError(f"redis ping: the cluster client knows no node {node}")
            await self.client.ping(target_nodes=target)

    async def warm(self, connections: int, *, within_s: float) -> int:
        """Open up to ``connections`` of the pool's connections now (at most ``max_connections``; at
        most ``connect_concurrency`` at a time), and give them back to the pool, within ``within_s``;
        how many opened. A Cluster client learns its slots instead. Raises nothing: a Redis that is
        not there yet is met by the first calls (and the guard)."""
        n = min(connections, self.max_connections)
        if n <= 0:
            return 0
        client: Any = self.client
        try:
            async with asyncio.timeout(within_s):
                if isinstance(self.client, RedisCluster):
                    await self.client.initialize()
                    return 0
                return await hold_open(client.connection_pool, n)
        except (*REDIS_ERRORS, NoConnectTurn) as exc:
            log.warning("store.warm_failed error=%s detail=%s", type(exc).__name__, exc)
            return 0

    async def close(self) -> None:
        for c in [self.client, *self.closers]:
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                await c.aclose()


def _through_redis_py(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside redis-py (or below it: the event loop's transports)."""
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("redis."):
            return True
        tb = tb.tb_next
    return False


def _kind(exc: BaseException) -> str:
    """The kind of a redis-py failure (``errors.StoreError``)."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "connect_timeout" if "connecting" in str(exc) else "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"
