"""Five-turn conversations through the gateway against simulated engines, checked against ground truth."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.integration.cluster import Dialogue, converse, metric, start_cluster
from tests.integration.latency import LatencyProxy
from turnkv import launch
from turnkv.bench.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("compat", "stream"), [("0.26", False), ("0.33", True), ("0.33", False)])
def test_keep_template_reuses_every_later_turn(
    procs: list[launch.Running], tmp_path: Path, redis_url: str, compat: str, stream: bool
) -> None:
    c = start_cluster(procs, tmp_path, compat=compat, redis_url=redis_url)
    turns = converse(c, 5, stream=stream, tools=True)
    assert all(t.correct for t in turns)
    assert turns[0].reason == "no_record"
    assert [t.outcome for t in turns[1:]] == ["full"] * 4
    assert all(t.headers["x-turnkv-action"] == "pull" for t in turns[1:])
    events = c.turn_events(5)
    assert [e["capture"] for e in events] == ["stored"] * 5
    assert sum(e["tokens_planned_pull"] for e in events) > 0
    pulled = metric(c.prefill[0].url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert pulled > 0  # the prefill engine really loaded KV from the decode engine


def test_a_turn_sent_the_moment_the_last_stream_ends_finds_its_record(
    procs: list[launch.Running], tmp_path: Path, redis_server: RedisServer, redis_url: str
) -> None:
    # An agent sends its next turn as soon as it reads [DONE], possibly to another gateway replica: the
    # record must be stored by then, or that turn meets the previous turn's claim (in_flight) and
    # recomputes everything. Replica A reaches Redis over a slow path, so a record stored after [DONE]
    # would arrive late.
    with LatencyProxy(redis_server.port, delay_s=0.1) as slow:
        # a Redis timeout well above the path's delay: the store must answer, late
        c = start_cluster(
            procs,
            tmp_path,
            compat="0.33",
            redis_url=f"redis://127.0.0.1:{slow.port}/0",
            gateway_env={"TURNKV_TIMEOUTS__REDIS_S": "2"},
        )
        b = launch.gateway(
            "gateway-b",
            [p.url for p in c.prefill],
            [d.url for d in c.decode],
            "--policy",
            "always-pull",
            "--redis-url",
            redis_url,
            log_dir=tmp_path,
        )
        procs.append(b)
        with (
            Dialogue(c, stream=True) as d,
            openai.OpenAI(base_url=b.url + "/v1", api_key="key-a", max_retries=0, timeout=60) as to_b,
        ):
            turns = [d.step(truth=False, client=to_b if i % 2 else None) for i in range(6)]
    assert [t.reason for t in turns[1:]] == ["full_match"] * 5
    assert [t.outcome for t in turns[1:]] == ["full"] * 5


def test_streaming_on_026_has_no_handle_and_says_so(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.26")
    turns = converse(c, 3, stream=True)
    assert all(t.correct for t in turns)
    # the record is kept without a handle: later turns say why they could not pull
    assert [t.reason for t in turns] == ["no_record", "no_handle_in_stream", "no_handle_in_stream"]
    assert {e["capture"] for e in c.turn_events(3)} == {"stored_no_handle_in_stream"}


@pytest.mark.parametrize("stream", [False, True])
def test_strip_template_refuses_or_trims_and_stays_correct(
    procs: list[launch.Running], tmp_path: Path, redis_url: str, stream: bool
) -> None:
    c = start_cluster(procs, tmp_path, template="strip", compat="0.33", redis_url=redis_url)
    turns = converse(c, 5, stream=stream)
    assert all(t.correct for t in turns)
    for t in turns[1:]:
        assert t.outcome in ("partial", "none")
        assert t.reason == "reasoning_stripped"
    assert any(t.outcome == "partial" for t in turns[1:])
    with c.client() as client:
        assert client.models.list().data[0].id == "sim-model"


def test_unchecked_reuse_fails_the_oracle_on_strip(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, template="strip", compat="0.33", policy="always-reuse-unchecked")
    turns = converse(c, 5)
    assert turns[0].correct
    assert not all(t.correct for t in turns[1:])


def test_retokenization_drift_is_caught(procs: list[launch.Running], tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", sim_flags=("--retokenize-drift",))
    turns = converse(c, 5)
    assert all(t.correct for t in turns)
    assert any(t.reason == "retokenized" for t in turns[1:])


def test_requests_without_a_session_are_plain_pd(procs: list[launch.Running], tmp_path: Path) -> None:
    """With conversations found from history turned off (tests/integration/test_zero_config.py has it on)."""
    c = start_cluster(procs, tmp_path, gateway_env={"TURNKV_CONVERSATION_FROM_HISTORY": "false"})
    turns = converse(c, 3, session=None)
    assert all(t.correct for t in turns)
    assert {t.outcome for t in turns} == {"stateless"}
    assert {t.reason for t in turns} == {"no_session"}


@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 300, 301, 302]])
def test_completions_pass_through(procs: list[launch.Running], tmp_path: Path, prompt: object) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    with c.client() as gw, c.truth_client() as truth:
        kwargs = {"model": "sim-model", "prompt": prompt, "max_tokens": 20}
        expected = truth.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
        assert gw.completions.create(**kwargs).choices[0].text == expected  # type: ignore[call-overload]
        streamed = "".join(
            ch.choices[0].text
            for ch in gw.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
            if ch.choices
        )
        assert streamed == expected
