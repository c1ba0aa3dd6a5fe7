"""The store contract against MemoryStore and RedisStore on fakeredis (with Lua); records; the guard;
``redis_url`` parsing and what each scheme builds. The same contract on real servers (one, Sentinel,
Cluster, TLS) is in tests/integration/test_store_redis.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Sequence

import fakeredis
import fakeredis.aioredis
import orjson
import pytest
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import SSLConnection

from tests.store_contract import SHORT_MARKER_TTL_S, Backend, RedisContract, StoreContract, rec
from turnkv.config import ConfigError, load_settings
from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import IN_FLIGHT_TTL_S, Claim, ClaimStatus, Gate, OneNode, Pinned
from turnkv.state.breaker import BreakerPolicy
from turnkv.state.guard import StoreGuard
from turnkv.state.memory import MemoryStore
from turnkv.state.record import FORMAT_VERSION, ConversationRecord
from turnkv.state.redis import RedisStore, TLSOptions
from turnkv.state.redis_url import RedisTarget, Topology, parse_redis_url


class TestMemoryStore(StoreContract):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        now = [1000.0]

        async def elapse(seconds: float) -> None:
            now[0] += seconds

        s = MemoryStore(clock=lambda: now[0])
        yield Backend(s, s, elapse, s, IN_FLIGHT_TTL_S)
        await s.close()


class TestRedisStoreOnFakeredis(StoreContract, RedisContract):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        server = fakeredis.FakeServer()
        a, b, short = (
            RedisStore(fakeredis.aioredis.FakeRedis(server=server, decode_responses=True), in_flight_ttl_s=ttl)
            for ttl in (60.0, 60.0, SHORT_MARKER_TTL_S)
        )
        yield Backend(a, b, asyncio.sleep, short, SHORT_MARKER_TTL_S)  # Redis TTLs run on the wall clock
        for s in (a, b, short):
            await s.close()


def test_record_round_trip() -> None:
    without_digest = dataclasses.replace(rec(), tokens_digest=None)
    for r in (rec(), rec(pin=None, unpinned="budget"), rec(epoch=12.5), without_digest):
        assert ConversationRecord.from_json(r.to_json()) == r


def test_records_written_without_a_digest_or_with_members_added_later_are_read() -> None:
    # a record of a gateway before tokens_digest (the chain decides its turns), and one of a later gateway
    # that added a member within this format version: read, that member left out
    assert rec().tokens_digest is not None
    raw = orjson.loads(dataclasses.replace(rec(), tokens_digest=None).to_json())
    assert "tokens_digest" not in raw
    assert ConversationRecord.from_json(orjson.dumps(raw)) == dataclasses.replace(rec(), tokens_digest=None)
    raw = orjson.loads(rec().to_json())
    raw["a_later_member"] = 1
    assert ConversationRecord.from_json(orjson.dumps(raw)) == rec()


def test_record_of_another_format_is_refused() -> None:
    raw = rec().to_json()
    assert f'"v":{FORMAT_VERSION}' in raw
    with pytest.raises(ValueError):
        ConversationRecord.from_json(raw.replace(f'"v":{FORMAT_VERSION}', f'"v":{FORMAT_VERSION - 1}'))


class _Failing:
    """A store whose claims fail with the given error (the only call these tests make), on one node."""

    def __init__(self, error: StoreError | None) -> None:
        self.error = error
        self.calls = 0
        self.records = self.pins = self.documents = self
        self.nodes = OneNode("redis")

    def steps_through(self, gate: Gate) -> None:
        return None

    async def claim(self, key: str, *, owner: str) -> Claim:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return Claim(ClaimStatus.MISSING)


class _Slots:
    """``Nodes`` of a fake Cluster: a key's node is ``owner[its first letter]``; ``refresh`` learns ``moves``."""

    def __init__(self, owner: dict[str, str]) -> None:
        self.owner = owner
        self.moves: dict[str, str] = {}
        self.refreshes = 0

    def of_conversation(self, key: str) -> str:
        return self.owner[key[0]]

    of_document = of_conversation

    def of_index(self, decode_url: str) -> str:
        return self.owner[decode_url[-1]]

    def serving(self) -> frozenset[str]:
        return frozenset(self.owner.values())

    async def refresh(self) -> None:
        self.refreshes += 1
        self.owner.update(self.moves)


