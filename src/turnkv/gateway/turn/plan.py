"""PLAN: decide how much of the stored decode KV this turn reuses, and how the turn runs.

The token check (``reuse.assess``) says what may be reused and why not more; the policy says
whether pulling it pays, or whether the decode engine should prefill the turn itself. A handle
that is not pulled is handed to P with ``remote_num_tokens: 0`` so D frees its blocks at once.
Transition: PLAN → PREFILL, or → DECODE for decode-local.
"""

from __future__ import annotations

import time

from turnkv.gateway.answer import echoed_answer
from turnkv.gateway.registry import Instance
from turnkv.gateway.turn.context import TurnContext, TurnState
from turnkv.reuse.assess import (
    Assessment,
    EngineView,
    Reason,
    assess,
    release_handle,
    trim_handle,
    unpinned_reason,
)
from turnkv.reuse.cost import Action, TurnFacts, pulled_tokens
from turnkv.reuse.policies import Decision
from turnkv.state.base import ClaimStatus
from turnkv.state.record import ConversationRecord


def likely_prefill_cached(rec: ConversationRecord | None, prefill: Instance | None, block_size: int) -> int:
    """Prompt tokens the chosen P likely still caches: it computed the last prompt if it served the
    last turn; how much of that survives there is measured (``Instance.cache_factor``)."""
    if rec is None or prefill is None or prefill.url != rec.prefill_url:
        return 0
    bs = block_size
    return int((rec.prompt_tokens // bs) * bs * prefill.cache_factor) // bs * bs


def decode_cached(rec: ConversationRecord | None, matched: int, block_size: int) -> int:
    """What D's own prefix cache likely holds of the conversation: all it computed, unless its pin was
    released under memory pressure (then its freed blocks are the first to be reused)."""
    if rec is None or rec.unpinned == "pressure":
        return 0
    return (matched // block_size) * block_size


def estimates_ms(decision: Decision) -> dict[str, float]:
    """The policy's TTFT estimates per action, in ms, as the turn log shows them."""
    return {k.value: round(v * 1e3, 3) for k, v in decision.estimates.items()}


def _engine_view(ctx: TurnContext, url: str) -> EngineView | None:
    inst = ctx.svc.registry.get(url)
    return None if inst is None else EngineView(inst.routable, inst.epoch)


def _assess(ctx: TurnContext) -> Assessment | None:
    claim = ctx.claim
    if claim is None or ctx.prompt_ids is None or ctx.conversation is None:
        return None
    rec = claim.record
    s = ctx.svc.settings
    a = assess(
        claim, ctx.prompt_ids, tenant=ctx.conversation.tenant, now=time.time(),
        decode=_engine_view(ctx, rec.decode_url) if rec else None,
        echoed=echoed_answer(ctx.body.get("messages") or []), template=ctx.svc.audit.cls, block_size=s.block_size,
        prompt_chain=ctx.prompt_chain,
    )
    if rec is not None and not ctx.svc.policy.checks_tokens and a.releasable:
        # the unchecked baseline believes the handle covers the prompt, as vLLM's example proxy does
        return Assessment(rec, rec.num_tokens, True, Reason.FULL_MATCH, True)
    return a


async def run(ctx: TurnContext) -> TurnState:
    try:
        return await _plan(ctx)
    finally:
        ctx.planned_s = time.perf_counter() - ctx.started


async def _plan(ctx: TurnContext) -> TurnState:
    svc = ctx.svc
    s = svc.settings
    a = ctx.assessment = _assess(ctx)
    rec = ctx.claim.record if ctx.claim is not None and ctx.claim.status is ClaimStatus.FOUND else None
    if a is not None:
        ctx.reason = a.reason
    prefill = svc.registry.pick("prefill", prefer=rec.prefill_url if rec else None)
    decode = svc.registry.pick("decode", prefer=rec.decode_url if rec else None)
    ctx.prefill_url = prefill.url if prefill else None
    ctx.decode_url = decode.url if decode else None
    if a is None or ctx.prompt_ids is None:
        if rec is not None and rec.handle is not None and ctx.reason is Reason.RENDER_FAILED:
            ctx.handle_for_prefill = release_handle(rec.handle)
        return TurnState.PREFILL
    bs = s.block_size
    same_p = rec is not None and prefill is not None and prefill.url == rec.prefill_url
    p_cached = likely_prefill_cached(rec, prefill, bs)
    d_holds = rec is not None and decode is not None and decode.url == rec.decode_url and a.releasable
    pressed = d_holds and decode is not None and not svc.pins.room_for_local(decode)
    d_holds = d_holds and not pressed
    pullable = rec is not None and rec.handle is not None
    facts = TurnFacts(
        prompt_tokens=len(ctx.prompt_ids), reusable_tokens=a.tokens if pullable else 0,
        prefill_cached_tokens=p_cached, decode_cached_tokens=decode_cached(rec, a.tokens, bs) if d_holds else 0,
        decode_local_possible=d_holds, decode_busy=decode.busy if decode is not None else 0,
    )
    costs = svc.estimator.params()
    decision = svc.policy.decide(facts, costs)
    ctx.action = decision.action
    ctx.estimates = estimates_ms(decision)
    if decision.reason is not None:
        ctx.reason = decision.reason
    elif pressed and decision.action is Action.RECOMPUTE:
        ctx.reason = Reason.DECODE_BUSY  # D would have taken it, but is short of KV or has a queue
    elif rec is not None and not pullable and a.full and decision.action is Action.RECOMPUTE:
        ctx.reason = unpinned_reason(rec)  # D's KV matched, but its handle was given back
    ctx.expected_cached = p_cached
    if decision.action is not Action.DECODE_LOCAL and same_p and rec is not None:
        svc.registry.expect_hits(ctx.prefill_url, (rec.prompt_tokens // bs) * bs)
    if decision.action is Action.PULL and rec is not None and rec.handle is not None:
        ctx.pull_tokens = pulled_tokens(costs, facts)
        ctx.expected_cached = p_cached + ctx.pull_tokens
        ctx.handle_for_prefill = trim_handle(rec.handle, a.tokens, bs)
        return TurnState.PREFILL
    if decision.action is Action.DECODE_LOCAL and rec is not None:
        ctx.expected_cached = facts.decode_cached_tokens  # D's own cache holds the conversation
        ctx.decode_url = rec.decode_url
        return TurnState.DECODE
    if rec is not None and rec.handle is not None and a.releasable:
        ctx.handle_for_prefill = release_handle(rec.handle)  # P frees it at D on the way
    return TurnState.PREFILL
