"""Runs one chat turn: the steps in order, then the answer as JSON or as a relayed stream.

Follow a request here: ``render.run`` → ``plan.run`` → ``prefill.run`` → ``decode.run``, then
``stream.relay`` (streaming) or the JSON path below, and ``capture.end`` at the end of both (for a
stream, before its ``[DONE]``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse, Response

from turnkv.errors import GatewayError, ShuttingDown, UpstreamError, retryable
from turnkv.gateway.turn import capture, decode, plan, prefill, render, stream
from turnkv.gateway.turn.context import TurnContext, TurnState
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action

STEPS: dict[TurnState, Callable[[TurnContext], Awaitable[TurnState]]] = {
    TurnState.RENDER: render.run,
    TurnState.PLAN: plan.run,
    TurnState.PREFILL: prefill.run,
    TurnState.DECODE: decode.run,
}


async def advance(ctx: TurnContext) -> None:
    while ctx.state is not TurnState.DONE:
        if ctx.aborted is not None:
            raise ShuttingDown("the gateway is shutting down; send the turn again")
        ctx.state = await STEPS[ctx.state](ctx)


async def rerun_without_handle(ctx: TurnContext) -> None:
    """Run the turn again from PREFILL, as plain P/D: the decode leg failed before any output."""
    ctx.retrying("turn", "rerun")
    if ctx.action in (Action.PULL, Action.DECODE_LOCAL):
        ctx.action = Action.RECOMPUTE
    if ctx.conversation is not None:  # what the turn planned did not happen: say why it ran as plain P/D
        missed = "decode_first_token_deadline" in ctx.retries
        ctx.reason = Reason.FIRST_TOKEN_DEADLINE if missed else Reason.DECODE_FAILED
    ctx.handle_for_prefill, ctx.pull_tokens, ctx.prefill_params = None, 0, None
    ctx.expected_cached, ctx.direct = 0, False
    ctx.tried_decode.clear()
    ctx.state = TurnState.PREFILL
    await advance(ctx)


async def _fail(ctx: TurnContext) -> None:
    stream.close(ctx)
    await capture.end(ctx, ok=False)


def _headers(ctx: TurnContext) -> dict[str, str]:
    """The turn's decision, for clients and benchmarks that want to see it. Token counts and prefill time
    tell a client about the engines' caches (README, Security and limits): only with decision_headers full."""
    h = {"x-request-id": ctx.request_id, "x-turnkv-outcome": ctx.outcome, "x-turnkv-action": ctx.action.value,
         "x-turnkv-reason": ctx.reason.value}
    if ctx.direct:
        h["x-turnkv-direct"] = "true"  # decode-local without a render call (turn/direct.py)
    if ctx.svc.settings.decision_headers != "full":
        return h
    if ctx.assessment is not None:
        h["x-turnkv-matched-tokens"] = str(ctx.assessment.tokens)
    if ctx.prompt_ids is not None:
        h["x-turnkv-prompt-tokens"] = str(len(ctx.prompt_ids))
    elif isinstance(ctx.prefill_prompt_tokens, int):
        h["x-turnkv-prompt-tokens"] = str(ctx.prefill_prompt_tokens)  # not rendered: P's count
    h["x-turnkv-pulled-tokens"] = str(ctx.pull_tokens)
    if ctx.prefill_cached is not None:
        h["x-turnkv-prefill-cached-tokens"] = str(ctx.prefill_cached)
    if ctx.prefill_url is not None and ctx.action is not Action.DECODE_LOCAL:
        h["x-turnkv-prefill-ms"] = f"{ctx.prefill_s * 1e3:.1f}"
    return h


async def run_turn(ctx: TurnContext) -> Response:
    try:
        try:
            await advance(ctx)
        except UpstreamError as exc:
            if not (exc.leg == "decode" and retryable(exc) and "turn_rerun" not in ctx.retries):
                raise
            await rerun_without_handle(ctx)
    except BaseException:
        await _fail(ctx)
        raise
    if ctx.stream:
        return stream.RelayResponse(ctx, rerun_without_handle, _headers(ctx))
    if ctx.decode_answer is None:  # no decode answer: nothing to send
        await _fail(ctx)
        raise GatewayError("the turn ended without an answer")
    body = ctx.decode_answer.body
    await capture.end(ctx, ok=True)
    return JSONResponse(body, headers=_headers(ctx))