class _Cluster:
    """Records and a pin index on the nodes ``_Slots`` names; the calls to a node in ``down`` fail as
    unreachable. A claim of a key starting with ``u`` also drops a pin entry on node ``b``, as a step
    through the guard's gate that costs the claim nothing when it fails."""

    def __init__(self, slots: _Slots) -> None:
        self.nodes = slots
        self.down: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # (op, node)
        self.records = self.pins = self.documents = self
        self.gate: Gate | None = None

    def steps_through(self, gate: Gate) -> None:
        self.gate = gate

    def _on(self, op: str, node: str) -> None:
        self.calls.append((op, node))
        if node in self.down:
            raise StoreError(f"{node} refused", kind="unreachable")

    async def claim(self, key: str, *, owner: str) -> Claim:
        self._on("claim", self.nodes.of_conversation(key))
        if key.startswith("u"):
            assert self.gate is not None

            async def unpin() -> None:
                self._on("unpin", "b")

            with contextlib.suppress(StoreError):
                await self.gate("b", "unpin", unpin)
        return Claim(ClaimStatus.MISSING)

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        for node in {self.nodes.of_index(u) for u in decode_urls}:
            self._on("pinned", node)
        return {u: Pinned(1, 10) for u in decode_urls}


POLICY = BreakerPolicy(open_s=5.0)


async def test_guard_skips_a_store_that_is_not_there_until_a_probe_finds_it_back() -> None:
    now = [0.0]
    store = _Failing(StoreError("refused", kind="unreachable"))
    states: list[bool] = []
    errors: list[tuple[str, str]] = []
    skipped: list[str] = []
    g = StoreGuard(
        store,  # type: ignore[arg-type]
        policy=POLICY,
        clock=lambda: now[0],
        on_state=states.append,
        on_error=lambda op, kind: errors.append((op, kind)),
        on_skip=skipped.append,
    )
    for _ in range(3):
        with pytest.raises(StoreError):
            await g.records.claim("k", owner="o")
    assert store.calls == 1 and states == [False] and not g.up
    assert errors == [("claim", "unreachable")] and skipped == ["claim", "claim"]
    now[0] = 6.0
    store.error = None
    assert (await g.records.claim("k", owner="o")).status is ClaimStatus.MISSING
    assert store.calls == 2 and states == [False, True] and g.up


async def test_one_timeout_fails_that_call_only() -> None:
    store = _Failing(StoreError("timed out", kind="timeout"))
    errors: list[tuple[str, str]] = []
    g = StoreGuard(store, policy=POLICY, on_error=lambda op, kind: errors.append((op, kind)))  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        await g.records.claim("k", owner="o")
    store.error = None
    assert (await g.records.claim("k", owner="o")).status is ClaimStatus.MISSING
    assert store.calls == 2 and g.up and errors == [("claim", "timeout")]


async def test_a_busy_pool_fails_the_call_but_does_not_open_the_guard() -> None:
    store = _Failing(StoreBusy("no connection free"))
    busy: list[str] = []
    errors: list[tuple[str, str]] = []
    g = StoreGuard(
        store,  # type: ignore[arg-type]
        policy=BreakerPolicy(failures=1, span_s=0),
        on_busy=busy.append,
        on_error=lambda op, kind: errors.append((op, kind)),
    )
    for _ in range(3):
        with pytest.raises(StoreBusy):
            await g.records.claim("k", owner="o")
    assert store.calls == 3 and g.up and busy == ["claim"] * 3 and errors == []
    store.error = None
    assert (await g.records.claim("k", owner="o")).status is ClaimStatus.MISSING


