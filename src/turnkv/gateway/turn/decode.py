"""DECODE: send the turn to a decode engine, continued from P's KV, and open its answer.

D gets the client's request and what P left for it (decode-local: nothing, so D pins nothing), asked
to say its prompt's and answer's token ids when the turn belongs to a conversation, so the next turn
can be checked; an engine that takes the prompt as ids gets them, so it cannot tokenize differently (unless
P rendered the messages itself, on a pull sent ahead of its render: D then renders them too, as P did).
An unreachable or failing D before any output is replaced by the next healthy one; so is one that
does not start its answer within the first-token deadline, renewed while D is busy (``turn.deadline``;
then also relieved of pins and, after a few misses in a row, taken out of routing for a while).
Transition: DECODE → DONE (the answer is then relayed), or None for a decode-local turn no D could
take (the driver falls back to P).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from turnkv.engine.base import DecodeAnswer, DecodeCall, DecodeStream
from turnkv.errors import FirstTokenDeadline, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from turnkv.gateway.fleet import Slot
from turnkv.gateway.turn.deadline import Deadline
from turnkv.gateway.turn.results import Opened, Prefilled
from turnkv.gateway.turn.run import TurnRun
from turnkv.routing import InstanceView

DEFAULT_MAX_TOKENS = 1024  # for the deadline of a non-streamed answer that names no limit


def pick(run: TurnRun) -> InstanceView | None:
    """The decode engine for this attempt: the one the turn was planned to (or, planned to none, admitted
    to: ``driver``'s admission picks it) while it may still take it (routable, not tried, not late); else
    routing's pick, never one already tried, one that missed its first-token deadline only when no other is
    left. Picked once: a second pick could give another D than the plan's (a profile that ignores the
    conversation, ties taken in turn), where a decode-local turn cannot go, and than the admission's, whose
    room was reserved there."""
    j = run.journal
    chosen = run.plan.decode_url or (run.ticket.url if run.ticket is not None else None)
    if chosen is not None and chosen not in j.tried_decode and chosen not in j.avoid_decode:
        view = run.svc.fleet.view(chosen)
        if view is not None and view.routable:
            return view
    prefer = run.plan.decode_url if run.plan.decode_url not in j.tried_decode else None
    tried = frozenset(j.tried_decode)
    return run.svc.router.pick("decode", prefer=prefer, exclude=tried, avoid=frozenset(j.avoid_decode))


def _call(run: TurnRun, inst: InstanceView, prefilled: Prefilled | None) -> DecodeCall:
    turn, local = run.turn, run.plan.decode_local
    prompt_ids = run.rendered.prompt_ids
    return DecodeCall(
        path=turn.path,
        body=turn.body,
        stream=turn.stream,
        track=run.stateful,
        for_decode=None if local or prefilled is None else prefilled.result.for_decode,
        # the ids P computed from: none where P rendered the messages itself (a pull ahead: ``ahead``)
        prompt_ids=prompt_ids if inst.takes_prompt_ids and not run.plan.pulls_ahead else None,
        keep_token_ids=turn.return_token_ids,
        # prompt tokens this turn did not compute, for the client's usage: P's count (its own cache and the
        # pull) on a P/D turn; D's own on a decode-local one (None: D's figure stands)
        cached_tokens=None if local or prefilled is None else prefilled.result.cached_tokens,
    )


def _context(run: TurnRun) -> int:
    """The KV the turn's context holds on D (its prompt, as rendered or planned; 0: not known)."""
    ids = run.rendered.prompt_ids
    return len(ids) if ids is not None else run.plan.planned_tokens


def _timeout_s(run: TurnRun) -> float:
    """How long a non-streamed answer may take: D sends it whole, so its first token is not seen."""
    t = run.svc.settings.timeouts
    return t.decode_first_token_s + t.decode_per_token_s * (run.turn.max_output or DEFAULT_MAX_TOKENS)


async def _open(run: TurnRun, inst: InstanceView, call: DecodeCall, slot: Slot) -> Opened:
    """Send D the turn: a stream is opened (its first token is awaited by the relay, within the same
    deadline, counted from when the request went out), or a non-streamed answer read whole; either gives
    way when the turn is aborted."""
    svc, turn = run.svc, run.turn
    deadline = Deadline.decode(svc.settings.timeouts, inst.url)
    sent = asyncio.get_running_loop().time()
    pending: Awaitable[Any]
    if turn.stream:
        pending = svc.engine.open_decode(inst.url, call, turn.meta)
        wait: Deadline | None = deadline
    else:
        whole_s = _timeout_s(run)
        pending = svc.engine.decode_json(inst.url, call, turn.meta, whole_s)
        wait = Deadline("decode", inst.url, whole_s, whole_s)  # never renewed; given up on once D is lost
    try:
        result = await run.until_aborted(pending, wait, started=sent)
    except UpstreamTimeout as exc:
        if isinstance(exc, FirstTokenDeadline):
            raise
        raise FirstTokenDeadline(
            "the decode engine did not answer within its deadline", leg="decode", instance=inst.url
        ) from exc
    if isinstance(result, DecodeStream):
        return Opened(inst.url, slot, deadline, sent, stream=result)
    assert isinstance(result, DecodeAnswer), "decode answers a stream or a body"
    return Opened(inst.url, slot, deadline, sent, answer=result)


async def run(run: TurnRun, prefilled: Prefilled | None) -> Opened | None:
    svc, plan = run.svc, run.plan
    fleet = svc.fleet
    last: UpstreamError | None = None
    for _ in range(fleet.size("decode") + 1):
        inst = pick(run)
        if inst is None or (plan.decode_local and inst.url != plan.decode_url):
            break
        slot = fleet.hold(
            inst.url, local_prefill=plan.local_new_tokens if plan.decode_local else 0, kv_tokens=_context(run)
        )
        try:
            opened = await _open(run, inst, _call(run, inst, prefilled), slot)
        except UpstreamError as exc:
            slot.release()
            last = exc
            if isinstance(exc, FirstTokenDeadline):
                svc.metrics.deadline_misses.labels("decode").inc()
                fleet.missed_deadline(inst.url)
                svc.pins.urgent(inst.url)
            run.failed("decode", inst.url, exc)
            run.journal.tried_decode.add(inst.url)
            run.retrying("decode", exc.kind)
            continue
        except BaseException:
            slot.release()
            raise
        if opened.stream is None:
            slot.release()
            fleet.met_deadline(inst.url)
        return opened
    if plan.decode_local:
        return None
    raise last or UpstreamUnavailable("no decode engine is available", leg="decode")
