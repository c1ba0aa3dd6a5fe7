"""The planner's pure parts as tables: the one place a turn's reason is chosen (``plan.reason``, ``plan.choose``),
and the only ways a plan changes once made (``Plan.downgrade``, ``Plan.checked``). The decision path around
them runs through the pipeline tests (tests/pipeline), every reason there."""

from __future__ import annotations

import pytest

from tests.store_contract import rec
from turnkv.engine.base import HandleUse
from turnkv.gateway.turn.plan import Ask, Basis, Seat, Told, choose, reason
from turnkv.gateway.turn.results import Ahead, Fallback, Plan
from turnkv.reuse.assess import Assessment, Reason
from turnkv.reuse.cost import Action, TurnFacts
from turnkv.reuse.decision import Decision
from turnkv.reuse.load import LoadFacts
from turnkv.reuse.room import DecodeRoom, RoomState
from turnkv.state.record import ConversationRecord

HELD = rec(tokens=64)  # a record whose handle D still pins
GIVEN_BACK = rec(None, tokens=64, unpinned="not_needed")  # ... whose handle was given back, not worth its bytes
BUSY = DecodeRoom(RoomState.BUSY)
QUEUED = DecodeRoom(RoomState.QUEUE_LONGER, 50.0, 10.0)
FREE = DecodeRoom(RoomState.FREE)


def _ask(record: ConversationRecord | None, match: Assessment | None = None, basis: Basis = Basis.RENDERED) -> Ask:
    return Ask(basis, record, match or (Assessment.whole(record) if record else _nothing()), 80)


def _nothing() -> Assessment:
    return Assessment(None, 0, False, Reason.NO_RECORD, False)


def _partial(record: ConversationRecord, why: Reason) -> Assessment:
    return Assessment(record, 32, False, why, True)


D, A, R = Decision, Action, Reason


@pytest.mark.parametrize(
    ("ask", "decision", "seat", "expected"),
    [
        # decode-local: the policy's reason, else decode_local
        (_ask(HELD), D(A.DECODE_LOCAL, R.SHARED_GPU), Seat(None, room=FREE), R.SHARED_GPU),
        (_ask(HELD), D(A.DECODE_LOCAL), Seat(None, room=FREE), R.DECODE_LOCAL),
        # the policy declined usable KV and says why, whatever D's room
        (_ask(HELD), D(A.RECOMPUTE, R.ITL_HEADROOM), Seat(None, room=BUSY), R.ITL_HEADROOM),
        # D would have taken it, but is short of KV or its queue is longer than P's
        (_ask(HELD), D(A.RECOMPUTE), Seat(None, room=BUSY), R.DECODE_BUSY),
        (_ask(HELD), D(A.RECOMPUTE), Seat(None, room=QUEUED), R.DECODE_QUEUE),
        # ... a pull from a pressed D says what matched
        (_ask(HELD), D(A.PULL), Seat(None, room=BUSY), R.FULL_MATCH),
        # routing put the turn on another D, pulling or not
        (_ask(HELD), D(A.PULL), Seat(None, moved=True), R.DECODE_MOVED),
        (_ask(HELD), D(A.RECOMPUTE), Seat(None, moved=True), R.DECODE_MOVED),
        # D's KV matched, but its handle was given back: why
        (_ask(GIVEN_BACK), D(A.RECOMPUTE), Seat(None), R.CHEAPER_TO_RECOMPUTE),
        (_ask(rec(None, unpinned="no_handle_in_stream")), D(A.RECOMPUTE), Seat(None), R.NO_HANDLE_IN_STREAM),
        (_ask(rec(None, unpinned="pressure")), D(A.RECOMPUTE), Seat(None), R.PIN_RELEASED),
        # ... only where it matched in full: otherwise why it diverged
        (_ask(GIVEN_BACK, _partial(GIVEN_BACK, R.ANSWER_EDITED)), D(A.RECOMPUTE), Seat(None), R.ANSWER_EDITED),
        # otherwise what the check found
        (_ask(HELD, _partial(HELD, R.RETOKENIZED)), D(A.PULL), Seat(None, room=FREE), R.RETOKENIZED),
        (_ask(None), D(A.RECOMPUTE), Seat(None), R.NO_RECORD),
    ],
)
def test_the_one_place_a_turns_reason_is_chosen(ask: Ask, decision: Decision, seat: Seat, expected: Reason) -> None:
    assert reason(ask, decision.action, decision, seat) is expected


def _told(*, waiting: int = 0, queue_ms: float | None = None) -> Told:
    f = TurnFacts(80, 0, 0, 0, True, prefill_waiting=waiting, prefill_queue_ms=queue_ms)
    return Told(Seat(None, room=FREE), f, LoadFacts())


