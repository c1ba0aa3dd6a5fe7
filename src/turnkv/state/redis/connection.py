"""One store's way to Redis: its turn at the connections (at most ``max_connections`` operations at once;
``StoreBusy`` past ``pool_timeout_s``), its keys (``{...}``: the Cluster hash tag), its Lua scripts (run by
SHA, loaded again after Redis lost them), and the one translation of every redis-py error into
``StoreError`` with its kind (``timeout``, ``connect_timeout``, ``unreachable``, ``error``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnkv.errors import StoreBusy, StoreError
from turnkv.state.redis.clients import REDIS_ERRORS, NoConnectTurn, hold_open

T = TypeVar("T")
log = logging.getLogger("turnkv.store")


@dataclasses.dataclass(frozen=True)
class Script:
    source: str
    sha: str = dataclasses.field(init=False)  # computed once, not on every call

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


Call = tuple[Script, Sequence[str], Sequence[str | int | float]]


@dataclasses.dataclass(frozen=True)
class Index:
    """One decode engine's pin index: its id and its keys (sorted set, entries, token total)."""

    id: str
    keys: tuple[str, str, str]


class RedisConnection:
    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        namespace: str,
        max_connections: int,
        pool_timeout_s: float,
        closers: Sequence[Any] = (),
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("the Redis namespace may not contain { or }: they would change the hash slots")
        self.client = client
        self.namespace = namespace
        self.max_connections = max_connections
        self.closers = list(closers)
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s

    # --- keys ---

    def conversation_key(self, key: str) -> str:
        return f"{self.namespace}:c:{{{key}}}"

    def doc_key(self, key: str) -> str:
        return f"{self.namespace}:d:{{{key}}}"

    def index(self, decode_url: str) -> Index:
        return self.index_by_id(hashlib.blake2b(decode_url.encode(), digest_size=8).hexdigest())

    def index_by_id(self, index_id: str) -> Index:
        base = f"{self.namespace}:pins:{{{index_id}}}"
        return Index(index_id, (f"{base}:z", f"{base}:e", f"{base}:t"))

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
            if isinstance(self.client, RedisCluster):
                # a no-op once the client knows the slots; without it, commands that start while
                # it is still learning them (first use, or after a reset on MOVED or a failover)
                # go to an arbitrary node and come back MOVED: redis-py (8.1) picks their route
                # before it waits for the slots
                await self.client.initialize()
            yield
        except (MaxConnectionsError, NoConnectTurn) as exc:  # a pool below max_connections; not an outage either
            raise StoreBusy(f"redis {op}: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}", kind=_kind(exc)) from exc
        finally:
            self._slots.release()

    async def twice_on_timeout(self, op: str, fn: Callable[[], Awaitable[T]], *, idempotent: bool = True) -> T:
        """``fn`` as one operation, run again once where that cannot do harm: when no connection could
        be opened for it (``connect_timeout``: nothing was sent), and for an ``idempotent`` one when its
        answer timed out (on another connection: redis-py drops one whose answer it gave up on)."""
        try:
            async with self.op(op):
                return await fn()
        except StoreError as exc:
            if not (exc.kind == "connect_timeout" or (idempotent and exc.kind == "timeout")):
                raise
            log.info("store.retry op=%s reason=%s", op, exc.kind)
        async with self.op(op):
            return await fn()

    async def eval(self, script: Script, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        client = cast(Any, self.client)
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted, failed over, or flushed its scripts
            await client.script_load(script.source)
            return await client.evalsha(script.sha, len(keys), *keys, *args)

    async def batch(self, calls: Sequence[Call]) -> list[Any]:
        """The scripts in one pipeline (not a transaction; in a Cluster spread over the nodes);
        those that met NOSCRIPT are loaded and run again, the others are not run twice. One script is
        sent as itself: the same round trip without building a pipeline (a put without a handle)."""
        if len(calls) == 1:
            return [await self.eval(*calls[0])]
        results = await self._pipeline(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            for source in dict.fromkeys(calls[i][0].source for i in missing):
                await cast(Any, self.client).script_load(source)
            for i, r in zip(missing, await self._pipeline([calls[i] for i in missing]), strict=True):
                results[i] = r
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

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


def _kind(exc: BaseException) -> str:
    """The kind of a redis-py failure (``errors.StoreError``)."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "connect_timeout" if "connecting" in str(exc) else "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"
