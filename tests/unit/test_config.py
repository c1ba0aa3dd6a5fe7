"""Settings that cannot work are refused when loaded, with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv.config import ConfigError, load_settings

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
