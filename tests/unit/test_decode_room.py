"""Whether the D holding a conversation has room for its turn decode-local, with D's queue weighed against
P's (``reuse.room``), D's queue as the metrics give it (``reuse.load.decode_queue``), and what D's
queue does to the policy's estimates and decision (``reuse.cost.estimate``, ``adaptive``)."""

from __future__ import annotations

import dataclasses

import pytest

from turnkv.gateway.fleet import Fleet
from turnkv.reuse.cost import Action, CostParams, TurnFacts, estimate
from turnkv.reuse.load import decode_queue, load_facts
from turnkv.reuse.policies import build_policy
from turnkv.reuse.room import RoomState, decode_room
from turnkv.routing import InstanceView

from .test_load_facts import later_turn as load_facts_turn
from .test_load_facts import metrics, read

P, D = "http://p0", "http://d0"


def room(**over: float | int | None) -> RoomState:
    args: dict[str, float | int | None] = {
        "kv_usage": 0.3,
        "pressure_kv_usage": 0.9,
        "held": 0,
        "decode_queue_ms": 0.0,
        "prefill_queue_ms": 0.0,
    }
    args.update(over)
    return decode_room(**args).state  # type: ignore[arg-type]


def test_a_decode_engine_without_a_queue_has_room() -> None:
    assert room() is RoomState.FREE
    assert room(decode_queue_ms=None) is RoomState.FREE  # not read yet: as before, no queue known


def test_requests_waiting_on_d_refuse_the_turn_only_when_ds_queue_is_longer_than_ps() -> None:
    # refusing it whenever a request waits on D (local_queue: refuse) refuses it when P's queue is longest too
    assert room(decode_queue_ms=40.0, prefill_queue_ms=900.0) is RoomState.QUEUED
    assert room(decode_queue_ms=40.0, prefill_queue_ms=40.0) is RoomState.QUEUED
    assert room(decode_queue_ms=40.0, prefill_queue_ms=10.0) is RoomState.QUEUE_LONGER
    assert room(decode_queue_ms=40.0, prefill_queue_ms=None) is RoomState.QUEUE_LONGER  # P's unknown: none


def test_a_decode_engine_short_of_kv_or_with_turns_held_for_room_has_none_whatever_ps_queue() -> None:
    assert room(kv_usage=0.95, prefill_queue_ms=5000.0) is RoomState.BUSY
    assert room(held=1, prefill_queue_ms=5000.0) is RoomState.BUSY


def test_each_refusal_has_its_reason_and_the_turn_log_its_numbers() -> None:
    busy = decode_room(kv_usage=0.95, pressure_kv_usage=0.9, held=0, decode_queue_ms=None, prefill_queue_ms=None)
    longer = decode_room(kv_usage=0.1, pressure_kv_usage=0.9, held=0, decode_queue_ms=55.55, prefill_queue_ms=3.0)
    queued = decode_room(kv_usage=0.1, pressure_kv_usage=0.9, held=0, decode_queue_ms=5.0, prefill_queue_ms=300.0)
    assert (busy.ok, busy.reason and busy.reason.value) == (False, "decode_busy")
    assert (longer.ok, longer.reason and longer.reason.value) == (False, "decode_queue")
    assert (queued.ok, queued.reason) == (True, None)
    assert longer.log() == {"state": "queue_longer", "decode_queue_ms": 55.5, "prefill_queue_ms": 3.0}


# -- D's queue from its metrics -------------------------------------------------------------------


def test_ds_queue_is_none_while_nothing_waits_and_its_measured_wait_while_something_does() -> None:
    f = Fleet([P], [D])
    assert decode_queue(f.view(D), 8.0) == (None, "model:not_scraped")
    read(f, D, metrics(waiting=0, itl_n=10, itl_s=0.1, q_n=10, q_s=1.0))
    v = read(f, D, metrics(waiting=0, itl_n=30, itl_s=0.4, q_n=20, q_s=3.0))  # 200 ms waited, but none waits now
    assert decode_queue(v, 8.0) == (0.0, "waiting_gauge")
    v = read(f, D, metrics(waiting=3, itl_n=50, itl_s=0.7, q_n=30, q_s=3.5))  # 50 ms mean wait, 15 ms steps
    ms, src = decode_queue(v, 8.0)
    assert ms == pytest.approx(50.0) and src == "queue_time_histogram"
    v = read(f, D, metrics(waiting=3, itl_n=70, itl_s=1.0, q_n=40, q_s=3.51))  # 1 ms mean: at least a step
    assert decode_queue(v, 8.0)[0] == pytest.approx(15.0)


