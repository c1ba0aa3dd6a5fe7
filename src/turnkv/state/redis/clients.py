"""The redis-py clients for each deployment a URL names (one server, Sentinel, Cluster; TLS), with explicit
timeouts, one retry at once on a connection error, and new connections opened a few at a time
(``ConnectGate``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from turnkv.state.redis_url import RedisTarget, Topology

log = logging.getLogger("turnkv.store")
REDIS_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)


@dataclasses.dataclass(frozen=True)
class TLSOptions:
    """Passed to every TLS connection (``rediss``); ``None`` fields keep Python's defaults."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"  # required | optional | none
    check_hostname: bool = True

    def kwargs(self) -> dict[str, Any]:
        return {
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_check_hostname": self.check_hostname,
        }


# --- scripts on a conversation's slot (KEYS[1] = ns:c:{key}) ---


class NoConnectTurn(RedisError):
    """No turn to open a connection came within the connect timeout: load (``StoreBusy``)."""


class ConnectGate:
    """At most ``limit`` connections being opened at once; a wait past ``wait_s`` is ``NoConnectTurn``.
    Not a ``ConnectionError``: redis-py would retry it."""

    def __init__(self, limit: int, wait_s: float) -> None:
        self._sem = asyncio.Semaphore(limit)
        self._limit = limit
        self._wait_s = wait_s

    @contextlib.asynccontextmanager
    async def opening(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._sem.acquire()
        except TimeoutError:
            raise NoConnectTurn(f"{self._limit} connections were being opened for {self._wait_s} s") from None
        try:
            yield
        finally:
            self._sem.release()


async def hold_open(pool: Any, n: int) -> int:
    """Take ``n`` connections from ``pool`` at once (each opened), then give them all back; how many
    opened. Each is given back whatever happens (a cancelled warm-up included)."""
    settled = 0
    opened = 0
    all_settled = asyncio.Event()

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == n:
            all_settled.set()

    async def hold() -> None:
        nonlocal opened
        try:
            conn = await pool.get_connection()
        except (*REDIS_ERRORS, NoConnectTurn):
            settle()
            raise
        try:
            opened += 1
            settle()
            await all_settled.wait()
        finally:
            await pool.release(conn)

    results = await asyncio.gather(*(hold() for _ in range(n)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        log.warning("store.warm_partial opened=%d failed=%d error=%s", opened, len(failed), failed[0])
    return opened


class _Gated(AbstractConnection):
    """A connection that opens only with a turn from its store's ``ConnectGate`` (a pool's
    connection kwargs carry the gate)."""

    def __init__(self, *args: Any, connect_gate: ConnectGate | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connect_gate = connect_gate

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self.is_connected or self._connect_gate is None:
            await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
            return
        async with self._connect_gate.opening():
            await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


class _GatedConnection(_Gated, Connection):
    pass


class _GatedSSLConnection(_Gated, SSLConnection):
    pass


class _GatedUnixConnection(_Gated, UnixDomainSocketConnection):
    pass


class _SentinelConnection(_Gated, SentinelManagedConnection):
    """Asks Sentinel where the master is on every connect. redis-py (8.1) does so only in
    ``connect()``, while a command on a dropped connection reconnects through
    ``connect_check_health()``, to the old address: after a failover the retry of the command that
    met READONLY went back to the demoted master and failed again."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


class _SentinelSSLConnection(_SentinelConnection, SSLConnection):
    pass


def build_client(
    target: RedisTarget,
    *,
    command_timeout_s: float,
    connect_timeout_s: float,
    gate: ConnectGate,
    max_connections: int,
    tls: TLSOptions,
) -> tuple[Redis | RedisCluster, list[Any]]:
    """The redis-py client for ``target``: pools of ``max_connections`` and explicit timeouts (a slow
    Redis must not hold a turn). Retry (one server, Sentinel): once at once, on a connection error only (redis-py keeps
    the retry of the connections its pool makes: the pool's connection kwargs carry it; a Redis
    client's own ``retry=`` is ignored when it is handed a pool). New connections open through
    ``gate`` (not in a Cluster, whose client makes its own per-node connections)."""
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = {
        "socket_timeout": command_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": True,
        "username": target.username,
        "password": target.password,
    }
    ssl = tls.kwargs() if target.tls else {}
    if target.topology is Topology.CLUSTER:
        nodes = [ClusterNode(h, p) for h, p in target.nodes]
        # no retry by the client: it would send any command again after a timeout or a connection
        # that broke mid-command (a claim run twice finds its own marker); the store retries where
        # that is harmless (RedisConnection.twice_on_timeout). Its per-node pools are its own.
        return RedisCluster(
            startup_nodes=nodes,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 0),
            ssl=target.tls,
            **common,
            **ssl,
        ), []
    conn_kwargs: dict[str, Any] = {
        **common,
        "retry": retry,
        "retry_on_error": [RedisConnectionError],
        "connect_gate": gate,
    }
    if target.topology is Topology.SENTINEL:
        assert target.service is not None
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": command_timeout_s,
            "socket_connect_timeout": command_timeout_s,
            "decode_responses": True,
            "retry": retry,
            **({"ssl": True, **ssl} if target.tls else {}),
        }
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        master = sentinel.master_for(
            target.service,
            max_connections=max_connections,
            db=target.db,
            connection_class=_SentinelSSLConnection if target.tls else _SentinelConnection,
            **conn_kwargs,
            **ssl,
        )
        return master, [sentinel]
    if target.path is not None:
        pool = ConnectionPool(
            connection_class=_GatedUnixConnection,
            path=target.path,
            db=target.db,
            max_connections=max_connections,
            **conn_kwargs,
        )
    else:
        host, port = target.nodes[0]
        pool = ConnectionPool(
            connection_class=_GatedSSLConnection if target.tls else _GatedConnection,
            host=host,
            port=port,
            db=target.db,
            max_connections=max_connections,
            **conn_kwargs,
            **ssl,
        )
    return Redis.from_pool(pool), []