async def test_a_full_pool_raises_store_busy() -> None:
    s = RedisStore(fakeredis.aioredis.FakeRedis(decode_responses=True), max_connections=1, pool_timeout_s=0.01)
    async with s.conn.op("holding"):  # one operation in flight holds the only connection
        with pytest.raises(StoreBusy):
            await s.records.claim("k", owner="o")
    assert (await s.records.claim("k", owner="o")).status is ClaimStatus.MISSING
    await s.close()


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://127.0.0.1:6380/2", RedisTarget(Topology.SINGLE, False, (("127.0.0.1", 6380),), 2)),
        ("redis://localhost", RedisTarget(Topology.SINGLE, False, (("localhost", 6379),), 0)),
        ("rediss://u:p%40ss@h:1/0", RedisTarget(Topology.SINGLE, True, (("h", 1),), 0, "u", "p@ss")),
        ("redis://:secret@[::1]:7000", RedisTarget(Topology.SINGLE, False, (("::1", 7000),), 0, None, "secret")),
        ("unix:///run/redis.sock?db=3", RedisTarget(Topology.SINGLE, False, (), 3, path="/run/redis.sock")),
        (
            "redis+sentinel://a:26379,b:26380/mymaster/1",
            RedisTarget(Topology.SENTINEL, False, (("a", 26379), ("b", 26380)), 1, service="mymaster"),
        ),
        ("rediss+sentinel://s1/svc", RedisTarget(Topology.SENTINEL, True, (("s1", 26379),), 0, service="svc")),
        ("redis+cluster://n1:7000,n2:7001", RedisTarget(Topology.CLUSTER, False, (("n1", 7000), ("n2", 7001)), 0)),
        ("rediss+cluster://u:pw@n1:7000/", RedisTarget(Topology.CLUSTER, True, (("n1", 7000),), 0, "u", "pw")),
    ],
)
def test_redis_urls(url: str, target: RedisTarget) -> None:
    assert parse_redis_url(url) == target


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:6379", "scheme"),
        ("redis://h:6379/0?max_connections=5", "settings"),
        ("redis://a:1,b:2/0", "one host"),
        ("redis+sentinel://a:1", "service"),
        ("redis+cluster://a:1/3", "database 0"),
        ("redis://h:port/0", "bad port"),
        ("redis://h:1/x", "database number"),
        ("redis://user:hunter2@h:1/0?x=1", "***@"),  # and the password is not repeated
    ],
)
def test_bad_redis_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        parse_redis_url(url)
    assert "hunter2" not in str(err.value)


def test_settings_refuse_a_bad_redis_url_at_start() -> None:
    with pytest.raises(ConfigError, match="scheme"):
        load_settings(None, prefill=["http://p"], decode=["http://d"], redis_url="http://h")
    with pytest.raises(ConfigError, match="redis_namespace"):
        load_settings(None, prefill=["http://p"], decode=["http://d"], redis_namespace="a{b}")
    s = load_settings(None, prefill=["http://p"], decode=["http://d"], redis_url="redis+cluster://h:7000")
    assert (s.redis_max_connections, s.redis_pool_timeout_s, s.redis_in_flight_ttl_s) == (256, 0.5, 60.0)


TLS = TLSOptions(ca_certs="/ca.pem", certfile="/c.pem", keyfile="/k.pem", cert_reqs="optional", check_hostname=False)
TLS_KWARGS = {
    "ssl_ca_certs": "/ca.pem",
    "ssl_certfile": "/c.pem",
    "ssl_keyfile": "/k.pem",
    "ssl_cert_reqs": "optional",
    "ssl_check_hostname": False,
}


