"""The store contract on real Redis deployments (one server, a 3-master Cluster, Sentinel, TLS), and
what the store does when Redis is busy, gone, back, or failed over."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import RedisCluster

from tests.integration.redis_topologies import (
    POLL_S,
    READY_TIMEOUT_S,
    Certificates,
    GatedRelay,
    SentinelSetup,
    redis_cluster,
    redis_cluster_setup,
    redis_has_tls,
    redis_sentinel,
    redis_tls,
)
from tests.store_contract import (
    D1,
    LONG_TTL_S,
    SHORT_MARKER_TTL_S,
    Backend,
    RedisContract,
    StoreContract,
    rec,
)
from turnkv.bench.redis_server import RedisServer
from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import ClaimStatus, Pinned
from turnkv.state.breaker import BreakerPolicy
from turnkv.state.guard import StoreGuard
from turnkv.state.redis import RedisStore, TLSOptions

pytestmark = pytest.mark.integration


async def _backend(url: str, tls: TLSOptions | None = None, timeout_s: float = 5.0) -> AsyncIterator[Backend]:
    """Three stores on ``url`` under a namespace of the test's own (shared servers need no flush)."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    stores = [
        RedisStore.from_url(url, namespace=ns, in_flight_ttl_s=ttl, command_timeout_s=timeout_s, tls=tls)
        for ttl in (60.0, 60.0, SHORT_MARKER_TTL_S)
    ]
    yield Backend(stores[0], stores[1], asyncio.sleep, stores[2], SHORT_MARKER_TTL_S)
    for s in stores:
        await s.close()


class TestOneServer(StoreContract, RedisContract):
    @pytest.fixture
    async def backend(self, redis_url: str) -> AsyncIterator[Backend]:
        async for b in _backend(redis_url):
            yield b


@pytest.fixture(scope="session")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as url:
        yield url


class TestCluster(StoreContract, RedisContract):
    @pytest.fixture
    async def backend(self, cluster_url: str) -> AsyncIterator[Backend]:
        async for b in _backend(cluster_url):
            yield b

    async def test_conversations_spread_over_the_masters(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        for i in range(30):
            await s.records.put(f"conv-{i}", rec(f"p{i}", url=f"http://d{i % 3}:8200"), LONG_TTL_S)
        cluster = s.conn.client
        assert isinstance(cluster, RedisCluster)
        nodes = {
            getattr(cluster.get_node_from_key(s.conn.conversation_key(f"conv-{i}")), "name", None) for i in range(30)
        }
        assert len(nodes) == 3
        assert await s.pins.pinned([f"http://d{i}:8200" for i in range(3)]) == {
            f"http://d{i}:8200": Pinned(10, 200) for i in range(3)
        }


@pytest.fixture(scope="session")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSetup]:
    with redis_sentinel(tmp_path_factory.mktemp("sentinel")) as setup:
        yield setup


class TestSentinel(StoreContract, RedisContract):
    @pytest.fixture
    async def backend(self, sentinel: SentinelSetup) -> AsyncIterator[Backend]:
        async for b in _backend(sentinel.url):
            yield b


async def test_a_sentinel_failover_is_followed_by_the_next_call(tmp_path: Path) -> None:
    with redis_sentinel(tmp_path) as setup:
        s = RedisStore.from_url(setup.url, command_timeout_s=5.0)
        await asyncio.gather(
            *(s.records.put(f"k{i}", rec(f"p{i}"), LONG_TTL_S) for i in range(8))
        )  # pooled connections
        c = setup.master.client()
        assert c.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]  # the replica has them
        c.close()
        setup.fail_over()
        # the pooled connections still lead to the old master, now a replica: the first call's
        # write meets READONLY, reconnects through Sentinel and runs on the new master (which
        # lacks the scripts: NOSCRIPT, load, run)
        assert (await s.records.claim("k0", owner="t")).record == rec("p0")
        got = await asyncio.gather(*(s.records.claim(f"k{i}", owner="t") for i in range(1, 8)))
        assert [c.record for c in got] == [rec(f"p{i}") for i in range(1, 8)]
        await s.close()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Certificates]]:
    if not redis_has_tls():
        pytest.skip("redis-server was built without TLS")
    with redis_tls(tmp_path_factory.mktemp("tls")) as server:
        yield server


TLS_CONNECT_S = 60.0


class TestTLS(StoreContract):
    @pytest.fixture
    async def backend(self, tls_server: tuple[int, Certificates]) -> AsyncIterator[Backend]:
        port, certs = tls_server
        tls = TLSOptions(ca_certs=str(certs.ca), certfile=str(certs.client_cert), keyfile=str(certs.client_key))
        # the contract opens 200 connections at once: TLS handshakes on a loaded 2-core machine took more
        # than 5 s together (a deadline, not what these tests are about)
        async for b in _backend(f"rediss://127.0.0.1:{port}/0", tls=tls, timeout_s=TLS_CONNECT_S):
            yield b


