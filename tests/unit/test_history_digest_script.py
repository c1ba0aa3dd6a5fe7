"""scripts/history_digest.py, BENCHMARKS.md's measure of the history digest, still runs and still times
the digest (a conversation found from the messages), not an early exit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from turnkv.gateway.identity import conversation_of

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "history_digest.py"


def test_it_measures_a_digest_of_each_size() -> None:
    spec = importlib.util.spec_from_file_location("history_digest", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    body = {"model": "m", "messages": mod.history(2_000)}
    found = conversation_of({}, body, **mod.OPTS)
    assert found is not None and found.source == "digest"
    messages, kb, digest_ms, parse_ms = mod.measure(2_000, runs=2)
    assert messages == len(body["messages"]) and kb > 4 and digest_ms > 0 and parse_ms > 0
