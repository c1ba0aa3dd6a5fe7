"""A conversation at agent speed: each turn sent the instant the previous stream ends, as an agent's tool
loop does, through simulated engines over real HTTP, the openai SDK streaming, every answer checked
against a colocated engine's.

D's metrics are read every 50 ms and each answer streams for a few hundred ms, so every reading the
gateway holds when the next turn is planned was taken while the conversation's own previous stream ran
on D. That stream is over: it must not count as running on D (``itl_headroom``, ``itl_budget``), waiting
there (``decode_queue``) or filling its KV (``decode_busy``). Nothing else runs on D, so every later turn
reuses the conversation's KV (pulled, decode-local, or from P's cache), on separate GPUs and on one, with
a session id and, as agent frameworks call it, without (the conversation found from its history)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster import Dialogue, start_cluster
from turnkv import launch

pytestmark = pytest.mark.integration
TURNS = 5
REUSED = {"full", "partial", "decode_local"}
LOAD_REFUSALS = {"itl_headroom", "itl_budget", "decode_queue", "decode_busy"}
SYSTEM = "You are a careful agent. " * 300  # about 2k tokens of history
TOOL_OUTPUT = "Tool output {}: " + "the value is forty two and rising; " * 40


@pytest.mark.parametrize(
    ("shared_gpu", "session"),
    [("false", "agent-1"), ("false", None), ("true", "agent-1")],
    ids=["separate_gpus", "separate_gpus_no_session_id", "one_gpu"],
)
def test_a_conversations_own_finished_turn_never_counts_against_its_next(
    procs: list[launch.Running], tmp_path: Path, shared_gpu: str, session: str | None
) -> None:
    c = start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        policy="adaptive",
        sim_flags=("--time-scale", "1"),
        prefill_flags=("--no-prefix-caching",),
        gateway_env={"TURNKV_SCRAPE_INTERVAL_S": "0.05", "TURNKV_SHARED_GPU": shared_gpu},
    )
    with Dialogue(c, session=session, stream=True, max_tokens=48, system=SYSTEM) as d:
        # the next turn follows at once; the ground truth is asked afterwards, from the same histories
        histories, turns = [], []
        for k in range(TURNS):
            histories.append(list(d.messages))
            turns.append(d.step(truth=False))
            d.messages[-1]["content"] = TOOL_OUTPUT.format(k)  # a tool's output: hundreds of new tokens
    with Dialogue(c, session=None, stream=True, max_tokens=48) as truth:
        for history, turn in zip(histories, turns, strict=True):
            truth.messages = history
            assert truth.step(client=truth.truth, truth=False).answer == turn.answer
    events = c.turn_events(TURNS)
    later = [e for e in events if e["turn"] >= 2]
    assert len(later) == TURNS - 1, events
    for t, e in zip(turns[1:], later, strict=True):
        assert t.outcome in REUSED, (t.headers, e)
        assert t.reason not in LOAD_REFUSALS, (t.headers, e)
