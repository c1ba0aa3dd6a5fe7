"""A turn in flight, as the driver holds it: the request, each step's latest result, and a journal.

The steps return their results (``results``); only the driver stores them here. Once planned, the plan
changes only by its own methods (``Plan.downgrade``, ``Plan.checked``), through ``fall_back``, ``checked``
and ``refused`` here, and ``_replan`` is the one place it is replaced. The journal is what happened along
the way (engine calls retried, the claimed handle spent, the first token's time), which steps add to as
it happens. ``abort`` ends the turn early (a shutdown past its drain): its open answer is closed, and
every wait ``until_aborted`` gives way; that wait also keeps the first-token deadlines (``deadline``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from turnkv.engine.base import Collected, DecodeStream, NothingCollected
from turnkv.errors import (
    FirstTokenDeadline,
    ShuttingDown,
    UpstreamError,
    UpstreamStatus,
    UpstreamUnavailable,
    retryable,
)
from turnkv.gateway.decode_admission import Ticket
from turnkv.gateway.services import Services
from turnkv.gateway.turn.deadline import Deadline
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Claimed, Fallback, Opened, Plan, Prefilled, Rendered
from turnkv.reuse.assess import Assessment, Reason

log = logging.getLogger("turnkv.upstream")  # ("turnkv.turn" is the turn events' own logger)
T = TypeVar("T")
STOP_WAIT_S = 1.0  # how long a leg given up on (a task of its own: ``ahead``) may take to stop


@dataclass(eq=False)
class _Wait:
    """One ``until_aborted`` wait: the task it runs in, its deadline's timer, and why it was given up on."""

    task: asyncio.Task[Any]
    deadline: Deadline | None
    started: float  # loop time the deadline counts from
    seen_from: float = 0.0  # the fleet's clock when it began: progress before it does not renew the deadline
    timer: asyncio.TimerHandle | None = None
    unwatch: Callable[[], None] | None = None  # ends the fleet's watch of the engine waited for
    why: str | None = None  # "aborted" | "deadline" | "lost" once given up on


@dataclass
class Journal:
    """What happened along the way."""

    retries: list[str] = field(default_factory=list)  # "<leg>_<why>", in order
    handle_spent: bool = False  # the claimed handle went to P: it cannot be put back
    tried_decode: set[str] = field(default_factory=set)  # decode engines that failed this leg
    avoid_decode: set[str] = field(default_factory=set)  # missed a first-token deadline: another D if any
    first_token_at: float | None = None  # when the client's first output left (streams)
    admission_s: float = 0.0  # how long the turn waited in the gateway for room on D (decode_admission)

    @property
    def rerun(self) -> bool:
        return "turn_rerun" in self.retries


def _unplanned() -> Plan:
    return Plan.plain(Reason.NO_SESSION)


