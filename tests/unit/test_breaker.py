"""The store's circuit breaker as pure decisions: the time is passed in, outcomes are reported."""

from __future__ import annotations

from turnkv.state.breaker import MAX_WINDOW_CALLS, Admit, Breaker, BreakerPolicy, State, Transition

POLICY = BreakerPolicy(failures=3, span_s=0.5, ratio=0.5, window_s=10.0, min_calls=20, open_s=1.0, max_open_s=4.0)


def call(b: Breaker, now: float, *, ok: bool, kind: str = "timeout") -> Transition | None:
    admitted = b.admit(now)
    assert admitted is not Admit.SKIP, f"skipped at {now}"
    return b.succeeded(now, admitted) if ok else b.failed(now, kind, admitted)


def test_one_timeout_among_successes_is_not_an_outage() -> None:
    b = Breaker(POLICY)
    for i in range(100):
        assert call(b, i * 0.01, ok=i % 10 != 5) is None
    assert b.state is State.CLOSED and b.admit(1.0) is Admit.CALL


def test_a_stall_that_times_out_every_call_in_flight_at_once_does_not_open_it() -> None:
    # the gateway's loop starved for a moment: twenty commands time out at the same instant
    b = Breaker(POLICY)
    call(b, 0.0, ok=True)
    for _ in range(20):
        assert call(b, 5.0, ok=False) is None
    assert call(b, 5.01, ok=True) is None
    assert b.state is State.CLOSED


def test_failures_in_a_row_over_time_open_it_and_calls_are_skipped() -> None:
    b = Breaker(POLICY)
    assert call(b, 0.0, ok=False) is None
    assert call(b, 0.3, ok=False) is None
    assert call(b, 0.6, ok=False) == Transition(State.OPEN, "consecutive")
    assert b.admit(0.7) is Admit.SKIP and b.admit(1.59) is Admit.SKIP


def test_a_success_in_between_starts_the_count_again() -> None:
    b = Breaker(POLICY)
    for t in (0.0, 0.3):
        call(b, t, ok=False)
    call(b, 0.4, ok=True)
    assert call(b, 0.6, ok=False) is None and call(b, 0.7, ok=False) is None
    assert call(b, 1.2, ok=False) == Transition(State.OPEN, "consecutive")


def test_nothing_listening_opens_it_at_once() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=True)
    assert call(b, 1.0, ok=False, kind="unreachable") == Transition(State.OPEN, "unreachable")


def test_a_store_that_answers_only_now_and_then_opens_it_by_ratio() -> None:
    b = Breaker(POLICY)
    changes = [call(b, i * 0.1, ok=i % 2 == 0) for i in range(POLICY.min_calls)]
    assert changes[:-1] == [None] * (POLICY.min_calls - 1)
    assert changes[-1] == Transition(State.OPEN, "ratio")


def test_failures_older_than_the_window_do_not_count_towards_the_ratio() -> None:
    b = Breaker(POLICY)
    for i in range(10):
        call(b, i * 0.1, ok=False) if i % 3 == 0 else call(b, i * 0.1, ok=True)
    # 11 s later: the old outcomes left the window; 15 successes and 5 spread failures are 25 %
    for i in range(20):
        assert call(b, 12.0 + i * 0.1, ok=i % 4 != 0) is None
    assert b.state is State.CLOSED


def test_one_probe_after_open_s_and_its_success_closes_it() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.admit(1.0) is Admit.PROBE
    assert b.state is State.HALF_OPEN
    assert b.admit(1.0) is Admit.SKIP and b.admit(1.1) is Admit.SKIP  # the others wait for the probe's word
    assert b.succeeded(1.2, Admit.PROBE) == Transition(State.CLOSED, "probe_succeeded")
    assert b.admit(1.3) is Admit.CALL


def test_a_probe_that_succeeds_resets_the_open_time() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.admit(1.0) is Admit.PROBE
    assert b.failed(1.0, "timeout", Admit.PROBE) == Transition(State.OPEN, "probe_failed")
    assert b.admit(2.99) is Admit.SKIP and b.admit(3.0) is Admit.PROBE  # open for 2 s now
    b.succeeded(3.0, Admit.PROBE)
    call(b, 5.0, ok=False, kind="unreachable")
    assert b.admit(5.99) is Admit.SKIP and b.admit(6.0) is Admit.PROBE  # back to open_s


def test_the_open_time_doubles_on_each_failed_probe_and_stops_at_max_open_s() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=False, kind="unreachable")
    now, waits = 0.0, []
    for _ in range(4):
        wait = 0.25
        while b.admit(now + wait) is Admit.SKIP:
            wait += 0.25
        now += wait
        waits.append(wait)
        b.failed(now, "timeout", Admit.PROBE)
    assert waits == [1.0, 2.0, 4.0, 4.0]


def test_a_probe_that_ends_without_an_outcome_lets_the_next_call_probe() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.admit(1.0) is Admit.PROBE
    b.abandoned(Admit.PROBE)  # cancelled, or met a busy pool
    assert b.admit(1.0) is Admit.PROBE


def test_calls_admitted_before_it_opened_change_nothing_afterwards() -> None:
    b = Breaker(POLICY)
    late = b.admit(0.0)
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.failed(0.1, "timeout", late) is None and b.succeeded(0.2, late) is None
    assert b.state is State.OPEN and b.admit(0.5) is Admit.SKIP


def test_a_ping_answered_closes_it_at_any_time_and_resets_the_open_time() -> None:
    b = Breaker(POLICY)
    assert b.answered() is None  # closed: nothing to say
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.admit(1.0) is Admit.PROBE
    b.failed(1.0, "timeout", Admit.PROBE)  # open for 2 s now
    assert b.answered() == Transition(State.CLOSED, "ping_answered")  # long before the next probe
    assert b.admit(1.1) is Admit.CALL
    call(b, 2.0, ok=False, kind="unreachable")
    assert b.admit(2.99) is Admit.SKIP and b.admit(3.0) is Admit.PROBE  # back to open_s


def test_a_probe_in_flight_when_a_ping_closed_it_ends_as_a_call() -> None:
    b = Breaker(POLICY)
    call(b, 0.0, ok=False, kind="unreachable")
    assert b.admit(1.0) is Admit.PROBE
    assert b.answered() == Transition(State.CLOSED, "ping_answered")
    assert b.succeeded(1.1, Admit.PROBE) is None  # closed once, reported once
    assert b.state is State.CLOSED and b.admit(1.2) is Admit.CALL
    late = Breaker(POLICY)
    call(late, 0.0, ok=False, kind="unreachable")
    assert late.admit(1.0) is Admit.PROBE
    late.answered()
    # its failure counts as a closed breaker's: a timeout alone does not open it again
    assert late.failed(1.1, "timeout", Admit.PROBE) is None and late.state is State.CLOSED
    assert call(late, 1.2, ok=False, kind="unreachable") == Transition(State.OPEN, "unreachable")


def test_the_window_is_bounded() -> None:
    b = Breaker(BreakerPolicy(min_calls=10**9, window_s=10**9))
    for i in range(MAX_WINDOW_CALLS * 2):
        call(b, i * 1e-6, ok=True)
    assert len(b._window) == MAX_WINDOW_CALLS