async def test_each_scheme_builds_its_client_with_the_pool_timeouts_and_tls() -> None:
    """What reaches redis-py (the plumbing; the real servers are in tests/integration)."""
    single = RedisStore.from_url("rediss://h:1/2", command_timeout_s=0.3, max_connections=7, tls=TLS)
    assert isinstance(single.conn.client, Redis)
    pool = single.conn.client.connection_pool
    kw = pool.connection_kwargs
    assert issubclass(pool.connection_class, SSLConnection) and pool.max_connections == 7
    assert {k: kw[k] for k in TLS_KWARGS} == TLS_KWARGS and (kw["socket_timeout"], kw["db"]) == (0.3, 2)
    conn = pool.make_connection()  # type: ignore[no-untyped-call]  # the retry the pool's connections get (a client's own is ignored)
    assert conn.retry.get_retries() == 1
    await single.close()

    assert conn._connect_gate is not None  # new connections open a few at a time
    plain = RedisStore.from_url("redis://h:1/0", tls=TLS)
    assert not issubclass(plain.conn.client.connection_pool.connection_class, SSLConnection)  # type: ignore[union-attr]
    await plain.close()

    cluster = RedisStore.from_url("rediss+cluster://h:7000,g:7001", command_timeout_s=0.3, max_connections=9, tls=TLS)
    assert isinstance(cluster.conn.client, RedisCluster)
    node_kw = cluster.conn.client.nodes_manager.connection_kwargs
    assert node_kw["connection_class"] is SSLConnection and node_kw["max_connections"] == 9
    assert {k: node_kw[k] for k in TLS_KWARGS} == TLS_KWARGS and node_kw["socket_timeout"] == 0.3
    await cluster.close()

    sentinel = RedisStore.from_url("rediss+sentinel://s:26379/svc/1", max_connections=5, tls=TLS)
    assert isinstance(sentinel.conn.client, Redis)
    spool = sentinel.conn.client.connection_pool
    assert issubclass(spool.connection_class, SSLConnection) and spool.max_connections == 5
    assert {k: spool.connection_kwargs[k] for k in TLS_KWARGS} == TLS_KWARGS
    sentinel_node = sentinel.conn.closers[0].sentinels[0].connection_pool
    assert sentinel_node.connection_class is SSLConnection
    await sentinel.close()


@pytest.mark.parametrize(
    ("message", "idempotent", "tries"),
    [
        ("Timeout connecting to server", False, 2),  # nothing was sent: any operation may go again
        ("Timeout reading from 127.0.0.1:6379", True, 2),  # a read: harmless twice
        ("Timeout reading from 127.0.0.1:6379", False, 1),  # a claim or a put: it may have run
    ],
)
async def test_what_a_timeout_retries(message: str, idempotent: bool, tries: int) -> None:
    from redis.exceptions import TimeoutError as RedisTimeoutError

    s = RedisStore(fakeredis.aioredis.FakeRedis(decode_responses=True))
    calls = 0

    async def once() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RedisTimeoutError(message)
        return "ok"

    if tries == 2:
        assert await s.conn.twice_on_timeout("op", once, idempotent=idempotent) == "ok"
    else:
        with pytest.raises(StoreError) as failed:
            await s.conn.twice_on_timeout("op", once, idempotent=idempotent)
        assert failed.value.kind == "timeout"
    assert calls == tries
    await s.close()


def _guarded(cluster: _Cluster, now: list[float], log: list[tuple[str, bool]]) -> StoreGuard:
    return StoreGuard(
        cluster,  # type: ignore[arg-type]
        policy=POLICY,
        clock=lambda: now[0],
        on_node=lambda node, is_open: log.append((node, is_open)),
    )


