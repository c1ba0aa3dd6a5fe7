"""The first failure of each kind shows in ``increase()``: its counter's series was there, at 0, before it.

A real gateway over simulated engines and a real Redis, scraped as Prometheus would (with the operator's
key: API keys are on). One failure of each kind is caused in turn; between the scrape before it and the
one after, its series goes from 0 to at least 1, which is what ``increase()`` over any range holding both
scrapes reports. No counter series may appear after the first scrape: one that did would hide its first
increment from ``increase()``.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import Dialogue, sim_control, start_cluster, wait_for
from turnkv import launch
from turnkv.bench.redis_server import RedisServer

pytestmark = pytest.mark.integration

OPS_KEY = "sk-ops"
Series = tuple[str, frozenset[tuple[str, str]]]


def scrape(url: str) -> dict[Series, float]:
    """Every counter sample of the gateway's /metrics, read with the operator's key."""
    req = urllib.request.Request(url + "/metrics", headers={"authorization": f"Bearer {OPS_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        if f.type == "counter"
        for s in f.samples
        if s.name.endswith("_total")
    }


def series(name: str, **labels: str) -> Series:
    return name, frozenset(labels.items())


def test_the_first_failure_of_each_kind_shows_in_increase(
    procs: list[launch.Running], tmp_path: Path, own_redis: RedisServer
) -> None:
    env = {"TURNKV_API_KEYS": f"sk-a,{OPS_KEY} admin", "TURNKV_STORE_RETRY_S": "0.05"}
    c = start_cluster(procs, tmp_path, redis_url=own_redis.url, gateway_env=env)
    p, d = c.prefill[0].url, c.decode[0].url
    first = scrape(c.gateway.url)
    assert first and all(v == 0 for v in first.values())

    def turn(dialogue: Dialogue) -> None:
        with contextlib.suppress(openai.APIError):  # a failure the gateway could not hide: counted all the same
            dialogue.step(truth=False)

    def unreachable_redis(dialogue: Dialogue) -> None:
        own_redis.stop()
        turn(dialogue)
        own_redis.start()

    def bad_key(dialogue: Dialogue) -> None:
        with pytest.raises(openai.AuthenticationError):
            c.client("sk-wrong").models.list()

    def faulty(url: str, **faults: object) -> Callable[[Dialogue], None]:
        def cause(dialogue: Dialogue) -> None:
            sim_control(url, **faults)
            turn(dialogue)

        return cause

    def decode_restart(dialogue: Dialogue) -> None:
        sim_control(d, restart=True)
        wait_for(
            lambda: scrape(c.gateway.url)[series("turnkv_engine_restarts_total", role="decode")] >= 1,
            what="the gateway to notice D's restart",
        )

    failures: list[tuple[str, Callable[[Dialogue], None], list[Series]]] = [
        (
            "P answers a 500",
            faulty(p, fail_next=1),
            [series("turnkv_upstream_errors_total", leg="prefill", kind="status", engine=p)],
        ),
        (
            "D's stream is cut",
            faulty(d, drop_next=1, drop_after_chunks=2),
            [series("turnkv_upstream_errors_total", leg="decode", kind="stream", engine=d)],
        ),
        ("a wrong API key", bad_key, [series("turnkv_rejected_requests_total", reason="invalid_api_key")]),
        (
            "Redis is gone",
            unreachable_redis,
            [series("turnkv_reuse_decisions_total", outcome="none", action="recompute", reason="store_unavailable")],
        ),
        ("D restarts", decode_restart, [series("turnkv_engine_restarts_total", role="decode")]),
    ]
    with Dialogue(c, api_key="sk-a", stream=True) as dialogue:
        turn(dialogue)
        turn(dialogue)
        for what, cause, expected in failures:
            before = scrape(c.gateway.url)
            cause(dialogue)
            after = scrape(c.gateway.url)
            for s in expected:
                assert before.get(s) == 0 < after.get(s, 0), f"{what}: {s} went {before.get(s)} -> {after.get(s)}"
    last = scrape(c.gateway.url)
    store_errors = {s: v for s, v in last.items() if s[0] == "turnkv_redis_errors_total" and v > 0}
    assert store_errors, "Redis's absence was counted as store errors"
    appeared = sorted(set(last) - set(first))
    assert not appeared, f"series that appeared with their first increment: {appeared}"
    # and each failure was logged as an event with its fields, on a JSON line like every other line
    lines = (c.log_dir / "gateway.log").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) and "event" in e for e in events)
    down = next(e for e in events if e["event"] == "store.down")
    assert down["level"] == "warning" and down["logger"] == "turnkv.store" and {"op", "why", "kind"} <= set(down)
    assert {"upstream.failed", "instance.restarted", "turn"} <= {e["event"] for e in events}
