"""RENDER: turn the messages into the exact token ids the engines will see, and claim the record.

Both run at once. The engine's own ``/v1/chat/completions/render`` (or a render service) is the
authority for tokenization. A render the client caused to fail is the client's error; a render
the engine failed (or a store that failed) only costs this turn its reuse.
Where the template keeps history, the record is read first, and a turn ``turn.direct`` sends to D as
decode-local skips the render; so does a first turn (no assistant message) with no stored record.
Transition: RENDER → PLAN, or → PREFILL with the client's messages (no conversation, or degraded),
or → DECODE (decode-local without a render).
"""

from __future__ import annotations

import asyncio
import time

from turnkv.errors import ClientError, StoreBusy, StoreError, UpstreamError, UpstreamStatus
from turnkv.gateway.turn import direct
from turnkv.gateway.turn.context import TurnContext, TurnState
from turnkv.reuse.assess import Reason
from turnkv.reuse.chain import ChainBuilder
from turnkv.state.base import Claim, ClaimStatus

_NOT_FOR_RENDER = ("stream", "stream_options", "kv_transfer_params", "max_tokens", "max_completion_tokens",
                   "min_tokens", "n")


async def _render(ctx: TurnContext) -> list[int]:
    svc = ctx.svc
    base = svc.settings.render
    if base is None:
        inst = svc.registry.pick("prefill")
        if inst is None:
            raise ClientError("no prefill engine is configured")
        base = inst.url
    body = {k: v for k, v in ctx.body.items() if k not in _NOT_FOR_RENDER}
    data = await svc.upstream.post_json("render", base, "/v1/chat/completions/render", body, ctx.headers())
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise UpstreamStatus(502, {"error": {"message": "render returned no token ids"}}, leg="render",
                             instance=base)
    return ids  # each id is checked to be an int when the chain is built (array("q") refuses others)


def _no_store(ctx: TurnContext) -> Reason:
    return Reason.STORE_BUSY if ctx.store_busy else Reason.STORE_UNAVAILABLE


async def _claim(ctx: TurnContext) -> Claim | None:
    assert ctx.conversation is not None
    try:
        claim = await ctx.svc.store.claim(ctx.conversation.key, owner=ctx.request_id)
    except StoreBusy:
        ctx.store_busy = True
        return None
    except StoreError:
        return None
    ctx.claimed = claim.status in (ClaimStatus.FOUND, ClaimStatus.CORRUPT)
    return claim


async def run(ctx: TurnContext) -> TurnState:
    if ctx.conversation is None:
        ctx.reason = Reason.NO_SESSION
        return TurnState.PREFILL
    if (ctx.body.get("n") or 1) != 1:
        ctx.reason = Reason.UNSUPPORTED_REQUEST
        return TurnState.PREFILL
    t0 = time.perf_counter()
    rendered: list[int] | BaseException
    first = direct.last_assistant(ctx.body.get("messages") or []) is None
    cand = None if first else direct.candidate(ctx)
    if first or cand is not None:
        # the record first: a decode-local turn it allows needs no render at all, nor does a
        # conversation's first turn when nothing is stored (nothing of D's to check it against)
        claim = ctx.claim = await _claim(ctx)
        if claim is not None and cand is not None and direct.try_direct(ctx, claim, cand):
            ctx.render_s = time.perf_counter() - t0
            return TurnState.DECODE
        if first and (claim is None or claim.status is ClaimStatus.MISSING):
            ctx.reason = Reason.NO_RECORD if claim is not None else _no_store(ctx)
            return TurnState.PREFILL  # P and D render the messages themselves, as in plain P/D
        try:
            rendered = await _render(ctx)
        except Exception as exc:  # judged below, as when both run side by side
            rendered = exc
    else:
        rendered, claimed = await asyncio.gather(_render(ctx), _claim(ctx), return_exceptions=True)
        if isinstance(claimed, BaseException):
            raise claimed
        claim = ctx.claim = claimed
    ctx.render_s = time.perf_counter() - t0
    if isinstance(rendered, UpstreamStatus) and 400 <= rendered.upstream_status < 500:
        raise rendered  # the messages themselves are wrong: the client hears the engine's words
    if isinstance(rendered, UpstreamError):
        ctx.svc.metrics.upstream_errors.labels("render", rendered.kind).inc()
        ctx.reason = Reason.RENDER_FAILED
        return TurnState.PLAN
    if isinstance(rendered, BaseException):
        raise rendered
    try:
        ctx.prompt_chain = ChainBuilder(ctx.svc.settings.block_size).extend(rendered)
    except (TypeError, OverflowError):
        ctx.svc.metrics.upstream_errors.labels("render", "protocol").inc()
        ctx.reason = Reason.RENDER_FAILED
        return TurnState.PLAN
    ctx.prompt_ids = rendered
    if claim is None:
        ctx.reason = _no_store(ctx)
    return TurnState.PLAN
