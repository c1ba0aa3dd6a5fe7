"""DECODE: send the turn to a decode engine with P's handle, and open its answer.

D gets the client's request, P's ``kv_transfer_params`` (or, decode-local, a marker that makes a
bidirectional D hand back a handle), and ``return_token_ids`` so the next turn can be checked.
On vLLM >= 0.32 it also gets the prompt ids themselves, so D cannot tokenize differently from P.
An unreachable or failing D before any output is replaced by the next healthy one.
Transition: DECODE → DONE (the answer is then relayed), or → PREFILL when decode-local failed.
"""

from __future__ import annotations

from typing import Any

from turnkv.errors import UpstreamError, UpstreamUnavailable
from turnkv.gateway.sse import DecodeCapture
from turnkv.gateway.turn.context import TurnContext, TurnState
from turnkv.reuse.assess import release_handle
from turnkv.reuse.cost import Action
from turnkv.state.base import ClaimStatus

# Any non-empty params mark a request as D-side: with bidirectional KV on, D pins its blocks
# after the answer and returns its own handle, which is what decode-local needs for the next turn.
DECODE_LOCAL_PARAMS = {"do_remote_prefill": False, "do_remote_decode": False}


def decode_body(ctx: TurnContext, prompt_ids_ok: bool) -> dict[str, Any]:
    body = dict(ctx.body)
    body["stream"] = ctx.stream
    if ctx.conversation is not None:
        body["return_token_ids"] = True
    params: dict[str, Any] | None
    if ctx.action is Action.DECODE_LOCAL:
        params = dict(DECODE_LOCAL_PARAMS)
    else:
        params = dict(ctx.prefill_params) if ctx.prefill_params else None
    if params is not None and ctx.prompt_ids is not None and prompt_ids_ok:
        params["prompt_token_ids"] = ctx.prompt_ids
    if params is not None:
        body["kv_transfer_params"] = params
    return body


async def run(ctx: TurnContext) -> TurnState:
    svc = ctx.svc
    attempts = len(svc.registry.role("decode")) + 1
    last: UpstreamError | None = None
    for _ in range(attempts):
        prefer = ctx.decode_url if ctx.decode_url not in ctx.tried_decode else None
        inst = svc.registry.pick("decode", prefer=prefer, exclude=frozenset(ctx.tried_decode))
        if inst is None or (ctx.action is Action.DECODE_LOCAL and inst.url != ctx.decode_url):
            break
        body = decode_body(ctx, svc.registry.supports_prompt_token_ids(inst))
        ctx.decode_done = False
        ctx.capture = DecodeCapture(keep_token_ids=bool(ctx.body.get("return_token_ids")),
                                    collect=ctx.conversation is not None)
        inst.in_flight += 1
        try:
            if ctx.stream:
                ctx.decode_response = await svc.upstream.open_stream("decode", inst.url, ctx.path, body,
                                                                     ctx.headers())
            else:
                ctx.decode_body = await svc.upstream.post_json("decode", inst.url, ctx.path, body, ctx.headers())
                inst.in_flight -= 1
        except UpstreamError as exc:
            inst.in_flight -= 1
            last = exc
            ctx.failed("decode", inst.url, exc)
            ctx.tried_decode.add(inst.url)
            ctx.retrying("decode", exc.kind)
            continue
        ctx.decode_url = inst.url
        return TurnState.DONE
    if ctx.action is Action.DECODE_LOCAL:
        return fall_back_from_decode_local(ctx)
    raise last or UpstreamUnavailable("no decode engine is available", leg="decode")


def fall_back_from_decode_local(ctx: TurnContext) -> TurnState:
    """The decode engine holding the conversation failed: run the turn through P after all."""
    ctx.action = Action.RECOMPUTE
    ctx.retries.append("decode_local_failed")
    ctx.tried_decode.clear()
    ctx.expected_cached, ctx.direct = 0, False  # P computes what its own cache lacks
    claim = ctx.claim
    if claim is not None and claim.status is ClaimStatus.FOUND and claim.record is not None:
        ctx.handle_for_prefill = release_handle(claim.record.handle)
    return TurnState.PREFILL