async def test_tls_checks_the_server_and_shows_our_certificate(tls_server: tuple[int, Certificates]) -> None:
    port, certs = tls_server
    url = f"rediss://127.0.0.1:{port}/0"
    refused = [
        TLSOptions(certfile=str(certs.client_cert), keyfile=str(certs.client_key)),  # server's CA unknown
        TLSOptions(ca_certs=str(certs.ca)),  # no client certificate
    ]
    for tls in refused:
        s = RedisStore.from_url(url, tls=tls, command_timeout_s=5.0)
        with pytest.raises(StoreError):
            await s.ping()
        await s.close()
    s = RedisStore.from_url(
        url,
        tls=TLSOptions(ca_certs=str(certs.ca), certfile=str(certs.client_cert), keyfile=str(certs.client_key)),
        command_timeout_s=5.0,
    )
    await s.ping()
    await s.close()


async def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(POLL_S)


async def test_a_full_pool_fails_the_call_only(redis_server: RedisServer, redis_url: str) -> None:
    with GatedRelay(redis_server.port) as relay:
        store = RedisStore.from_url(
            f"redis://127.0.0.1:{relay.port}/0",
            max_connections=2,
            pool_timeout_s=0.05,
            command_timeout_s=READY_TIMEOUT_S,
        )
        busy: list[str] = []
        guard = StoreGuard(store, policy=BreakerPolicy(open_s=60), on_busy=busy.append)
        held = [asyncio.create_task(guard.records.put(f"k{i}", rec(f"p{i}"), LONG_TTL_S)) for i in range(2)]
        await _until(lambda: relay.senders == 2, "both connections busy")  # held at the relay
        with pytest.raises(StoreBusy):
            await guard.records.claim("k0", owner="t")
        assert guard.up and busy == ["claim"]
        relay.open()
        await asyncio.gather(*held)
        assert (await guard.records.claim("k0", owner="t")).record == rec("p0")
        await store.close()


