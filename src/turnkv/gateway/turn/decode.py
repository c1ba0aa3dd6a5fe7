"""DECODE: send the turn to a decode engine with P's handle, and open its answer.

D gets the client's request, P's ``kv_transfer_params`` (decode-local: none, so D pins nothing), and
``return_token_ids`` so the next turn can be checked.
On vLLM >= 0.32 it also gets the prompt ids themselves, so D cannot tokenize differently from P.
An unreachable or failing D before any output is replaced by the next healthy one; so is one that
does not start its answer within the first-token deadline (then also relieved of pins and, after a
few misses in a row, taken out of routing for a while).
Transition: DECODE → DONE (the answer is then relayed), or → PREFILL when decode-local failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import aiohttp

from turnkv.errors import FirstTokenDeadline, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from turnkv.gateway.registry import Instance
from turnkv.gateway.sse import DecodeCapture
from turnkv.gateway.turn.context import Deadline, TurnContext, TurnState, until_aborted
from turnkv.reuse.assess import release_handle
from turnkv.reuse.cost import Action
from turnkv.state.base import ClaimStatus

DEFAULT_MAX_TOKENS = 1024  # for the deadline of a non-streamed answer that names no limit


def decode_body(ctx: TurnContext, prompt_ids_ok: bool) -> dict[str, Any]:
    body = dict(ctx.body)
    body["stream"] = ctx.stream
    if ctx.conversation is not None:
        body["return_token_ids"] = True
    # A decode-local turn goes without params: vLLM (0.26-0.33) pins the blocks of a request whose params
    # set neither do_remote_prefill nor do_remote_decode but never tracks the pin, so no release or TTL
    # frees it until D restarts. Without params D pins nothing; its prefix cache still holds the turn.
    params = dict(ctx.prefill_params) if ctx.prefill_params and ctx.action is not Action.DECODE_LOCAL else None
    if params is not None and ctx.prompt_ids is not None and prompt_ids_ok:
        params["prompt_token_ids"] = ctx.prompt_ids
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _pick(ctx: TurnContext) -> Instance | None:
    """The decode engine for this attempt: the planned one unless it failed; never one already tried;
    one that missed its first-token deadline only when no other is left."""
    reg = ctx.svc.registry
    prefer = ctx.decode_url if ctx.decode_url not in ctx.tried_decode else None
    tried = frozenset(ctx.tried_decode)
    inst = reg.pick("decode", prefer=prefer, exclude=tried | ctx.avoid_decode)
    return inst or reg.pick("decode", prefer=prefer, exclude=tried)


def _timeout_s(ctx: TurnContext) -> float:
    """How long a non-streamed answer may take: D sends it whole, so its first token is not seen."""
    t = ctx.svc.settings.timeouts
    b = ctx.body
    limit = b.get("max_completion_tokens") or b.get("max_tokens") or DEFAULT_MAX_TOKENS
    return t.decode_first_token_s + t.decode_per_token_s * int(limit)


async def _open(ctx: TurnContext, inst: Instance, body: dict[str, Any]) -> None:
    """Send D the turn: a stream is opened (its first token is awaited by the relay, within the same
    deadline), or a non-streamed answer read whole; either gives way when the turn is aborted."""
    svc = ctx.svc
    t = svc.settings.timeouts
    ctx.decode_deadline = Deadline("decode", inst.url, t.decode_first_token_s, t.decode_read_s)
    ctx.decode_sent = asyncio.get_running_loop().time()
    call: Awaitable[Any]
    if ctx.stream:
        call = svc.upstream.open_stream("decode", inst.url, ctx.path, body, ctx.headers())
        deadline: Deadline | None = ctx.decode_deadline
    else:
        call = svc.upstream.post_json("decode", inst.url, ctx.path, body, ctx.headers(),
                                      timeout_s=_timeout_s(ctx))
        deadline = None
    try:
        result = await until_aborted(ctx, call, deadline)
    except UpstreamTimeout as exc:
        if isinstance(exc, FirstTokenDeadline):
            raise
        raise FirstTokenDeadline("the decode engine did not answer within its deadline", leg="decode",
                                 instance=inst.url) from exc
    if ctx.stream:
        assert isinstance(result, aiohttp.ClientResponse)
        ctx.decode_response = result
    else:
        assert isinstance(result, dict)
        ctx.decode_body = result


async def run(ctx: TurnContext) -> TurnState:
    svc = ctx.svc
    attempts = len(svc.registry.role("decode")) + 1
    last: UpstreamError | None = None
    for _ in range(attempts):
        inst = _pick(ctx)
        if inst is None or (ctx.action is Action.DECODE_LOCAL and inst.url != ctx.decode_url):
            break
        body = decode_body(ctx, svc.registry.supports_prompt_token_ids(inst))
        ctx.decode_done = False
        ctx.capture = DecodeCapture(keep_token_ids=bool(ctx.body.get("return_token_ids")),
                                    collect=ctx.conversation is not None, cached_tokens=_cached_tokens(ctx))
        inst.in_flight += 1
        try:
            await _open(ctx, inst, body)
        except UpstreamError as exc:
            inst.in_flight -= 1
            last = exc
            if isinstance(exc, FirstTokenDeadline):
                svc.metrics.deadline_misses.labels("decode").inc()
                svc.registry.missed_deadline(inst.url)
                svc.pins.urgent(inst.url)
            ctx.failed("decode", inst.url, exc)
            ctx.tried_decode.add(inst.url)
            ctx.retrying("decode", exc.kind)
            continue
        except BaseException:
            inst.in_flight -= 1
            raise
        if not ctx.stream:
            inst.in_flight -= 1
            svc.registry.met_deadline(inst.url)
        ctx.decode_url = inst.url
        return TurnState.DONE
    if ctx.action is Action.DECODE_LOCAL:
        return fall_back_from_decode_local(ctx)
    raise last or UpstreamUnavailable("no decode engine is available", leg="decode")


def _cached_tokens(ctx: TurnContext) -> int | None:
    """Prompt tokens this turn did not compute, for the client's usage: P's count (its own cache and the
    pull) on a P/D turn; D's own on a decode-local one (None: D's figure stands)."""
    return None if ctx.action is Action.DECODE_LOCAL else ctx.prefill_cached


def fall_back_from_decode_local(ctx: TurnContext) -> TurnState:
    """The decode engine holding the conversation failed: run the turn through P after all."""
    ctx.action = Action.RECOMPUTE
    ctx.retries.append("decode_local_failed")
    ctx.tried_decode.clear()
    ctx.expected_cached, ctx.direct = 0, False  # P computes what its own cache lacks
    claim = ctx.claim
    if claim is not None and claim.status is ClaimStatus.FOUND and claim.record is not None \
            and claim.record.handle is not None:
        ctx.handle_for_prefill = release_handle(claim.record.handle)
    return TurnState.PREFILL