def test_without_a_queue_histogram_each_waiting_request_costs_a_step() -> None:
    v = InstanceView(
        D, "decode", True, True, 0, 4, 3, 0.2, None, None, None, True, 1.0, None, 0, None, 0.0, scraped=True
    )
    assert decode_queue(v, 8.0) == (24.0, "model:waiting_x_step")
    assert decode_queue(dataclasses.replace(v, step_ms=20.0), 8.0) == (60.0, "model:waiting_x_step")
    lf = load_facts(None, v, 0.0, default_step_ms=8.0)
    assert lf.decode_queue_ms == 24.0 and lf.log()["decode_queue_ms"] == 24.0
    assert lf.sources["decode_queue_ms"] == "model:waiting_x_step"
    assert decode_queue(None, 8.0) == (None, "model:no_decode_engine")


# -- what D's queue does to the estimates and the decision ---------------------------------------

COSTS = CostParams(link_bytes_per_s=20e9, push_bytes_per_s=300e9, decode_chunk_tokens=64)


def later_turn(*, p_queue_ms: float, d_queue_ms: float | None) -> TurnFacts:
    """``test_load_facts``' later turn of an 8k-token conversation, with D's queue."""
    return dataclasses.replace(load_facts_turn(p_queue_ms), decode_queue_ms=d_queue_ms)


def test_ds_queue_delays_a_decode_local_turn_fully_and_a_turn_through_p_only_by_what_is_left_of_it() -> None:
    base = estimate(COSTS, later_turn(p_queue_ms=100.0, d_queue_ms=0.0))
    short = estimate(COSTS, later_turn(p_queue_ms=100.0, d_queue_ms=50.0))  # drained while P works
    long = estimate(COSTS, later_turn(p_queue_ms=100.0, d_queue_ms=1000.0))
    assert short[Action.DECODE_LOCAL] == pytest.approx(base[Action.DECODE_LOCAL] + 0.050)
    assert short[Action.PULL] == pytest.approx(base[Action.PULL])
    assert long[Action.DECODE_LOCAL] == pytest.approx(base[Action.DECODE_LOCAL] + 1.0)
    # through P, the turn waits P's queue (100 ms), and then what is left of D's
    assert long[Action.PULL] == pytest.approx(base[Action.PULL] + 0.9)
    assert long[Action.RECOMPUTE] == pytest.approx(base[Action.RECOMPUTE] + 0.9)


def test_a_long_d_queue_does_not_make_a_pull_and_a_recompute_tie() -> None:
    # P lacks the history: recomputing it costs P ~0.2 s more than pulling it. Both wait out a 5 s D
    # queue, but the estimates keep the difference (a tie would go to the recompute, at P's expense)
    f = dataclasses.replace(later_turn(p_queue_ms=0.0, d_queue_ms=5000.0), prefill_cached_tokens=0)
    est = estimate(COSTS, f)
    assert est[Action.RECOMPUTE] - est[Action.PULL] > 0.1
    assert build_policy("adaptive", {}).decide(dataclasses.replace(f, decode_local_possible=False), COSTS).action is (
        Action.PULL
    )


def test_adaptive_takes_decode_local_behind_a_short_d_queue_and_says_decode_queue_when_ds_queue_turns_it() -> None:
    policy = build_policy("adaptive", {"itl_budget_ms": 30.0})
    d = policy.decide(later_turn(p_queue_ms=800.0, d_queue_ms=40.0), COSTS)
    assert (d.action, d.reason and d.reason.value) == (Action.DECODE_LOCAL, "decode_local")
    # the same P queue, but D's queue longer than the whole P leg: P's path, and D's queue is why
    d = policy.decide(later_turn(p_queue_ms=800.0, d_queue_ms=3000.0), COSTS)
    assert d.action is not Action.DECODE_LOCAL and d.reason is not None and d.reason.value == "decode_queue"
    assert d.estimates[Action.DECODE_LOCAL] > d.estimates[d.action]
    # no queue at D, none at P: P's path wins on its own (no queue reason)
    d = policy.decide(later_turn(p_queue_ms=0.0, d_queue_ms=0.0), COSTS)
    assert d.action is not Action.DECODE_LOCAL and d.reason is not None and d.reason.value != "decode_queue"
