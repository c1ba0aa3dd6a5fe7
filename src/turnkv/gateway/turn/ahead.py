"""AHEAD: a pull or recompute turn sent to P before its render returns; the token check still gates D.

On a pull or recompute turn the render call (the engine's ``/v1/chat/completions/render``) sat on the
critical path: render, then the token check, then P's request. Two ways to take it off were weighed:

* overlap it with what must happen before P's request anyway (the claim, picking P, connecting): that
  work takes well under a millisecond where the render takes milliseconds (7.6 ms median at 16k on
  vLLM), so the render would still lead P's request by almost all of its time;
* plan from the record and send P the prompt as messages, as plain P/D (and vLLM's multi-turn proxy) do:
  P renders it itself, and the token check, which must pass before D starts, runs on the prompt ids P
  returns (or on a render beside P's leg: ``ahead_check`` below). This one is taken (the SHORTCUT step
  decides, ``turn.shortcut``; this module runs the leg).

Only where the record already proves the history (``shortcut.proves_history``): the template keeps history, the
client echoed the last answer as D produced it, the history before it digests as stored, and the
record is usable. Then:

* **recompute** (the policy would pull nothing): nothing of D's KV is reused, so nothing needs checking;
  no render at all (``skipped``); P gets D's handle only to release it, and D the messages.
* **pull** (``checked``): P pulls D's whole sequence with the messages, before the check. vLLM (and the
  simulator) cache pulled blocks under the pulling request's token hashes, whatever they were computed
  from, so a pull the check then rejects would leave wrong KV in P's prefix cache for any later request
  with those tokens. P's request therefore carries a cache salt of its own (``turn.salt``, per turn):
  its blocks are cached where no other request looks. That also keeps P's cache out of this turn, so a
  turn whose P likely caches the conversation is rendered first as before. When the check proves at
  least what P pulled and P counted the prompt the check ran on, D continues from P's KV, given the
  messages as P was (both engines' own rendering, as in plain P/D); otherwise the turn falls back
  (``Fallback.RENDER_MISMATCH``) to plain P/D with the checked ids, unsalted, nothing reused. D never
  starts on a prefix the check did not prove. What the check runs on (``ahead_check``):

  - ``prefill`` (the default): the prompt ids P computed from, which P returns with its answer
    (``return_token_ids``, in every vLLM version). No render call at all: P renders the messages once, for
    its own prefill, as under vLLM's multi-turn proxy. The check then runs between P's answer and D's
    request: the ids' first tokens against the record's digest of its whole sequence, one call
    (``chain.proves``; the hash chain, one hash per block, only where that does not prove them), and P's answer
    carries the ids (about 1.5 ms more of P's CPU at 16k), where the render call cost P 8 ms of CPU at
    16k and 21 ms at 32k beside its pull and prefill; on the simulator that CPU lands on P's leg, since it
    renders in the event loop that runs its engine (BENCHMARKS.md §3). vLLM renders in its API server's
    thread pool, apart from the engine core, but a render sent there beside P's own render of the same
    messages competes with it. An engine that returns no ids is rendered once P has answered.
  - ``render``: a render call to the render authority (a P unless ``render`` names a service), sent once
    P's request is out (P's API server takes requests in order, and its own render of the messages, which
    its prefill waits for, must not queue behind ours), run beside P's leg; if the check does not prove
    the pull, P's leg is cancelled or its result dropped.
* a policy that checks no tokens (the ``vllm-multiturn`` and unchecked baselines) is never rendered
  once its record is usable: as vLLM's proxy, it pulls the previous handle with the messages.

Decode-local turns are the direct path's (``turn.shortcut``); turns the record does not prove are
rendered first and planned (``turn.render``, ``turn.plan``). What the check finds reaches the plan by its
own method (``TurnRun.checked``: ``Plan.checked``); a pull it does not prove falls back
(``Plan.downgrade``).
Transition: PREFILL → DECODE once the check has proved what P pulled.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from turnkv.gateway.turn import plan, prefill, render
from turnkv.gateway.turn.results import Fallback, Plan, Prefilled, Rendered
from turnkv.gateway.turn.run import STOP_WAIT_S, TurnRun
from turnkv.reuse.assess import Assessment, Reason
from turnkv.state.record import ConversationRecord


async def _stop(leg: asyncio.Future[Prefilled]) -> None:
    """Cancel P's leg and wait (bounded) until it has let go of P's request."""
    if not leg.done():
        leg.cancel()
        with anyio.move_on_after(2 * STOP_WAIT_S, shield=True):
            await asyncio.wait({leg})
    if leg.done() and not leg.cancelled():
        leg.exception()  # retrieved: its outcome no longer matters


def _check(run: TurnRun, checked: Rendered) -> Assessment | None:
    """The token check on ``checked``; the plan keeps what it found (``TurnRun.checked``). A render that
    failed on the messages ends the turn: the client hears why."""
    if checked.failure is not None:
        run.checked(checked, None)
        run.refused(checked.reason or Reason.REQUEST_REJECTED)
        raise checked.failure
    found = plan.check(run.svc, run.turn, checked, run.claimed.claim)
    run.checked(checked, found)
    return found


def _covers(p: Plan, checked: Rendered, found: Assessment | None, done: Prefilled | None) -> bool:
    """Whether the check proves the prefix P pulls, and P (if it has answered) counted the rendered prompt."""
    send, ids = p.send, checked.prompt_ids
    if send is None or ids is None or found is None or found.tokens < send.tokens:
        return False
    return done is None or done.result.prompt_tokens is None or done.result.prompt_tokens == len(ids)


async def _after_p_request(run: TurnRun, leg: asyncio.Future[Prefilled]) -> None:
    """Wait until P's request has gone out (or P's leg ended first): P's API server handles the requests
    it gets in order, and its own render of the messages must not queue behind the gateway's."""
    sent = asyncio.Event()
    run.on_prefill_sent = sent.set
    waiter: asyncio.Future[Any] = asyncio.ensure_future(sent.wait())
    first: set[asyncio.Future[Any]] = {leg, waiter}
    try:
        await run.until_aborted(asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED))
    finally:
        run.on_prefill_sent = None
        waiter.cancel()