async def test_the_first_call_after_redis_is_back_succeeds(own_redis: RedisServer) -> None:
    now = [0.0]
    store = RedisStore.from_url(own_redis.url, command_timeout_s=5.0)
    guard = StoreGuard(store, policy=BreakerPolicy(open_s=2.0), clock=lambda: now[0])
    await asyncio.gather(
        *(guard.records.put(f"k{i}", rec(f"p{i}"), LONG_TTL_S) for i in range(16))
    )  # 16 pooled connections
    own_redis.stop()
    with pytest.raises(StoreError) as refused:
        await guard.records.claim("k0", owner="t")
    assert refused.value.kind == "unreachable" and not guard.up  # nothing listens: down at once
    own_redis.start()  # empty: nothing was saved
    now[0] += 3.0
    # every pooled connection is one Redis closed; each call reconnects on its one retry
    assert (await guard.records.claim("k0", owner="t")).status is ClaimStatus.MISSING and guard.up
    got = await asyncio.gather(*(guard.records.claim(f"k{i}", owner="t") for i in range(1, 16)))
    assert {c.status for c in got} == {ClaimStatus.MISSING}
    await guard.records.put("k0", rec("p0"), LONG_TTL_S)
    assert await guard.pins.pinned([D1]) == {D1: Pinned(1, 20)}
    await store.close()


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """Redis stopped (SIGSTOP) but still listening: every command sent meanwhile waits, and times out."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


async def test_warm_opens_the_pool_before_traffic(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, max_connections=24, connect_concurrency=4, command_timeout_s=5.0)
    assert await store.warm(100, within_s=READY_TIMEOUT_S) == 24  # at most the pool's size
    clients = redis.Redis.from_url(own_redis.url)
    try:
        assert clients.info("clients")["connected_clients"] >= 24 + 1  # the pool's and this one
    finally:
        clients.close()
    await store.close()


async def test_one_slow_command_fails_that_call_only(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, command_timeout_s=0.2)
    errors: list[tuple[str, str]] = []
    guard = StoreGuard(store, policy=BreakerPolicy(), on_error=lambda op, kind: errors.append((op, kind)))
    await store.warm(16, within_s=READY_TIMEOUT_S)
    await asyncio.gather(*(guard.records.put(f"k{i}", rec(f"p{i}"), LONG_TTL_S) for i in range(10)))
    with paused(own_redis), pytest.raises(StoreError) as slow:
        await guard.records.claim("k0", owner="t")
    assert slow.value.kind == "timeout" and errors == [("claim", "timeout")]
    # the turns that follow find their records: the store was slow once, not down
    got = await asyncio.gather(*(guard.records.claim(f"k{i}", owner="t") for i in range(1, 10)))
    assert [c.record for c in got] == [rec(f"p{i}") for i in range(1, 10)] and guard.up
    await store.close()


async def test_a_redis_that_stopped_answering_is_skipped_after_a_few_calls(own_redis: RedisServer) -> None:
    now = [0.0]
    store = RedisStore.from_url(own_redis.url, command_timeout_s=0.2)
    skipped: list[str] = []
    guard = StoreGuard(
        store, policy=BreakerPolicy(failures=3, span_s=0.5, open_s=1.0), clock=lambda: now[0], on_skip=skipped.append
    )
    await guard.records.put("k0", rec("p0"), LONG_TTL_S)
    kinds = []
    with paused(own_redis):
        for _ in range(3):  # one call every 0.3 s (of the guard's clock), each timing out
            with pytest.raises(StoreError) as failed:
                await guard.records.claim("k0", owner="t")
            kinds.append(failed.value.kind)
            now[0] += 0.3
        assert kinds == ["timeout"] * 3 and not guard.up
        for _ in range(5):  # skipped at once, Redis not asked
            with pytest.raises(StoreError) as failed:
                await guard.records.claim("k0", owner="t")
            assert failed.value.kind == "open"
        assert skipped == ["claim"] * 5
    now[0] += 1.0
    # the probe: Redis answers again (whether it ran a claim it was sent while stopped is its own affair)
    assert (await guard.records.claim("k0", owner="t2")).status in (ClaimStatus.FOUND, ClaimStatus.IN_FLIGHT)
    assert guard.up
    await store.close()


BACK_DEADLINE_S = 30.0  # the guard pings a down node every open_s
# one failure opens a breaker (no span): these tests are about coming back
ONE_FAILURE_OPENS = BreakerPolicy(failures=1, span_s=0.0, open_s=0.2)


async def found_back_without_a_call(
    store: RedisStore, key: str, node: str, out: Callable[[], object], back: Callable[[], object]
) -> None:
    """A guard with its pings running (``watch``, as the app's lifespan runs it): ``out()`` takes ``node``
    away and a call on ``key`` opens its breaker; ``back()`` brings it back, and then, with no call at
    all, the breaker closes (within a deadline). The pings' task ends when cancelled."""
    up = asyncio.Event()
    guard = StoreGuard(store, policy=ONE_FAILURE_OPENS, on_state=lambda is_up: up.set() if is_up else up.clear())
    await guard.records.put(key, rec("p0"), LONG_TTL_S)
    pings = asyncio.create_task(guard.watch())
    try:
        out()
        with pytest.raises(StoreError):
            await guard.records.claim(key, owner="t")
        assert not guard.up and guard.down() == [node]
        back()
        await asyncio.wait_for(up.wait(), BACK_DEADLINE_S)
        assert guard.up and guard.down() == []
    finally:
        pings.cancel()
        await asyncio.wait({pings}, timeout=READY_TIMEOUT_S)
        await store.close()
    assert pings.cancelled()


def _signal(server: RedisServer, sig: signal.Signals) -> Callable[[], None]:
    def send() -> None:
        assert server.proc is not None
        server.proc.send_signal(sig)

    return send


async def test_one_server_back_is_found_without_a_call(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, command_timeout_s=0.2)
    await found_back_without_a_call(store, "k0", f"127.0.0.1:{own_redis.port}", own_redis.stop, own_redis.start)


async def test_a_paused_server_is_found_without_a_call_once_it_answers(own_redis: RedisServer) -> None:
    store = RedisStore.from_url(own_redis.url, command_timeout_s=0.2)
    node = f"127.0.0.1:{own_redis.port}"
    await found_back_without_a_call(
        store, "k0", node, _signal(own_redis, signal.SIGSTOP), _signal(own_redis, signal.SIGCONT)
    )


async def test_sentinels_master_back_is_found_without_a_call(tmp_path: Path) -> None:
    # Sentinel must not fail over meanwhile: the master is paused for far less than it waits
    with redis_sentinel(tmp_path, down_after_ms=600_000) as setup:
        store = RedisStore.from_url(setup.url, command_timeout_s=0.2)
        await store.warm(1, within_s=READY_TIMEOUT_S)  # asks Sentinel where the master is
        node = f"127.0.0.1:{setup.master.port}"
        await found_back_without_a_call(
            store, "k0", node, _signal(setup.master, signal.SIGSTOP), _signal(setup.master, signal.SIGCONT)
        )


async def test_a_cluster_master_back_is_found_without_a_call_and_alone(tmp_path: Path) -> None:
    with redis_cluster_setup(tmp_path, 3, full_coverage=False) as setup:
        store = RedisStore.from_url(setup.url, command_timeout_s=0.2)
        await store.warm(1, within_s=READY_TIMEOUT_S)  # learns the slots
        server = next(s for s in setup.servers if s.port == setup.master_of(store.conn.conversation_key("k0")))
        await found_back_without_a_call(
            store, "k0", f"127.0.0.1:{server.port}", lambda: setup.kill(server), server.start
        )
