"""PREFILL: run the prompt on a prefill engine and get what D needs to continue it.

With token ids from RENDER, P gets exactly those ids; otherwise the client's request, as plain P/D sends it
(salted, for a pull sent ahead of the token check, and asked to return the prompt ids it computed from, which
that check runs on: ``turn.ahead``). A failed pull (P answers 5xx: expired handle, restarted D, broken link),
or one that stalls past the first-token deadline (renewed while P is busy: ``turn.deadline``), falls back
(``TurnRun.fall_back``) and is tried again on the same P without the handle; an unreachable or failing P is
replaced by the next healthy one, or, none being left, tried once more after ``RETRY_SAME_AFTER_S`` (a 5xx or a
failed connection, whatever the turn; not one that stalled). A wait on a P the fleet finds lost is given up
at once (``turn.deadline``). While it runs, the prefill counts in P's queue at its estimated work
(``queued_work``). Transition: PREFILL → DECODE.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from turnkv.engine.base import HandleUse, PrefillCall
from turnkv.errors import UpstreamError, UpstreamStatus, UpstreamTimeout, UpstreamUnavailable
from turnkv.gateway.services import Services
from turnkv.gateway.turn.deadline import Deadline
from turnkv.gateway.turn.direct import size_guess
from turnkv.gateway.turn.results import Fallback, Prefilled
from turnkv.gateway.turn.run import TurnRun
from turnkv.gateway.turn.salt import salted
from turnkv.reuse.cost import prefill_s, transfer_s

RETRY_SAME_AFTER_S = 0.25  # before a failed P is asked again, no other P being left


def queued_work(run: TurnRun) -> tuple[float, int]:
    """(seconds, new tokens) this prefill is expected to keep P busy: what P computes past its expected
    cache hits and the pull, and the pull itself (for P's queue, ``reuse.load``)."""
    svc, plan, prompt_ids = run.svc, run.plan, run.rendered.prompt_ids
    # not rendered: as planned from the record (its tokens and the new messages' bytes), else from the bytes
    n = len(prompt_ids) if prompt_ids is not None else plan.planned_tokens or size_guess(run.turn.messages)
    cached = min(plan.expected_cached, n)
    costs = svc.estimator.params()
    work = prefill_s(costs, n - cached, cached) + transfer_s(costs, plan.pull_tokens, svc.settings.block_size)
    return work, n - cached


@dataclass
class _Tries:
    """The prefill engines this leg gave up on, and whether a failed P was tried again (no other being left)."""

    given_up: set[str] = field(default_factory=set)
    retried_same: bool = False
    pause_s: float = 0.0  # to wait before the next attempt (the same P again)


async def run(run: TurnRun) -> Prefilled:
    svc, turn = run.svc, run.turn
    fleet = svc.fleet
    tries = _Tries()
    url = run.plan.prefill_url
    last: UpstreamError | None = None
    work_s, work_tokens = queued_work(run)
    for _ in range(fleet.size("prefill") + 2):
        tried = tries.given_up
        inst = fleet.view(url) if url and url not in tried else svc.router.pick("prefill", exclude=frozenset(tried))
        if inst is None:
            break
        if tries.pause_s:
            await run.until_aborted(asyncio.sleep(tries.pause_s))
            tries.pause_s = 0.0
        call = _call(run)
        t0 = time.perf_counter()
        run.journal.handle_spent = run.journal.handle_spent or call.handle is not None
        try:
            with fleet.busy(inst.url, work_s, work_tokens) as slot:
                sent, run.on_prefill_sent = run.on_prefill_sent, None
                result = await run.until_aborted(
                    svc.engine.prefill(inst.url, call, turn.meta),
                    Deadline.prefill(svc.settings.timeouts, inst.url),
                    then=sent,
                )
        except UpstreamError as exc:
            last = exc
            url = _after_failure(run, inst.url, exc, call.handle, tries)
            continue
        fleet.met_deadline(inst.url)
        done = Prefilled(inst.url, time.perf_counter() - t0, result, slot.served_s)
        _observe(run, done)
        return done
    raise last or UpstreamUnavailable("no prefill engine is available", leg="prefill")


def _call(run: TurnRun) -> PrefillCall:
    """P's request as the plan now says: a pull ahead of the token check is salted apart in P's cache, and
    checked on the ids P returns (``ahead``)."""
    svc, turn = run.svc, run.turn
    ahead = run.plan.pulls_ahead
    body = salted(turn.body, turn.request_id) if ahead else turn.body
    ids_back = ahead and svc.settings.ahead_check == "prefill"
    return PrefillCall(
        turn.path, body, run.rendered.prompt_ids, run.plan.send, svc.settings.timeouts.prefill_s, return_ids=ids_back
    )


def _after_failure(run: TurnRun, url: str, exc: UpstreamError, send: HandleUse | None, tries: _Tries) -> str | None:
    """The prefill on ``url`` failed: the P to try next (None: routing's pick of one not given up on); raises
    when no other attempt can help."""
    svc = run.svc
    timed_out = isinstance(exc, UpstreamTimeout)
    if timed_out:
        svc.metrics.deadline_misses.labels("prefill").inc()
        svc.fleet.missed_deadline(url)
    run.failed("prefill", url, exc)
    if send is not None and isinstance(exc, (UpstreamStatus, UpstreamTimeout)):
        # P failed or stalled on D's handle (expired, D restarted or full, link failure): again, on the same P,
        # without it. A request given up on (perhaps still in P's queue) told D nothing: vLLM notifies D only
        # once it allocates one in this form, so a release of its own tells D. One P answered did reach D, or
        # met a handle D no longer holds
        if timed_out and svc.settings.release_unused:
            svc.releaser.submit(send.handle, "prefill_failed")
        run.fall_back(Fallback.PREFILL_DEADLINE if timed_out else Fallback.PULL_FAILED)
        return url
    if isinstance(exc, UpstreamStatus) and exc.upstream_status < 500:
        raise exc  # P refused the request itself (a prompt too long for the model...): so would every P
    run.retrying("prefill", exc.kind)
    if not tries.retried_same and not timed_out and _no_other(svc, url, tries):
        # P failed (a 5xx, a refused or broken connection) and no other P is left: once more, the same, after a
        # moment (a restart, a request P dropped). One that stalled is not asked again
        tries.retried_same, tries.pause_s = True, RETRY_SAME_AFTER_S
        return url
    tries.given_up.add(url)
    return None


def _no_other(svc: Services, url: str, tries: _Tries) -> bool:
    return svc.router.pick("prefill", exclude=frozenset({*tries.given_up, url})) is None


def _observe(run: TurnRun, done: Prefilled) -> None:
    """P's time for what it computed, for the cost model's prefill estimate: the time P served it
    (``Slot.served_s``), not the call's, which counts P's queue in."""
    svc, plan = run.svc, run.plan
    svc.metrics.prefill_seconds.labels(plan.action.value).observe(done.seconds)
    prompt_ids, prompt_tokens = run.rendered.prompt_ids, done.result.prompt_tokens
    if prompt_ids is not None:
        n = len(prompt_ids)
    elif run.stateful and prompt_tokens is not None:
        n = prompt_tokens  # a first turn sent as messages: P's usage says how long it was
    else:
        return
    cached = done.result.cached_tokens if done.result.cached_tokens is not None else plan.expected_cached
    svc.estimator.observe_prefill(
        new_tokens=n - cached,
        context_tokens=cached,
        pulled_tokens=plan.pull_tokens,
        seconds=done.served_s if done.served_s is not None else done.seconds,
        block_size=svc.settings.block_size,
    )