@dataclass(eq=False)
class TurnRun:
    """The turn in flight: the request, the latest result of each step, the journal, the abort switch."""

    svc: Services
    turn: Turn
    journal: Journal = field(default_factory=Journal)
    claimed: Claimed = field(default_factory=Claimed)
    rendered: Rendered = field(default_factory=Rendered)  # not rendered (yet): no ids
    plan: Plan = field(default_factory=_unplanned)
    planned_s: float = 0.0  # from the turn's start to its plan: the gateway's own latency
    prefilled: Prefilled | None = None
    opened: Opened | None = None  # the last answer D opened
    aborted: str | None = None  # why the gateway ended the turn early ("shutdown")
    ticket: Ticket | None = None  # its reservation on a decode engine's KV (gateway.decode_admission)
    _waits: set[_Wait] = field(default_factory=set)  # what ``until_aborted`` waits on now
    # told once P's next request has gone out (``ahead`` starts the render after it)
    on_prefill_sent: Callable[[], object] | None = None

    @property
    def stateful(self) -> bool:
        return self.turn.conversation is not None

    @property
    def collected(self) -> Collected:
        return self.opened.collected if self.opened is not None else NothingCollected()

    @property
    def prefill_url(self) -> str | None:
        return self.prefilled.url if self.prefilled is not None else self.plan.prefill_url

    @property
    def decode_url(self) -> str | None:
        return self.opened.url if self.opened is not None else self.plan.decode_url

    # -- the plan: made once, then changed only by its own methods ------------------------------------
    def planned(self, plan: Plan) -> None:
        """The turn's plan, as made (PLAN, or SHORTCUT without a render)."""
        self.plan = plan
        self.planned_s = time.perf_counter() - self.turn.started

    def fall_back(self, why: Fallback) -> Plan:
        """Run the rest of the turn as plain P/D without the stored handle (``Plan.downgrade``), and say so."""
        release = None
        if why.leg == "prefill":
            self.retrying("prefill", why.why)
        elif why is Fallback.DECODE_LOCAL_FAILED:
            self.journal.retries.append(why.why)
            rec = self.claimed.record
            release = rec.handle if rec is not None else None  # P frees it on the way
        if why.leg == "decode":
            self.journal.tried_decode.clear()
        return self._replan(self.plan.downgrade(why, stateful=self.stateful, release=release))

    def checked(self, rendered: Rendered, found: Assessment | None) -> None:
        """The token check of a turn planned ahead of its render ran on ``rendered`` and found ``found``."""
        self.rendered = rendered
        if found is not None:
            self._replan(self.plan.checked(found))

    def refused(self, reason: Reason) -> None:
        """The messages were refused after the turn was planned (a render ahead of the check failed on them):
        the turn ends, and says why."""
        self._replan(self.plan.downgrade(reason))

    def _replan(self, plan: Plan) -> Plan:
        self.plan = plan  # the one place a plan is replaced once made
        return plan

    # -- the journal -------------------------------------------------------------------------------
    def retrying(self, leg: str, why: str) -> None:
        self.svc.metrics.retries.labels(leg, why).inc()
        self.journal.retries.append(f"{leg}_{why}")

    def failed(self, leg: str, url: str, exc: UpstreamError) -> None:
        """Count and log an engine call's failure; raise it again when no other attempt can help."""
        self.svc.metrics.upstream_error(leg, exc.kind, exc.instance or url)
        log.warning(
            "upstream.failed leg=%s instance=%s kind=%s status=%s message=%s",
            leg,
            exc.instance or url,
            exc.kind,
            exc.upstream_status if isinstance(exc, UpstreamStatus) else None,
            exc.message,
        )
        if not retryable(exc):
            raise exc
        if isinstance(exc, UpstreamUnavailable):
            self.svc.fleet.mark_failed(url)

    # -- ending it early ---------------------------------------------------------------------------
    def abort(self, why: str) -> None:
        """End the turn early: its decode answer is closed (D aborts the request) and its steps stop."""
        self.aborted = why
        for wait in list(self._waits):
            if wait.why is None:
                wait.why = "aborted"
                wait.task.cancel()  # the call ends, and its wait says ShuttingDown
        if self.opened is not None and self.opened.stream is not None:
            self.opened.stream.abort()

    def check(self) -> None:
        if self.aborted is not None:
            raise ShuttingDown("the gateway is shutting down; send the turn again")

    async def until_aborted(
        self,
        call: Awaitable[T],
        deadline: Deadline | None = None,
        *,
        started: float | None = None,
        then: Callable[[], object] | None = None,
    ) -> T:
        """``call``, unless the turn is aborted (``ShuttingDown``) or ``deadline`` passes first, counted from
        ``started`` (a loop time; default now) and renewed while the engine is busy (``FirstTokenDeadline``).
        A call given up on is cancelled, and has ended when this raises (it runs in this task: no task of
        its own, no second task waiting beside it); an answer it opened as it was given up on is closed.
        A cancellation from outside (the client left) stays one. ``then`` is called once the call has taken
        its first step (a request it sends is out)."""
        if self.aborted is not None:
            if inspect.iscoroutine(call):
                call.close()
            self.check()
        task = asyncio.current_task()
        assert task is not None, "a turn runs in a task"
        loop = asyncio.get_running_loop()
        fleet = self.svc.fleet
        wait = _Wait(task, deadline, loop.time() if started is None else started, fleet.now())
        if deadline is not None:
            wait.seen_from -= loop.time() - wait.started  # counted from ``started``, as the deadline is
            wait.timer = loop.call_at(wait.started + deadline.first_s, self._deadline_passed, wait)
            wait.unwatch = fleet.watch(deadline.url, lambda: self._engine_lost(wait))
        self._waits.add(wait)
        if then is not None:
            loop.call_soon(then)  # after the call's first step, which runs before this task's next one
        try:
            result = await call
        except asyncio.CancelledError:
            if wait.why is None or task.uncancel() > 0:
                raise  # not ours, or cancelled from outside too: not ours to turn into an answer
            raise self._given_up(wait) from None
        except Exception:
            if wait.why is not None:
                task.uncancel()  # the call took our cancellation and ended with an error of its own
            raise
        finally:
            self._waits.discard(wait)
            if wait.timer is not None:
                wait.timer.cancel()
            if wait.unwatch is not None:
                wait.unwatch()
        if wait.why is not None:  # given up on, but the call took the cancellation itself and returned
            if task.uncancel() > 0:
                _close_answer(result)
                raise asyncio.CancelledError
            if wait.why == "aborted":
                _close_answer(result)
                raise self._given_up(wait)
        return result

    def _deadline_passed(self, wait: _Wait) -> None:
        """The first-token deadline passed: renewed while the engine is busy, else the call is given up on."""
        deadline = wait.deadline
        assert deadline is not None, "a timer is armed only with a deadline"
        now = asyncio.get_running_loop().time()
        if wait.why is not None:
            return
        fleet = self.svc.fleet
        since = max(wait.seen_from, fleet.now() - deadline.first_s)
        if deadline.renews(fleet.view(deadline.url), wait.started, now, since):
            self.svc.metrics.deadline_renewals.labels(deadline.leg).inc()  # busy, not stuck: wait on
            wait.timer = asyncio.get_running_loop().call_at(now + deadline.first_s, self._deadline_passed, wait)
            return
        wait.why = "deadline"
        wait.task.cancel()

    def _engine_lost(self, wait: _Wait) -> None:
        """The engine waited for failed its health probes again: the call is given up on unless the engine
        computed something since it stopped answering, or since the wait began."""
        deadline, fleet = wait.deadline, self.svc.fleet
        assert deadline is not None, "only a wait with a deadline watches its engine"
        if wait.why is None and deadline.lost(fleet.view(deadline.url), fleet.lost_since(deadline.url), wait.seen_from):
            wait.why = "lost"
            wait.task.cancel()

    def _given_up(self, wait: _Wait) -> Exception:
        if wait.why == "aborted":
            return ShuttingDown("the gateway is shutting down; send the turn again")
        deadline = wait.deadline
        assert deadline is not None, "only a wait with a deadline misses it"
        what = "stopped answering its health checks" if wait.why == "lost" else "missed its first-token deadline"
        return FirstTokenDeadline(f"the {deadline.leg} engine {what}", leg=deadline.leg, instance=deadline.url)

    def close_answer(self) -> None:
        """Give D's answer up and its in-flight place back: its connection back to the pool when it was read
        to its end, else closed, which makes D abort the request."""
        opened = self.opened
        if opened is not None:
            if opened.stream is not None:
                opened.stream.close()
            opened.slot.release()


def _close_answer(result: object) -> None:
    """A call given up on may still have opened an answer: close it (the engine aborts the request)."""
    if isinstance(result, DecodeStream):
        result.abort()