@pytest.mark.parametrize(
    ("decision", "told", "expected"),
    [
        # a first turn on D only while prefills wait at P; it then says prefill_busy, whatever the policy said
        (D(A.DECODE_LOCAL, R.DECODE_LOCAL), _told(waiting=2), (A.DECODE_LOCAL, R.PREFILL_BUSY)),
        (D(A.DECODE_LOCAL, R.SHARED_GPU), _told(queue_ms=40.0), (A.DECODE_LOCAL, R.PREFILL_BUSY)),
        # at an idle P, P/D's split stands, even where D alone would be faster
        (D(A.DECODE_LOCAL, R.DECODE_LOCAL), _told(), (A.RECOMPUTE, R.NO_RECORD)),
        # through P: nothing stored, whatever the policy declined
        (D(A.RECOMPUTE, R.ITL_HEADROOM), _told(waiting=2), (A.RECOMPUTE, R.NO_RECORD)),
    ],
)
def test_a_first_turn_runs_on_d_only_while_p_is_busy(
    decision: Decision, told: Told, expected: tuple[Action, Reason]
) -> None:
    assert choose(_ask(None, basis=Basis.FIRST), decision, told) == expected


def test_a_pull_of_nothing_is_a_recompute() -> None:
    # a policy that pulls where no handle is left: nothing to pull, and the plan says why
    action, why = choose(_ask(GIVEN_BACK), Decision(Action.PULL), _told())
    assert (action, why) == (Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE)


HANDLE = HELD.handle or {}
PULL = Plan(
    Action.PULL,
    Reason.FULL_MATCH,
    prefill_url="http://p0",
    decode_url="http://d0",
    send=HandleUse(HANDLE, 64),
    pull_tokens=48,
    expected_cached=64,
    assessment=Assessment.whole(HELD),
)
RELEASE = Plan(Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE, send=HandleUse.release(HANDLE), expected_cached=16)
LOCAL = Plan(Action.DECODE_LOCAL, Reason.DECODE_LOCAL, decode_url="http://d0", expected_cached=64, direct=True)
STATELESS = Plan.plain(Reason.NO_SESSION)


@pytest.mark.parametrize(
    ("plan", "why", "stateful", "expected"),
    [
        # a failed or stalled pull says so; a handle sent only to be released cost the turn nothing
        (PULL, Fallback.PULL_FAILED, True, Reason.PULL_FAILED),
        (PULL, Fallback.PREFILL_DEADLINE, True, Reason.FIRST_TOKEN_DEADLINE),
        (RELEASE, Fallback.PULL_FAILED, True, Reason.CHEAPER_TO_RECOMPUTE),
        # a decode leg that failed before its first token: said whenever the turn was a conversation's
        (RELEASE, Fallback.DECODE_FAILED, True, Reason.DECODE_FAILED),
        (RELEASE, Fallback.DECODE_DEADLINE, True, Reason.FIRST_TOKEN_DEADLINE),
        (STATELESS, Fallback.DECODE_FAILED, False, Reason.NO_SESSION),
        # a decode-local turn whose D failed keeps its reason
        (LOCAL, Fallback.DECODE_LOCAL_FAILED, True, Reason.DECODE_LOCAL),
        # a pull the check did not prove: what the check found, or that there was nothing to check
        (PULL, Fallback.RENDER_MISMATCH, True, Reason.FULL_MATCH),
        (PULL.checked(_partial(HELD, Reason.RETOKENIZED)), Fallback.RENDER_MISMATCH, True, Reason.RETOKENIZED),
        (LOCAL, Fallback.RENDER_MISMATCH, True, Reason.RENDER_FAILED),
        # the messages refused once planned: the reason itself
        (PULL, Reason.REQUEST_REJECTED, True, Reason.REQUEST_REJECTED),
    ],
)
def test_a_plan_downgraded_runs_as_plain_p_d_and_says_why(
    plan: Plan, why: Fallback | Reason, stateful: bool, expected: Reason
) -> None:
    after = plan.downgrade(why, stateful=stateful)
    assert after.reason is expected
    assert after.action is Action.RECOMPUTE and after.send is None
    assert (after.pull_tokens, after.expected_cached, after.direct) == (0, 0, False)
    assert (after.prefill_url, after.decode_url) == (plan.prefill_url, plan.decode_url)  # the engines stand


def test_a_decode_local_turn_downgraded_releases_the_claimed_handle_through_p() -> None:
    after = LOCAL.downgrade(Fallback.DECODE_LOCAL_FAILED, release=HANDLE)
    assert after.send == HandleUse.release(HANDLE)


@pytest.mark.parametrize(
    ("plan", "found", "expected"),
    [
        # the check's reason, where the plan from the record took D's whole sequence to match
        (PULL, _partial(HELD, Reason.RETOKENIZED), Reason.RETOKENIZED),
        (PULL, Assessment.whole(HELD), Reason.FULL_MATCH),
        # ... the policy's own stands
        (RELEASE, _partial(HELD, Reason.RETOKENIZED), Reason.CHEAPER_TO_RECOMPUTE),
    ],
)
def test_the_token_check_arriving_after_the_plan_is_kept_by_it(plan: Plan, found: Assessment, expected: Reason) -> None:
    after = plan.checked(found)
    assert (after.assessment, after.reason) == (found, expected)
    assert (after.action, after.send, after.ahead) == (plan.action, plan.send, plan.ahead)


def test_only_a_pull_planned_ahead_of_its_check_pulls_ahead() -> None:
    assert not PULL.pulls_ahead
    ahead = Plan(Action.PULL, Reason.FULL_MATCH, send=PULL.send, ahead=Ahead.CHECKED)
    assert ahead.pulls_ahead
    assert not ahead.downgrade(Fallback.PULL_FAILED).pulls_ahead  # nothing is pulled once it fell back
