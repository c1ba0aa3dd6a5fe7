"""Decides when the conversation store counts as down (the circuit breaker), as pure code: the caller
passes the time and each call's outcome, and asks whether the next call may go to the store.

Closed: every call goes to the store. It opens on evidence of an outage, never on one slow command:

* a failure of kind ``unreachable``: nothing answers at the store's address (the connection was
  refused or reset, and the one reconnect too): open at once;
* ``failures`` failures in a row (no success in between) spread over at least ``span_s``: a store
  that stopped answering keeps failing, while a stall that timed out the commands in flight at one
  instant (one slow command, the gateway's own loop starved for a moment) is followed by successes;
* or at least ``ratio`` of the calls in the last ``window_s`` failed, over at least ``min_calls``
  calls, the failures again spread over ``span_s`` at least: a store that answers only now and then.

Open: calls are skipped (they fail at once, without waiting for a timeout) for ``open_s``; then one
call probes the store (half-open) while the others are still skipped. The probe's success closes
the breaker; its failure opens it again for twice as long, up to ``max_open_s``; a probe that ends
without an outcome (cancelled) lets the next call probe. An answer to a ping outside the calls (the
guard's prober) closes an open breaker as a probe's success would (``answered``); a ping without an
answer says nothing new. A busy pool (no connection free) is no
outcome at all: it says nothing about the store, and the caller reports nothing.

Memory is bounded: the window keeps at most ``MAX_WINDOW_CALLS`` outcomes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque

MAX_WINDOW_CALLS = 4096
UNREACHABLE = "unreachable"


@dataclasses.dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3
    span_s: float = 0.5
    ratio: float = 0.5
    window_s: float = 10.0
    min_calls: int = 20
    open_s: float = 1.0
    max_open_s: float = 8.0


class Admit(enum.Enum):
    CALL = "call"  # closed: go ahead
    PROBE = "probe"  # half-open: this call tells whether the store is back
    SKIP = "skip"  # open: fail at once


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclasses.dataclass(frozen=True)
class Transition:
    """A change of state, for logs and metrics: ``why`` is ``unreachable``, ``consecutive``, ``ratio``,
    ``probe_failed`` (opened), ``probe_succeeded`` or ``ping_answered`` (closed)."""

    state: State
    why: str


class Breaker:
    def __init__(self, policy: BreakerPolicy) -> None:
        self.policy = policy
        self.state = State.CLOSED
        self._open_until = 0.0
        self._open_for = policy.open_s
        self._probing = False
        self._run = 0  # failures since the last success
        self._run_since = 0.0  # when the first of them happened
        self._window: deque[tuple[float, bool]] = deque()
        self._window_failures = 0

    def admit(self, now: float) -> Admit:
        if self.state is State.CLOSED:
            return Admit.CALL
        if self._probing or now < self._open_until:
            return Admit.SKIP
        self.state = State.HALF_OPEN
        self._probing = True
        return Admit.PROBE

    def succeeded(self, now: float, admitted: Admit) -> Transition | None:
        self._run = 0
        if admitted is Admit.PROBE:
            self._probing = False
            if self.state is State.CLOSED:  # a ping's answer closed it meanwhile
                return None
            self._reset()
            return Transition(State.CLOSED, "probe_succeeded")
        if self.state is State.CLOSED:
            self._note(now, ok=True)
        return None

    def failed(self, now: float, kind: str, admitted: Admit) -> Transition | None:
        if admitted is Admit.PROBE:
            self._probing = False
            if self.state is not State.CLOSED:  # else a ping's answer closed it meanwhile: a failure as any
                self._open_for = min(self._open_for * 2, self.policy.max_open_s)
                return self._open(now, "probe_failed")
        if self.state is not State.CLOSED:
            return None  # a call admitted before the breaker opened: already counted as down
        if self._run == 0:
            self._run_since = now
        self._run += 1
        self._note(now, ok=False)
        p = self.policy
        if kind == UNREACHABLE:
            return self._open(now, UNREACHABLE)
        if self._run >= p.failures and now - self._run_since >= p.span_s:
            return self._open(now, "consecutive")
        if len(self._window) >= p.min_calls and self._window_failures >= p.ratio * len(self._window):
            first = next(t for t, ok in self._window if not ok)
            if now - first >= p.span_s:  # failures of one instant are one stall, whatever their number
                return self._open(now, "ratio")
        return None

    def answered(self) -> Transition | None:
        """A ping outside the calls got an answer: an open breaker closes. A probe still in flight ends
        with its own outcome (counted as a closed breaker's call)."""
        if self.state is State.CLOSED:
            return None
        self._reset()
        return Transition(State.CLOSED, "ping_answered")

    def abandoned(self, admitted: Admit) -> None:
        """The admitted call ended without an outcome (cancelled, or a busy pool)."""
        if admitted is Admit.PROBE:
            self._probing = False

    def _open(self, now: float, why: str) -> Transition:
        self.state = State.OPEN
        self._open_until = now + self._open_for
        self._run = 0
        self._window.clear()
        self._window_failures = 0
        return Transition(State.OPEN, why)

    def _reset(self) -> None:
        self.state = State.CLOSED
        self._open_for = self.policy.open_s
        self._run = 0
        self._window.clear()
        self._window_failures = 0

    def _note(self, now: float, *, ok: bool) -> None:
        self._window.append((now, ok))
        self._window_failures += 0 if ok else 1
        window = self._window
        while window and (now - window[0][0] > self.policy.window_s or len(window) > MAX_WINDOW_CALLS):
            _, was_ok = window.popleft()
            self._window_failures -= 0 if was_ok else 1