async def prefill_checked(run: TurnRun) -> Prefilled:
    """P's leg of an ahead turn: a checked pull returns only once the token check proved what P pulled
    (on the ids P returned, or on a render beside P's leg: ``ahead_check``); otherwise the turn falls back
    to plain P/D with the checked ids."""
    record = run.claimed.record
    if record is None or not run.plan.pulls_ahead:
        return await prefill.run(run)
    if run.svc.settings.ahead_check == "prefill":
        return await _checked_on_prefill_ids(run, record)
    return await _checked_beside_render(run, record)


async def _checked_on_prefill_ids(run: TurnRun, record: ConversationRecord) -> Prefilled:
    """P pulls and prefills, and returns the prompt ids it computed from; the check runs on them before D
    starts. An engine that returns none is rendered for the check once P has answered."""
    done = await prefill.run(run)
    if not run.plan.pulls_ahead:  # P's pull failed: its leg went on without the handle
        return done
    ids = done.result.prompt_ids
    if ids is not None:
        checked = render.from_prefill(run.svc, ids, record)
    else:
        checked = await run.until_aborted(render.run(run.svc, run.turn, record))
    if _covers(run.plan, checked, _check(run, checked), done):
        return done
    run.fall_back(Fallback.RENDER_MISMATCH)  # what P pulled was not proved: none of it is used
    return await prefill.run(run)


async def _checked_beside_render(run: TurnRun, record: ConversationRecord) -> Prefilled:
    """P pulls and prefills while the render runs beside it; D waits for the check on the render's ids."""
    leg = asyncio.ensure_future(prefill.run(run))
    pending: asyncio.Future[Rendered] | None = None
    try:
        await _after_p_request(run, leg)
        pending = asyncio.ensure_future(render.run(run.svc, run.turn, record))
        checked = await run.until_aborted(pending)
        found = _check(run, checked)  # P's leg is stopped below if this raises
        if not run.plan.pulls_ahead:  # P's pull failed meanwhile: its leg went on without the handle
            return await leg
        if _covers(run.plan, checked, found, None):
            done = await leg
            if not run.plan.pulls_ahead or _covers(run.plan, checked, found, done):
                return done
        await _stop(leg)
        if run.plan.pulls_ahead:  # what P pulled was not proved: none of it is used
            run.fall_back(Fallback.RENDER_MISMATCH)
        return await prefill.run(run)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        await _stop(leg)
