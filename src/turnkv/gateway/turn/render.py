"""RENDER: turn the messages into the exact token ids the engines will see, and claim the record.

Both run at once. The engine's own render (or a render service) is the authority for tokenization. A
render the client caused to fail is the client's error; a render the engine failed (or a store that
failed, or was too busy to answer: ``store_busy``) only costs this turn its reuse.
Where the template keeps history, the record is read first, and a turn the planner sends to D as
decode-local without a render (``plan.direct``) skips it; so does a first turn (no assistant message) with
no stored record: there is nothing of D's to check it against. A pull or recompute turn the record proves is
planned from it (``plan.ahead``) and goes to P at once; a pull's token check then runs on the ids P returns
(``from_prefill``), or on a render beside P's leg (``checked``; ``turn.ahead`` says which).
Transition: RENDER → PLAN, or → PREFILL with the client's messages (no conversation, or degraded), or →
DECODE (decode-local without a render), or → AHEAD (P first, the render beside it); a render that failed the
turn says so (``failure``) with the record it claimed, which the driver puts back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from array import array

from turnkv.errors import ClientError, StoreBusy, StoreError, UpstreamError, UpstreamStatus
from turnkv.gateway.services import Services
from turnkv.gateway.turn import direct, plan
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Next, Plan, Rendered
from turnkv.openai.answer import last_assistant
from turnkv.reuse.assess import Reason
from turnkv.reuse.chain import ChainBuilder, proves
from turnkv.state.base import Claim, ClaimStatus


async def _render(svc: Services, turn: Turn) -> list[int]:
    return await svc.engine.render(svc.render_base(), turn.body, turn.meta)


async def _claim(svc: Services, turn: Turn) -> tuple[Claim | None, Reason]:
    """The conversation's record, claimed, and why the turn reuses nothing as far as the claim can tell:
    ``no_session`` when claimed (PLAN says why, from the record); otherwise ``store_busy`` (every store
    connection stayed busy: load, this call only) or ``store_unavailable`` (the store failed)."""
    assert turn.conversation is not None, "only a conversation's turn claims a record"
    try:
        return await svc.store.claim(turn.conversation.key, owner=turn.request_id), Reason.NO_SESSION
    except StoreBusy:
        return None, Reason.STORE_BUSY
    except StoreError:
        return None, Reason.STORE_UNAVAILABLE


def _claimed(claim: Claim | None) -> bool:
    return claim is not None and claim.status in (ClaimStatus.FOUND, ClaimStatus.CORRUPT)


async def run(svc: Services, turn: Turn) -> Rendered:
    if turn.conversation is None:
        return Rendered(Next.PREFILL, Reason.NO_SESSION)
    if turn.n != 1:
        return Rendered(Next.PREFILL, Reason.UNSUPPORTED_REQUEST)
    t0 = time.perf_counter()
    rendered: list[int] | BaseException
    first = last_assistant(turn.messages) is None
    cand = None if first else direct.candidate(svc, turn)
    early = not first and plan.ahead_possible(svc, turn)
    if first or cand is not None or early:
        # the record first: a decode-local turn it allows needs no render at all, nor does a
        # conversation's first turn when nothing is stored (nothing of D's to check it against); a pull or
        # recompute turn it proves goes to P at once, its render (if any) beside P's leg
        claim, why = await _claim(svc, turn)
        if claim is not None and cand is not None:
            local = plan.direct(svc, turn, claim, cand)
            if local is not None:
                return _from_record(Next.DECODE, local, claim, t0)
        if first and (claim is None or claim.status is ClaimStatus.MISSING):
            # P and D render the messages themselves, as in plain P/D; or D alone, where P's queue makes
            # that the faster (``plan.first``)
            local = plan.first(svc, turn) if claim is not None else None
            if local is not None:
                return _from_record(Next.DECODE, local, claim, t0)
            reason = Reason.NO_RECORD if claim is not None else why
            return Rendered(Next.PREFILL, reason, claim=claim, claimed=_claimed(claim))
        planned = plan.ahead(svc, turn, claim) if early and claim is not None else None
        if planned is not None:
            return _from_record(Next.AHEAD, planned, claim, t0)
        try:
            rendered = await _render(svc, turn)
        except Exception as exc:  # judged below, as when both run side by side
            rendered = exc
    else:
        rendered, claimed = await asyncio.gather(_render(svc, turn), _claim(svc, turn), return_exceptions=True)
        if isinstance(claimed, BaseException):
            raise claimed
        claim, why = claimed
    return _judged(svc, rendered, claim, why, time.perf_counter() - t0)


def _from_record(nxt: Next, planned: Plan, claim: Claim | None, t0: float) -> Rendered:
    """A turn planned from its record without a render: decode-local (``plan.direct``) or ahead of it."""
    return Rendered(
        nxt, planned.reason, claim=claim, claimed=_claimed(claim), seconds=time.perf_counter() - t0, direct=planned
    )


async def checked(svc: Services, turn: Turn, claim: Claim) -> Rendered:
    """The render of a turn already sent to P ahead of it, judged as any render (``turn.ahead`` checks it)."""
    t0 = time.perf_counter()
    rendered: list[int] | BaseException
    try:
        rendered = await _render(svc, turn)
    except Exception as exc:
        rendered = exc
    return _judged(svc, rendered, claim, Reason.NO_SESSION, time.perf_counter() - t0)


def from_prefill(svc: Services, ids: list[int], claim: Claim) -> Rendered:
    """The prompt ids P returned with its answer (``return_token_ids``), judged as a render's: P rendered the
    messages itself, as the render call would have (``turn.ahead`` checks them before D starts)."""
    t0 = time.perf_counter()
    judged = _judged(svc, ids, claim, Reason.NO_SESSION, 0.0, leg="prefill")
    return dataclasses.replace(judged, seconds=time.perf_counter() - t0)


def _judged(
    svc: Services,
    rendered: list[int] | BaseException,
    claim: Claim | None,
    why: Reason,
    seconds: float,
    *,
    leg: str = "render",
) -> Rendered:
    failed = Rendered(Next.PLAN, Reason.RENDER_FAILED, claim=claim, claimed=_claimed(claim), seconds=seconds)
    if isinstance(rendered, ClientError) or (
        isinstance(rendered, UpstreamStatus) and 400 <= rendered.upstream_status < 500
    ):
        # the messages themselves are wrong: the client hears the engine's words
        return dataclasses.replace(failed, reason=Reason.REQUEST_REJECTED, failure=rendered)
    if isinstance(rendered, UpstreamError):
        svc.metrics.upstream_error("render", rendered.kind, rendered.instance)
        return failed
    if isinstance(rendered, BaseException):
        return dataclasses.replace(failed, failure=rendered)
    record = claim.record if claim is not None else None
    # the usual later turn: the ids start with the record's whole sequence, proved by its digest in one
    # call; the chain (one hash per block) is then built by CAPTURE, after D has started
    proved_tokens = (
        record.num_tokens if record is not None and proves(record.tokens_digest, record.num_tokens, rendered) else 0
    )
    try:
        if proved_tokens:
            array("q", rendered[proved_tokens:])  # the rest are 64-bit ints too (the digest says the first are)
            chain = None
        else:
            chain = ChainBuilder(svc.settings.block_size).extend(rendered)
    except (TypeError, OverflowError):  # ids that are not integers
        svc.metrics.upstream_error(leg, "protocol", None)
        return failed
    return Rendered(
        Next.PLAN,
        why,
        prompt_ids=rendered,
        chain=chain,
        proved=proved_tokens > 0,
        claim=claim,
        claimed=_claimed(claim),
        seconds=seconds,
    )