async def test_a_node_that_is_down_costs_only_the_keys_it_serves() -> None:
    now = [0.0]
    nodes: list[tuple[str, bool]] = []
    cluster = _Cluster(_Slots({"a": "a", "b": "b"}))
    g = _guarded(cluster, now, nodes)
    cluster.down.add("a")
    with pytest.raises(StoreError):
        await g.records.claim("a1", owner="o")
    assert nodes == [("a", True)] and not g.up and g.down() == ["a"]
    for _ in range(3):
        with pytest.raises(StoreError, match="store node a is down") as skipped:
            await g.records.claim("a2", owner="o")
        assert skipped.value.kind == "open"
        assert (await g.records.claim("b1", owner="o")).status is ClaimStatus.MISSING
    assert cluster.calls == [("claim", "a")] + [("claim", "b")] * 3  # a's keys skipped, b's served
    cluster.down.clear()
    now[0] = 6.0  # past open_s: the next call of a's probes it
    assert (await g.records.claim("a3", owner="o")).status is ClaimStatus.MISSING
    assert nodes == [("a", True), ("a", False)] and g.up


async def test_a_skipped_call_follows_its_slots_to_the_new_master_and_the_old_node_is_forgotten() -> None:
    now = [0.0]
    nodes: list[tuple[str, bool]] = []
    states: list[bool] = []
    slots = _Slots({"a": "a", "b": "b"})
    cluster = _Cluster(slots)
    g = _guarded(cluster, now, nodes)
    g._on_state = states.append
    cluster.down.add("a")
    with pytest.raises(StoreError):
        await g.records.claim("a1", owner="o")
    with pytest.raises(StoreError):  # skipped; it asked where a's keys are now: still on a
        await g.records.claim("a2", owner="o")
    assert slots.refreshes == 1
    now[0] = 1.0
    with pytest.raises(StoreError):  # within open_s of the last look: skipped without asking again
        await g.records.claim("a3", owner="o")
    now[0] = 5.0
    with pytest.raises(StoreError):  # the probe: a still refuses, skipped twice as long now (10 s)
        await g.records.claim("a4", owner="o")
    assert slots.refreshes == 1
    slots.moves = {"a": "c"}  # a replica of a took over its slots
    now[0] = 6.0  # open_s after the last look: a skipped call asks again, and goes to c
    assert (await g.records.claim("a5", owner="o")).status is ClaimStatus.MISSING
    assert slots.refreshes == 2 and cluster.calls[-1] == ("claim", "c")
    assert [c for c in cluster.calls if c[1] == "a"] == [("claim", "a")] * 2  # the first call and the probe
    # a forgotten: it serves nothing (the probe's failure said down again)
    assert nodes == [("a", True), ("a", True), ("a", False)] and states == [False, False, True] and g.up


async def test_a_step_on_another_node_fails_alone_and_counts_for_that_node() -> None:
    now = [0.0]
    nodes: list[tuple[str, bool]] = []
    errors: list[tuple[str, str]] = []
    cluster = _Cluster(_Slots({"a": "a", "b": "b", "u": "a"}))
    g = _guarded(cluster, now, nodes)
    g._on_error = lambda op, kind: errors.append((op, kind))
    cluster.down.add("b")
    for _ in range(2):  # the claim on a stands; its step on b failed, then was skipped
        assert (await g.records.claim("u1", owner="o")).status is ClaimStatus.MISSING
    assert cluster.calls == [("claim", "a"), ("unpin", "b"), ("claim", "a")]
    assert errors == [("unpin", "unreachable")] and nodes == [("b", True)] and g.down() == ["b"]


async def test_pinned_asks_each_node_through_its_breaker() -> None:
    now = [0.0]
    nodes: list[tuple[str, bool]] = []
    cluster = _Cluster(_Slots({"a": "a", "b": "b"}))
    g = _guarded(cluster, now, nodes)
    urls = ["http://d/a", "http://e/a", "http://d/b"]
    assert await g.pins.pinned(urls) == {u: Pinned(1, 10) for u in urls}
    assert sorted(cluster.calls) == [("pinned", "a"), ("pinned", "b")]  # one call per node
    cluster.down.add("b")
    with pytest.raises(StoreError):
        await g.pins.pinned(urls)
    assert nodes == [("b", True)]
    assert await g.pins.pinned(urls[:2]) == {u: Pinned(1, 10) for u in urls[:2]}  # a's engines alone: served
