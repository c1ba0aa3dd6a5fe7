"""Settings that cannot work are refused when loaded, with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv.config import ConfigError, load_settings
from turnkv.gateway.workers import worker_share

ENGINES = {"prefill": ["http://127.0.0.1:8100"], "decode": ["http://127.0.0.1:8200"]}


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ({"workers": 2}, "needs --redis-url"),
        ({"workers": 0}, "greater than or equal to 1"),
        ({"prefill": []}, "at least one --prefill"),
        ({"decoder_kv_blocks_ttl": 12.0}, "decoder_kv_blocks_ttl must exceed"),
    ],
)
def test_refused(flags: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_settings(**{**ENGINES, **flags})


@pytest.mark.parametrize("flags", [{}, {"workers": 4, "redis_url": "redis://127.0.0.1:6379/0"}])
def test_accepted(flags: dict[str, Any]) -> None:
    s = load_settings(**{**ENGINES, **flags})
    assert s.workers == flags.get("workers", 1)


def test_the_client_caps_are_the_whole_gateways_shared_among_workers() -> None:
    limits = {"max_inflight": 1024, "max_inflight_per_tenant": 10, "max_client_connections": 8192}
    one = load_settings(**ENGINES, limits={**limits, "max_connections_per_ip": 2})  # type: ignore[arg-type]
    assert worker_share(one) == one  # one process: the caps as configured
    s = load_settings(**ENGINES, workers=3, redis_url="redis://127.0.0.1:6379/0", limits=limits)  # type: ignore[arg-type]
    w = worker_share(s).limits
    assert (w.max_inflight, w.max_inflight_per_tenant, w.max_client_connections) == (341, 3, 2730)
    assert w.max_connections_per_ip is None and w.header_timeout_s == s.limits.header_timeout_s
    redis = "redis://127.0.0.1:6379/0"
    tiny = load_settings(**ENGINES, workers=4, redis_url=redis, limits={"max_inflight": 2})  # type: ignore[arg-type]
    assert worker_share(tiny).limits.max_inflight == 1  # at least one each
    # the per-process pools are not shares
    assert worker_share(s).redis_max_connections == s.redis_max_connections
