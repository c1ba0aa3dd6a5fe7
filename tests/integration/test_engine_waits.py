"""Every engine wait is bounded by what the gateway has seen since the fault, with real processes: simulated
engines that a test freezes outright (SIGSTOP: connections still accepted, nothing answered, health probes
included, as a blackholed host), or whose stream stops mid-way with its connection open, and the openai SDK
as the client. Each turn's outcome is asserted (served, rerun on another D, or an OpenAI error), within a
client deadline the gateway's own must beat (15 s, the gateway's health probes at their default interval);
no test waits for a time to pass."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.cluster import Cluster, Dialogue, sim_control, start_cluster
from turnkv import launch

pytestmark = pytest.mark.integration
CLIENT_DEADLINE_S = 15.0
DEFAULT_PROBES = {"TURNKV_HEALTH_INTERVAL_S": "2", "TURNKV_SCRAPE_INTERVAL_S": "5"}  # the gateway's defaults


@contextlib.contextmanager
def frozen(engine: launch.Running) -> Iterator[None]:
    """The engine's process stopped: the kernel still accepts its connections, nothing answers them."""
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)


def dialogue(c: Cluster, *, stream: bool, max_tokens: int = 60) -> Dialogue:
    d = Dialogue(c, stream=stream, max_tokens=max_tokens)
    d.client = d.client.with_options(timeout=CLIENT_DEADLINE_S)
    return d


def no_tracebacks(c: Cluster) -> None:
    log = (c.log_dir / "gateway.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


@pytest.mark.parametrize(("stream", "policy"), [(True, "never-pull"), (False, "always-pull")])
def test_a_blackholed_decode_engine_is_routed_around(
    procs: list[launch.Running], tmp_path: Path, stream: bool, policy: str
) -> None:
    """The conversation's D stops answering anything. never-pull: the turn goes to that D (affinity) and is
    given up as soon as the fleet finds D lost (not at the 30 s first-token deadline, renewed by what D computed
    before it froze), then runs on the other D. always-pull: P's pull from the frozen D fails, and the turn
    runs on the other D without it."""
    c = start_cluster(procs, tmp_path, compat="0.33", n_decode=2, policy=policy, gateway_env=DEFAULT_PROBES)
    with dialogue(c, stream=stream) as d:
        d.step(truth=False)
        holder = next(e for e in c.decode if e.url == c.turn_events(1)[-1]["decode"])
        with frozen(holder):
            second = d.step(truth=False)  # served within the client's deadline (it raises otherwise)
        event = c.turn_events(2)[-1]
        assert second.answer and event["decode"] != holder.url, event
        retried = "decode_first_token_deadline" if policy == "never-pull" else "prefill_pull_failed"
        assert retried in event["retries"], event
    no_tracebacks(c)


@pytest.mark.parametrize("stream", [True, False])
def test_a_blackholed_only_decode_engine_ends_the_turn_with_an_error(
    procs: list[launch.Running], tmp_path: Path, stream: bool
) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", gateway_env=DEFAULT_PROBES)
    with dialogue(c, stream=stream) as d:
        d.step(truth=False)
        with frozen(c.decode[0]), pytest.raises(openai.APIError) as err:
            d.step(truth=False)
        assert not isinstance(err.value, openai.APITimeoutError)  # the gateway answered, within the deadline
        assert "stopped answering" in str(err.value) or "no decode engine" in str(err.value), err.value
    with dialogue(c, stream=stream) as after:
        assert after.step(truth=False).answer  # D is back: served again
    no_tracebacks(c)


def test_a_decode_engine_blackholed_mid_stream_ends_the_stream_with_an_error_event(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    """D freezes after its first tokens: the stream ends with an OpenAI error event once the fleet finds D
    lost, long before the stream's idle deadline (30 s) or D's read timeout (300 s)."""
    slow = ("--time-scale", "1", "--decode-itl-ms", "50", "--prefill-floor-ms", "1")  # 400 tokens: 20 s
    c = start_cluster(procs, tmp_path, compat="0.33", decode_flags=slow, gateway_env=DEFAULT_PROBES)
    with dialogue(c, stream=True) as d:
        d.step(truth=False)
        ask: dict[str, Any] = {"model": "sim-model", "messages": d.messages, "max_tokens": 400}
        stream = d.client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **ask)
        chunks = iter(stream)
        next(chunks)  # the first output came
        with frozen(c.decode[0]), pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        assert not isinstance(err.value, openai.APITimeoutError)
        assert "sent nothing" in str(err.value), err.value
    no_tracebacks(c)


def test_a_stream_that_stops_mid_way_ends_within_its_idle_deadline(procs: list[launch.Running], tmp_path: Path) -> None:
    """D keeps the connection open and says nothing more (its engine idle): the stream ends with an OpenAI
    error event after decode_idle_s, not after D's read timeout, and the conversation goes on."""
    c = start_cluster(procs, tmp_path, compat="0.33", gateway_env={"TURNKV_TIMEOUTS__DECODE_IDLE_S": "2"})
    with dialogue(c, stream=True) as d:
        d.step(truth=False)
        sim_control(c.decode[0].url, freeze_next=1, drop_after_chunks=3)
        with pytest.raises(openai.APIError) as err:
            d.step(truth=False)
        assert not isinstance(err.value, openai.APITimeoutError)
        assert "sent nothing" in str(err.value), err.value
        assert d.step(truth=False).answer
    no_tracebacks(c)


@pytest.mark.parametrize("session", ["conv-1", None], ids=["conversation", "stateless"])
def test_a_prefill_engine_that_fails_once_is_asked_again(
    procs: list[launch.Running], tmp_path: Path, session: str | None
) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33")
    sim_control(c.prefill[0].url, fail_next=1)
    with Dialogue(c, session=session) as d:
        turn = d.step()
        assert turn.correct
    assert "prefill_status" in c.turn_events(1)[-1]["retries"]
    no_tracebacks(c)
