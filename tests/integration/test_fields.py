"""What of a request reaches the engines, with real processes: a gateway on simulated engines that count the
engine-private fields they are sent (``/_sim/state``), clients over real HTTP, and body shapes fuzzed with
hypothesis against the live gateway: no body gives a 500, or a traceback in its log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.test_fields import bodies, deep
from tests.integration.cluster import Cluster, Dialogue, sim_state, start_cluster
from turnkv import launch

pytestmark = pytest.mark.integration
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
PRIVATE = {"priority": -100, "vllm_xargs": {"kv_transfer_params": {"do_remote_prefill": True}}, "request_id": "x"}


def seen_by_engines(c: Cluster) -> dict[str, int]:
    """Engine-private fields the prefill and decode engines were sent, summed."""
    total: dict[str, int] = {}
    for e in [*c.prefill, *c.decode]:
        for name, n in sim_state(e.url)["private_fields"].items():
            total[name] = total.get(name, 0) + n
    return total


def no_tracebacks(log: Path) -> None:
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text


def test_engine_private_fields_reach_the_engines_only_where_configured(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    # a second gateway on the same engines, configured to let clients set the queue priority
    allowing = launch.gateway(
        "allowing",
        [p.url for p in c.prefill],
        [d.url for d in c.decode],
        log_dir=tmp_path,
        env={"TURNKV_ENGINE_FIELDS": '["priority"]'},
    )
    procs.append(allowing)
    with httpx.Client(base_url=c.gateway.url, timeout=30) as gw, httpx.Client(base_url=allowing.url, timeout=30) as ok:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", {"model": "sim-model", "input": "hi"})):
            for name, value in PRIVATE.items():
                for stream in (False, True):
                    r = gw.post(path, json={**body, name: value, "stream": stream})
                    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        assert gw.post("/v1/chat/completions", json=CHAT).status_code == 200  # the same turn without them
        assert seen_by_engines(c) == {}
        served = ok.post("/v1/chat/completions", json={**CHAT, "priority": 5})
        assert served.status_code == 200, served.text
        assert seen_by_engines(c) == {"priority": 2}  # P's leg and D's
        assert ok.post("/v1/chat/completions", json={**CHAT, "vllm_xargs": {"a": 1}}).status_code == 400
    no_tracebacks(tmp_path / "gateway.log")
    no_tracebacks(tmp_path / "allowing.log")


def test_a_tool_call_echoed_back_with_deeply_nested_arguments_is_served(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    # arguments nested past what the gateway compares as JSON (64) but that the engine's template parses, and
    # past what any parser takes (the engine's render refuses them: a 400)
    for depth, served in ((500, True), (50_000, False)):
        for session in ("conv-1", None):  # named, and found from its history
            with Dialogue(c, session=session, tools=True) as d:
                d.step(truth=False)
                call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": deep(depth)}}
                d.messages[-2] = {**d.messages[-2], "tool_calls": [call]}  # the answer, as a tool call
                d.messages[-1] = {"role": "tool", "tool_call_id": "c1", "content": "found"}
                if served:
                    second = d.step(truth=False)  # the SDK raises on an error status
                    assert second.outcome in ("full", "partial", "none"), second.headers  # as the tokens say
                else:
                    with pytest.raises(openai.BadRequestError):
                        d.step(truth=False)
    no_tracebacks(tmp_path / "gateway.log")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log_dir = tmp_path_factory.mktemp("fuzz")
    running: list[launch.Running] = []
    try:
        # a short context: a body that names no max_tokens is answered in a few hundred tokens at most
        c = start_cluster(running, log_dir, compat="0.33", sim_flags=("--max-model-len", "512"))
        yield c.gateway.url, log_dir / "gateway.log"
    finally:
        for p in reversed(running):
            p.stop()


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
def test_no_body_gives_a_500_over_real_sockets(live: tuple[str, Path], data: st.DataObject, path: str) -> None:
    url, log = live
    body: dict[str, Any] = data.draw(bodies(path))
    if body.get("model") == "m":
        body["model"] = "sim-model"
    with httpx.Client(base_url=url, timeout=30) as gw:
        r = gw.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code != 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) >= {"message", "type"} and err["message"]
    no_tracebacks(log)
