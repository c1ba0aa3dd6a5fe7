"""Runs one chat turn: the steps in order, each handed what it needs and its result kept, then the answer
as JSON or as a relayed stream.

Follow a request here: CLAIM (``claim.run``) → SHORTCUT (``shortcut.take``: a plan made without a render, or
the render asked for) → RENDER (``render.run``; beside the claim where no shortcut can apply:
``shortcut.way``) → PLAN (``plan.rendered``) → PREFILL (not for decode-local; for a pull planned ahead of its
render, the token check gates D: ``ahead.prefill_checked``) → DECODE (``decode.run``) → the relay
(``stream.relay``) or the JSON answer → CAPTURE (``capture.end``; for a stream, before its ``[DONE]``). A turn
with nothing to claim goes to P as plain P/D. A decode-local turn no D could take, and a decode leg that
failed before any output, run again through P as plain P/D (``TurnRun.fall_back``).
"""

from __future__ import annotations

import time

from starlette.responses import JSONResponse, Response

from turnkv.errors import UpstreamError, UpstreamUnavailable, retryable
from turnkv.gateway.services import Services
from turnkv.gateway.turn import ahead, capture, claim, decode, plan, render, report, shortcut, stream
from turnkv.gateway.turn.direct import BYTES_PER_TOKEN, TOKENS_PER_MESSAGE, text_size
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Fallback, Plan
from turnkv.gateway.turn.run import TurnRun

ANSWER_RESERVE = 2048  # answer tokens a turn reserves on D at most


async def _legs(run: TurnRun) -> None:
    """P (unless the plan is decode-local), then room on D, then D; a decode-local turn no D could take
    goes through P."""
    for _ in range(2):  # the second time as plain P/D, where decode answers or raises
        prefilled = None
        if not run.plan.decode_local:
            run.check()
            run.prefilled = prefilled = await ahead.prefill_checked(run)
        run.check()
        await _admit(run)
        opened = await decode.run(run, prefilled)
        if opened is not None:
            run.opened = opened
            return
        run.fall_back(Fallback.DECODE_LOCAL_FAILED)
    raise UpstreamUnavailable("no decode engine is available", leg="decode")


async def _prepare(run: TurnRun) -> Plan:
    """CLAIM → SHORTCUT → RENDER → PLAN: the turn's plan (the driver keeps each step's result)."""
    svc, turn = run.svc, run.turn
    way = shortcut.way(svc, turn)
    if way.plain is not None:
        return Plan.plain(way.plain)
    if way.record_first:
        run.claimed = await claim.run(svc, turn)
        taken = shortcut.take(svc, turn, run.claimed, way)
        if taken is not None:
            return taken
        run.rendered = await render.run(svc, turn, run.claimed.record)
    else:
        run.claimed, run.rendered = await render.beside(svc, turn, claim.run(svc, turn))
    run.check()
    return plan.rendered(svc, turn, run.claimed, run.rendered)


def _context_tokens(run: TurnRun) -> int:
    """The KV the turn will hold on D: its prompt (rendered, else as the plan or the messages' text
    suggest) and its answer (at most ``ANSWER_RESERVE``: D allocates as it generates)."""
    if run.rendered.prompt_ids is not None:
        prompt = len(run.rendered.prompt_ids)
    else:  # not rendered: from the text (at least what a direct plan knows D holds)
        size = text_size(run.turn.messages) if run.turn.chat else None
        digits, other = size if size is not None else (0, len(str(run.turn.body.get("prompt", ""))))
        estimate = int(digits + other / BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE * len(run.turn.messages)
        prompt = max(estimate, run.plan.expected_cached)
    return prompt + min(run.turn.max_output or ANSWER_RESERVE, ANSWER_RESERVE)


async def _admit(run: TurnRun) -> None:
    """Wait, bounded, until the decode engine the turn will most likely use has room for it
    (``gateway.decode_admission``), once per turn, just before its decode leg; held until the turn is settled
    (``capture.end``). A turn whose KV P holds goes on after ``admission_overflow_s`` (P's lease)."""
    d = decode.pick(run)
    if d is None or run.ticket is not None:
        return
    dm = run.svc.settings.decode_memory
    overflow = None if run.prefilled is None else dm.admission_overflow_s
    t0 = time.perf_counter()
    run.ticket = await run.until_aborted(
        run.svc.admission.acquire(d.url, _context_tokens(run), overflow_after_s=overflow)
    )
    run.journal.admission_s = time.perf_counter() - t0
    if run.ticket.overflowed:
        run.svc.metrics.admission_overflows.labels(d.url).inc()


async def _advance(run: TurnRun) -> None:
    run.check()
    made = await _prepare(run)
    run.planned(made)
    if made.expect_hits and made.prefill_url is not None:
        run.svc.fleet.expect_hits(made.prefill_url, made.expect_hits)
    if run.rendered.failure is not None:  # the messages themselves are wrong: the plan says why
        raise run.rendered.failure
    await _legs(run)


async def rerun(run: TurnRun) -> None:
    """Run the turn again from PREFILL, as plain P/D: the decode leg failed before any output."""
    run.retrying("turn", "rerun")
    missed = "decode_first_token_deadline" in run.journal.retries
    run.fall_back(Fallback.DECODE_DEADLINE if missed else Fallback.DECODE_FAILED)
    await _legs(run)


async def _fail(run: TurnRun) -> None:
    run.close_answer()
    await capture.end(run, ok=False)


async def run_turn(svc: Services, turn: Turn) -> Response:
    run = TurnRun(svc, turn)
    svc.drain.track(run, lambda: run.abort("shutdown"))
    try:
        try:
            await _advance(run)
        except UpstreamError as exc:
            if not (exc.leg == "decode" and retryable(exc) and not run.journal.rerun):
                raise
            await rerun(run)
    except BaseException:
        await _fail(run)
        raise
    if turn.stream:
        return stream.RelayResponse(run, rerun, report.headers(run))
    opened = run.opened
    if opened is None or opened.answer is None:  # decode returns an answer or raises
        await _fail(run)
        raise RuntimeError("the decode leg ended without an answer")
    await capture.end(run, ok=True)
    return JSONResponse(opened.answer.body, headers=report.headers(run))
