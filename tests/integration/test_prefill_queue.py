"""P's queue in the decision: simulated engines over real HTTP, the gateway's own prefills in flight
on P as the queue a later turn would wait in, the openai SDK as client, every answer checked against a
colocated engine's.

The gateway is told P computes slowly (``costs.prefill_us_per_token``), so that one long first turn held on
P stands for seconds of queue whatever this machine's speed, and D takes a decode-local turn's prefill two
tokens a step (``decode_chunk_tokens``), so that at an idle P the path through P is the faster."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Cluster, Dialogue, Turn, sim_control, sim_state, start_cluster, wait_for
from turnkv import launch

pytestmark = pytest.mark.integration
SYSTEM = "You are a careful agent. Follow the house rules about travel, budgets and safety. " * 12
LONG_SYSTEM = "Read the whole travel archive before answering, every page of it, with care. " * 500
CONVERSATIONS = 3


def slow_p_cluster(procs: list[launch.Running], tmp_path: Path, **params: object) -> Cluster:
    """P as the gateway is told it computes (slowly), D taking two tokens of a prefill a step, the ITL checks
    off: they have their own tests, and whether D's streams are running when a queued turn is decided (others
    sent decode-local a moment before) is this machine's timing. ``params``: more of the policy's."""
    policy = {"decode_chunk_tokens": 2, "itl_budget_ms": None, "itl_headroom": None, **params}
    return start_cluster(
        procs,
        tmp_path,
        compat="0.33",
        policy="adaptive",
        gateway_env={"TURNKV_POLICY__PARAMS": json.dumps(policy), "TURNKV_COSTS__PREFILL_US_PER_TOKEN": "500"},
    )


def test_a_long_queue_at_p_sends_later_turns_decode_local_and_an_idle_p_takes_them_back(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    c = slow_p_cluster(procs, tmp_path, decode_local_max_stall_ms=10_000)
    p = c.prefill[0].url
    dialogues = [Dialogue(c, session=f"conv-{i}", system=SYSTEM, max_tokens=24) for i in range(CONVERSATIONS)]
    blocker = Dialogue(c, session="blocker", system=LONG_SYSTEM, max_tokens=8)
    with ThreadPoolExecutor(CONVERSATIONS + 1) as pool:

        def turns() -> list[Turn]:
            return list(pool.map(lambda d: d.step(), dialogues))

        def one_at_a_time() -> list[Turn]:
            # sent together, each would find the others' prefills waiting at P, and be charged for them
            return [d.step() for d in dialogues]

        try:
            first, idle = turns(), one_at_a_time()
            # P idle: its path beats D's two-token chunks
            assert all(t.correct for t in first + idle)
            assert {(t.headers["x-turnkv-action"], t.reason) for t in idle} <= {
                ("recompute", "cheaper_to_recompute"),
                ("pull", "full_match"),
            }

            # a long first turn held on P: the gateway has seconds of P's work in flight there
            sim_control(p, delay_ms=60_000)
            held = pool.submit(blocker.step)
            wait_for(lambda: sim_state(p)["delayed"] == 1, what="the long first turn held on P")
            queued = turns()
            assert all(t.correct for t in queued)
            assert {(t.outcome, t.reason) for t in queued} == {("decode_local", "decode_local")}

            sim_control(p, delay_ms=0)
            assert held.result(timeout=60).correct
            back = one_at_a_time()  # P idle again: back through P
            assert all(t.correct for t in back)
            assert all(t.headers["x-turnkv-action"] != "decode_local" for t in back)
        finally:
            sim_control(p, delay_ms=0)
            for d in [*dialogues, blocker]:
                d.__exit__()

    # the turn log says what the policy was told, and where it came from
    events = c.turn_events(4 * CONVERSATIONS + 1)
    later = [e for e in events if e["turn"] > 1]

    def load(e: dict[str, Any]) -> dict[str, Any]:
        facts: dict[str, Any] = e["load"]
        return facts

    local = [load(e) for e in later if e["action"] == "decode_local"]
    assert len(local) == CONVERSATIONS
    assert all(f["prefill_queue_ms"] > 1000 and f["sources"]["prefill_queue_ms"].startswith("gateway") for f in local)
    through_p = [load(e) for e in later if e["action"] != "decode_local"]
    assert len(through_p) == 2 * CONVERSATIONS and all(f["prefill_queue_ms"] < 1000 for f in through_p)
    # the simulator reports vLLM's histograms: D's step and its streams' KV came from its metrics
    assert all(f["sources"]["decode_context_tokens"] == "kv_usage" for f in local + through_p)


def test_first_turns_run_on_d_while_p_is_held_and_through_p_once_it_is_idle(
    procs: list[launch.Running], tmp_path: Path
) -> None:
    # decode_local_first: while the gateway's own prefills wait at P, a new conversation's first turn runs on
    # D, its whole prompt prefilled there a chunk a step, and says prefill_busy; the conversation goes on from
    # it. At an idle P first turns go through P. Each answer equals a colocated engine's.
    c = slow_p_cluster(procs, tmp_path, decode_local_first=True)
    p = c.prefill[0].url
    blocker = Dialogue(c, session="blocker", system=LONG_SYSTEM, max_tokens=8)
    idle_first = Dialogue(c, session="idle", system=SYSTEM, max_tokens=16)
    busy_first = Dialogue(c, session="busy", system=SYSTEM + " Prefer trains.", max_tokens=16)
    with ThreadPoolExecutor(2) as pool:
        try:
            at_idle = idle_first.step()
            assert at_idle.correct and at_idle.headers["x-turnkv-action"] != "decode_local"

            sim_control(p, delay_ms=60_000)
            held = pool.submit(blocker.step)
            wait_for(lambda: sim_state(p)["delayed"] == 1, what="the long first turn held on P")
            first = busy_first.step()
            assert first.correct and (first.outcome, first.reason) == ("decode_local", "prefill_busy")
            second = busy_first.step()  # on from the first turn D computed: D's own prefix cache holds it
            assert second.correct and second.headers["x-turnkv-action"] == "decode_local"

            sim_control(p, delay_ms=0)
            assert held.result(timeout=60).correct
        finally:
            sim_control(p, delay_ms=0)
            for d in (blocker, idle_first, busy_first):
                d.__exit__()

    events = {(e["conversation_source"], e["turn"], e["reason"]) for e in c.turn_events(4)}
    assert ("header", 1, "prefill_busy") in events
