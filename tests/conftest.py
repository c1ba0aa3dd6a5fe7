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
