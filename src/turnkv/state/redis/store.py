"""``RedisStore``: the three parts of the store contract (``records``, ``pins``, ``documents``) on one
connection to the deployment a URL names (``state.redis_url``), and its nodes (``state.base.Nodes``): one
server or Sentinel's master is one node, a Cluster has one per master."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster

from turnkv.errors import StoreError
from turnkv.state.base import Gate, Nodes, OneNode
from turnkv.state.redis.clients import ConnectGate, TLSOptions, build_client
from turnkv.state.redis.connection import RedisConnection
from turnkv.state.redis.documents import RedisDocuments
from turnkv.state.redis.pins import RedisPins
from turnkv.state.redis.records import RedisRecords
from turnkv.state.redis_url import RedisTarget, Topology, parse_redis_url

log = logging.getLogger("turnkv.store")
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_POOL_TIMEOUT_S = 0.5
DEFAULT_CONNECT_CONCURRENCY = 16
DEFAULT_IN_FLIGHT_TTL_S = 60.0


class ClusterNodes:
    """A Cluster's nodes: the master that serves a key's slot, as far as the client knows the slots."""

    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn

    def of_conversation(self, key: str) -> str:
        return self._conn.node_of(self._conn.conversation_key(key))

    def of_document(self, key: str) -> str:
        return self._conn.node_of(self._conn.doc_key(key))

    def of_index(self, decode_url: str) -> str:
        return self._conn.node_of(self._conn.index(decode_url).keys[0])

    def serving(self) -> frozenset[str]:
        return self._conn.serving()

    async def refresh(self) -> None:
        await self._conn.refresh()


class SentinelNodes(OneNode):
    """Sentinel's master, one node at a time (every key on it, as ``OneNode``), named by its address
    (``host:port``) as Sentinel gave it when the store last asked (at start, and when a call found the node
    down; ``sentinel/<service>`` before the first answer). After a failover the new master is a new node with
    a breaker of its own: the calls that the old master's open breaker skips go to the new one as soon as
    Sentinel names it, without waiting for the old node's next probe."""

    def __init__(self, conn: RedisConnection, sentinel: Any, service: str, within_s: float) -> None:
        super().__init__(f"sentinel/{service}")
        self._conn = conn
        self._sentinel = sentinel
        self._service = service
        self._within_s = within_s

    def serving(self) -> frozenset[str]:  # the name changes at a failover
        return frozenset({self.name})

    async def refresh(self) -> None:
        with self._conn.errors("refresh"):
            async with asyncio.timeout(self._within_s):
                host, port = await self._sentinel.discover_master(self._service)
        name = f"{host}:{port}"
        if name != self.name:
            log.info("store.master service=%s node=%s was=%s", self._service, name, self.name)
            self.name = name


class RedisStore:
    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        namespace: str = "turnkv",
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
        in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
        closers: Sequence[Any] = (),
        node: str = "redis",
        refresh_within_s: float = 1.0,
        sentinel: tuple[Any, str] | None = None,
    ) -> None:
        """``client`` must decode responses to str; its pools should allow ``max_connections``.
        ``closers``: more objects with ``aclose()`` that the store owns (a Sentinel's clients). ``node``:
        the name of the one node of a client that is not a Cluster's (metrics, logs);
        ``refresh_within_s``: the longest a Cluster's slots (or Sentinel's master) take to learn again;
        ``sentinel``: the Sentinel client and service of a master Sentinel names."""
        self.conn = RedisConnection(
            client,
            namespace=namespace,
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
            closers=closers,
            node=node,
            refresh_within_s=refresh_within_s,
        )
        self.records = RedisRecords(self.conn, in_flight_ttl_s=in_flight_ttl_s)
        self.pins = RedisPins(self.conn)
        self.documents = RedisDocuments(self.conn)
        self.nodes: Nodes = OneNode(node)
        if self.conn.cluster:
            self.nodes = ClusterNodes(self.conn)
        elif sentinel is not None:
            self.nodes = SentinelNodes(self.conn, *sentinel, within_s=refresh_within_s)

    def steps_through(self, gate: Gate) -> None:
        self.conn.gate = gate

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "turnkv",
        command_timeout_s: float = 0.25,
        connect_timeout_s: float | None = None,
        connect_concurrency: int = DEFAULT_CONNECT_CONCURRENCY,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
        tls: TLSOptions | None = None,
    ) -> RedisStore:
        """A store on the deployment ``url`` names (see ``state.redis_url``). Nothing connects yet
        (``warm`` opens the pool). ``connect_timeout_s``: default ``command_timeout_s``."""
        target = parse_redis_url(url)
        connect_s = command_timeout_s if connect_timeout_s is None else connect_timeout_s
        client, closers = build_client(
            target,
            command_timeout_s=command_timeout_s,
            connect_timeout_s=connect_s,
            # a wait for a turn is bounded by the rounds of openings ahead of it, each within connect_s
            gate=ConnectGate(connect_concurrency, connect_s * -(-max_connections // connect_concurrency)),
            max_connections=max_connections,
            tls=tls or TLSOptions(),
        )
        log.info(
            "store.redis target=%s max_connections=%d pool_timeout_s=%s command_timeout_s=%s connect_timeout_s=%s",
            target.describe(),
            max_connections,
            pool_timeout_s,
            command_timeout_s,
            connect_s,
        )
        return cls(
            client,
            namespace=namespace,
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
            in_flight_ttl_s=in_flight_ttl_s,
            closers=closers,
            node=node_name(target),
            refresh_within_s=connect_s + command_timeout_s,
            sentinel=(closers[0], target.service) if target.topology is Topology.SENTINEL and target.service else None,
        )

    async def warm(self, connections: int, *, within_s: float) -> int:
        """Open the pool's connections before traffic comes (``RedisConnection.warm``); how many opened.
        Sentinel is asked for its master first (``SentinelNodes``; a failure is met by the first calls)."""
        if isinstance(self.nodes, SentinelNodes):
            try:
                await self.nodes.refresh()
            except StoreError as exc:
                log.warning("store.master_unknown kind=%s error=%s", exc.kind, exc)
        return await self.conn.warm(connections, within_s=within_s)

    async def ping(self, node: str | None = None) -> None:
        await (self.conn.ping() if node is None else self.conn.ping_node(node))

    async def close(self) -> None:
        await self.conn.close()


def node_name(target: RedisTarget) -> str:
    """How metrics and logs name the one node of a deployment that is not a Cluster: ``host:port`` (or the
    socket's path) of one server; ``sentinel/<service>`` for the master Sentinel names, until Sentinel says
    where it is (``SentinelNodes``)."""
    if target.topology is Topology.SENTINEL:
        return f"sentinel/{target.service}"
    if target.path is not None:
        return target.path
    host, port = target.nodes[0]
    return f"{host}:{port}"
