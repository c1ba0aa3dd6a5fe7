"""Shared fixtures: a real redis-server, simulated engines and gateways as real processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from turnkv import launch
from turnkv.bench.redis_server import RedisNotInstalled, RedisServer


def _redis(workdir: Path) -> RedisServer:
    try:
        return RedisServer(workdir)
    except RedisNotInstalled as exc:
        pytest.fail(f"{exc}; run scripts/test")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _redis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, which the test may stop and start."""
    server = _redis(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[launch.Running]]:
    """Processes a test starts; all are stopped at its end. Logs go to the test's tmp_path."""
    started: list[launch.Running] = []
    yield started
    for p in reversed(started):
        p.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``scripts/test`` runs ``--dist loadgroup``), the tests that share something their
    module starts for all of them (a module- or session-scoped fixture of its own: a cluster, simulated
    engines, a Redis topology) run on one worker, so that it starts once; the rest go wherever a worker is
    free. A test marked ``xdist_group`` keeps its group."""
    groups: dict[str, set[str]] = {}  # a fixture -> the fixtures started along with it (one group)
    shared: list[tuple[pytest.Item, set[str]]] = []
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or not isinstance(item, pytest.Function):
            continue
        module = item.nodeid.split("::", 1)[0]
        names = {
            f"{module}::{name}"
            for name, chain in item._fixtureinfo.name2fixturedefs.items()
            if any(d.scope in ("module", "session") and d.baseid == module for d in chain)
        }
        if names:
            group = set().union(names, *(groups.get(n, set()) for n in names))
            for n in group:
                groups[n] = group
            shared.append((item, names))
    for item, names in shared:
        item.add_marker(pytest.mark.xdist_group(min(groups[next(iter(names))])))
