"""What a turn does when something is wrong: other tenants, races, expiry, failing engines and Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.cluster import REAL_TIME, Dialogue, metric, sim_control, start_cluster, wait_for
from turnkv import launch
from turnkv.bench.redis_server import RedisServer

pytestmark = pytest.mark.integration
ABORT_WAIT_S = 10.0
RECOVERY_TURNS = 4
READY_DEADLINE_S = 30.0  # the store's pings come every store_retry_s (1 s)


def test_tenants_never_see_each_others_handles(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    c = start_cluster(procs, tmp_path, redis_url=redis_url)
    with Dialogue(c) as d, c.client("key-b") as other:
        assert d.step().reason == "no_record"
        stranger = d.step(client=other)  # same session id, another API key
        assert stranger.correct and stranger.reason == "no_record"
        # the stranger's turn neither read nor consumed tenant A's handle
        d.messages = d.messages[:-2]
        again = d.step()
        assert again.correct and again.outcome == "full"


def test_concurrent_turns_claim_the_handle_once(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    with Dialogue(c) as d:
        d.step()
        # long enough to fill the socket buffers: the first turn stays in flight until we read it
        body = {"model": "sim-model", "messages": d.messages, "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=30) as http,
            http.stream(
                "POST",
                c.gateway.url + "/v1/chat/completions",
                json=body,
                headers={"X-Session-ID": "conv-1", "Authorization": "Bearer key-a"},
            ) as first,
        ):
            assert first.headers["x-turnkv-outcome"] == "full"  # the first turn holds the claim while it streams
            lines = first.iter_lines()
            next(lines)
            second = d.step()
            assert second.correct and second.reason == "concurrent_turn"
            rest = list(lines)
        assert [x for x in rest if x][-1] == "data: [DONE]"


@pytest.mark.parametrize(("policy", "reason"), [("fail", "pull_failed"), ("recompute", "full_match")])
def test_expired_decode_handle(procs: list[launch.Running], tmp_path: Path, policy: str, reason: str) -> None:
    c = start_cluster(procs, tmp_path, prefill_flags=("--kv-load-failure-policy", policy, "--no-prefix-caching"))
    with Dialogue(c) as d:
        d.step()
        assert sim_control(c.decode[0].url, expire_handles=True)["expired_handles"] == 1
        t = d.step()
        assert t.correct and t.reason == reason
        assert metric(c.prefill[0].url, "vllm:nixl_num_kv_expired_reqs_total") == 1  # P declined the read
        assert d.step().outcome == "full"  # the next turn has a fresh handle again


def test_prefill_500_on_pull_is_retried_without_the_handle(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path)
    with Dialogue(c) as d:
        d.step()
        sim_control(c.prefill[0].url, fail_next=1)
        t = d.step()
        assert t.correct and t.reason == "pull_failed" and t.headers["x-turnkv-action"] == "recompute"
        assert d.step().outcome == "full"


@REAL_TIME
def test_decode_engine_restart(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, prefill_flags=("--no-prefix-caching",))
    with Dialogue(c) as d:
        d.step()
        old = sim_control(c.decode[0].url)["engine_id"]
        assert sim_control(c.decode[0].url, restart=True)["engine_id"] != old
        t = d.step()
        # either the gateway saw the restart in D's metrics first, or P's pull failed the handshake
        assert t.correct and t.reason in ("engine_restarted", "pull_failed")
        assert d.step().outcome == "full"


def test_redis_down_and_back(procs: list[launch.Running], tmp_path: Path, own_redis: RedisServer) -> None:
    c = start_cluster(procs, tmp_path, redis_url=own_redis.url, gateway_env={"TURNKV_STORE_RETRY_S": "0.05"})
    with Dialogue(c) as d:
        d.step()
        assert d.step().outcome == "full"
        own_redis.stop()
        down = [d.step() for _ in range(2)]
        assert all(t.correct for t in down)
        assert {t.reason for t in down} == {"store_unavailable"}
        assert metric(c.gateway.url, "turnkv_store_up") == 0
        own_redis.start()  # empty: it kept nothing
        # the gateway's background loops may meet Redis first; a turn right after such a failure
        # still skips the store for store_retry_s, so allow a few turns to see it come back
        back = [d.step() for _ in range(RECOVERY_TURNS)]
        assert all(t.correct for t in back)
        recovered = [t.reason for t in back if t.reason != "store_unavailable"]
        assert recovered and recovered[0] in ("no_record", "full_match")
        assert d.step().outcome == "full"
        assert metric(c.gateway.url, "turnkv_store_up") == 1
        assert metric(c.gateway.url, "turnkv_redis_errors_total") >= 1


def test_the_store_is_up_again_without_a_turn_once_redis_is_back(
    procs: list[launch.Running], tmp_path: Path, own_redis: RedisServer
) -> None:
    # the pin janitor is the only other caller of the store between turns: once an hour here, so nothing
    # but the gateway's pings of the down node can find Redis back
    env = {"TURNKV_DECODE_MEMORY__JANITOR_INTERVAL_S": "3600"}
    c = start_cluster(procs, tmp_path, redis_url=own_redis.url, gateway_env=env)

    def store() -> dict[str, object]:
        got: dict[str, object] = httpx.get(c.gateway.url + "/ready", timeout=10).json()["store"]
        return got

    with Dialogue(c) as d:
        assert d.step().correct
        own_redis.stop()
        assert d.step().reason == "store_unavailable"  # nothing listening: its breaker opens at once
        assert store()["up"] is False and store()["nodes_down"] == [f"127.0.0.1:{own_redis.port}"]
        own_redis.start()  # and no turn from here on
        wait_for(lambda: store()["up"] is True, READY_DEADLINE_S, "the store up without a turn", state=store)
        assert store()["nodes_down"] == [] and metric(c.gateway.url, "turnkv_store_up") == 1
    lines = [json.loads(line) for line in (tmp_path / "gateway.log").read_text().splitlines() if line.startswith("{")]
    ups = [e for e in lines if e.get("event") == "store.up"]
    assert [(e["op"], e["why"]) for e in ups] == [("ping", "ping_answered")]


def test_decode_failing_before_output_is_rerun(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    with Dialogue(c, stream=True) as d:
        d.step()
        sim_control(c.decode[0].url, fail_next=1)
        t = d.step()
        assert t.correct
        events = c.turn_events(2)
        assert "turn_rerun" in events[-1]["retries"]


def test_decode_dropping_mid_stream_ends_with_an_error_event(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    with Dialogue(c, stream=True) as d:
        d.step()
        sim_control(c.decode[0].url, drop_next=1, drop_after_chunks=3)
        with pytest.raises(openai.APIError, match="decode stream"):
            d.step()
        d.messages = d.messages  # the failed turn left the history as it was
        t = d.step()
        # the broken turn stored nothing and put back the record it claimed (P had pulled its handle)
        assert t.correct and t.reason == "handle_spent"


def test_client_disconnect_aborts_the_decode_request(procs: list[launch.Running], tmp_path: Path) -> None:
    # real decode timing (8 ms per token): the answer is still being generated when the client leaves
    c = start_cluster(procs, tmp_path, compat="0.33", sim_flags=("--time-scale", "1"))
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http, http.stream("POST", c.gateway.url + "/v1/chat/completions", json=body) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the gateway notices the disconnect and closes D's stream; D aborts the request
    deadline = time.monotonic() + ABORT_WAIT_S
    while time.monotonic() < deadline:
        if metric(c.decode[0].url, "vllm:request_success_total", finished_reason="abort") >= 1:
            break
        time.sleep(0.05)
    assert metric(c.decode[0].url, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(c.decode[0].url, "vllm:request_success_total", finished_reason="length") == 0


def test_unreachable_prefill_is_replaced(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, n_prefill=2)
    c.prefill[0].kill()
    with Dialogue(c) as d:
        turns = [d.step() for _ in range(4)]
    assert all(t.correct for t in turns)
    ready = json.loads(httpx.get(c.gateway.url + "/ready").text)
    assert [p["healthy"] for p in ready["prefill"]] == [False, True]
