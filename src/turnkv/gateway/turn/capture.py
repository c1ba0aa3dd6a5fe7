"""CAPTURE: after the answer, remember D's handle with the hash chain of the tokens it holds.

D's own token ids are the authority: its prompt ids and generated ids, cut to the handle's
``remote_num_tokens``. A handle that is inconsistent with them is not stored. A handle is kept
pinned only when the policy would pull it next turn, and only within D's pin budget
(``gateway.pins``); every other handle of the turn is released at once: the new one when it is not
kept, the claimed one when P did not take it (a decode-local turn supersedes it). When a turn fails
before P used the claimed handle, the record is put back, so one failure does not cost the
conversation its reuse. Ends the turn with one log event and its metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import anyio

from turnkv.errors import StoreError
from turnkv.gateway.metrics import turn_bucket
from turnkv.gateway.services import Services
from turnkv.gateway.turn.context import TurnContext
from turnkv.gateway.turn.direct import bytes_per_token, history_digest
from turnkv.gateway.turn.direct import enabled as direct_enabled
from turnkv.gateway.turn.plan import likely_prefill_cached
from turnkv.reuse.chain import ChainBuilder
from turnkv.reuse.cost import Action, TurnFacts
from turnkv.state.base import ClaimStatus
from turnkv.state.record import ConversationRecord

# the store keeps a record this long past its last usable moment, to tell "expired" from "none"
EXPIRED_GRACE_S = 120.0
FINISH_TIMEOUT_S = 5.0
log = logging.getLogger("turnkv.capture")


def _handle_ok(h: dict[str, Any] | None, seq_len: int, block_size: int) -> str | None:
    """None when the handle can be stored; otherwise why not."""
    if not h:
        return "no_handle"
    groups = h.get("remote_block_ids")
    n = h.get("remote_num_tokens")
    if not h.get("do_remote_decode") or not isinstance(groups, list) or not groups or not isinstance(n, int):
        return "not_a_decode_handle"
    if n <= 0 or n > seq_len or any(len(g) * block_size < n for g in groups if isinstance(g, list)):
        return "inconsistent_handle"
    if not all(h.get(k) is not None for k in ("remote_engine_id", "remote_request_id", "remote_host",
                                              "remote_port")):
        return "incomplete_handle"
    return None


def build_record(ctx: TurnContext) -> ConversationRecord | str:
    """The record for the next turn (holding D's handle, or none when D's answer carried none), or
    the reason there is none."""
    cap = ctx.capture
    s = ctx.svc.settings
    if ctx.conversation is None:
        return "no_session"
    if cap.error is not None or cap.finish_reason is None:
        return "failed"
    d = ctx.svc.registry.get(ctx.decode_url)
    if ctx.stream and d is not None and ctx.turn_is_stateful:
        d.stream_handles = cap.kv_transfer_params is not None  # what this engine's streams carry, as seen
    if cap.prompt_token_ids is None:
        return "no_token_ids"
    h = cap.kv_transfer_params
    unpinned = None
    if h is None:
        # the next turn can still go decode-local (D's prefix cache holds the turn), and says why not more
        if ctx.action is Action.DECODE_LOCAL:
            unpinned = "decode_local"  # D was asked for no handle (turn/decode.py)
        elif ctx.stream:
            unpinned = "no_handle_in_stream"
        else:
            return "no_handle"
        n = len(cap.prompt_token_ids) + len(cap.token_ids)
    else:
        why = _handle_ok(h, len(cap.prompt_token_ids) + len(cap.token_ids), s.block_size)
        if why is not None:
            return why
        n = int(h["remote_num_tokens"])
    prompt = cap.prompt_token_ids
    if ctx.prompt_ids is not None and prompt != ctx.prompt_ids:
        ctx.svc.metrics.render_mismatch.inc()
    if ctx.prompt_chain is not None and prompt == ctx.prompt_ids and n >= len(prompt):
        chain = ctx.prompt_chain.copy().extend(cap.token_ids[: n - len(prompt)])
    else:
        chain = ChainBuilder(s.block_size).extend((prompt + cap.token_ids)[:n])
    answer, reasoning = cap.answer.digests()
    messages = ctx.body.get("messages") or []
    # what a later direct turn is held against; not needed where no turn can be direct
    direct = direct_enabled(ctx.svc, until_audited=True)
    now = time.time()
    return ConversationRecord(
        tenant=ctx.conversation.tenant, decode_url=str(ctx.decode_url), prefill_url=ctx.prefill_url,
        handle=h, engine_id=str(h["remote_engine_id"]) if h else "", engine_epoch=d.epoch if d else None,
        num_tokens=n, chain=chain.digests(), block_size=s.block_size, prompt_tokens=len(prompt), answer_digest=answer,
        reasoning_digest=reasoning, turn=ctx.turn_index, created_at=now, expires_at=now + s.handle_ttl_s,
        history_digest=history_digest(ctx.body, messages) if direct else None,
        bytes_per_token=bytes_per_token(messages, len(prompt)) if direct else None, unpinned=unpinned,
    )


def _keeps_pin(ctx: TurnContext, rec: ConversationRecord) -> bool:
    """Whether the new handle is worth its pinned bytes until the next turn (the policy's own view of a
    next turn like this one)."""
    svc = ctx.svc
    if svc.settings.decode_memory.pin == "always":
        return True
    bs = svc.settings.block_size
    claimed = ctx.claim.record if ctx.claim is not None else None
    grown = rec.prompt_tokens - (claimed.num_tokens if claimed is not None else 0)
    new = max(bs, grown if claimed is not None else rec.prompt_tokens // 8)  # the next turn's new part, guessed
    prefill = svc.registry.get(rec.prefill_url)
    d = svc.registry.get(rec.decode_url)
    facts = TurnFacts(
        prompt_tokens=rec.num_tokens + new, reusable_tokens=rec.num_tokens,
        prefill_cached_tokens=likely_prefill_cached(rec, prefill, bs), decode_cached_tokens=(rec.num_tokens // bs) * bs,
        decode_local_possible=d is not None and svc.pins.room_for_local(d), decode_busy=d.busy if d is not None else 0,
    )
    return svc.policy.keeps_pin(facts, svc.estimator.params())


async def finish(ctx: TurnContext, *, ok: bool) -> None:
    """Store the next record (or put the claimed one back), give back every handle nobody will use,
    then account for the turn."""
    svc = ctx.svc
    conv = ctx.conversation
    rec = build_record(ctx) if ok else "failed"
    new_handle = ctx.capture.kv_transfer_params
    result: str
    if isinstance(rec, ConversationRecord) and rec.handle is not None and not _keeps_pin(ctx, rec):
        _release(svc, rec.handle, "not_needed")  # D's blocks stay in its prefix cache, evictable
        rec = dataclasses.replace(rec, handle=None, unpinned="not_needed")
    old = ctx.claim.record if ctx.claim is not None and ctx.claim.status is ClaimStatus.FOUND else None
    try:
        if isinstance(rec, ConversationRecord) and conv is not None:
            if rec.handle is not None:
                await svc.pins.make_room(rec.decode_url, rec.num_tokens)
            # a conversation found from its history moves on: stored under this request's digest
            await svc.store.put(conv.store_key, rec, svc.settings.handle_ttl_s + EXPIRED_GRACE_S)
            result = "stored" if rec.handle is not None else f"stored_{rec.unpinned}"
            if conv.store_key != conv.key and ctx.claimed:
                await svc.store.release(conv.key, owner=ctx.request_id)
        elif conv is not None and not ctx.handle_spent and old is not None and old.expires_at > time.time():
            # the turn failed before P used the handle: the conversation keeps its reuse
            await svc.store.put(conv.key, old, old.expires_at - time.time() + EXPIRED_GRACE_S)
            result, old = f"{rec}_kept_previous", None
        else:
            if conv is not None and ctx.claimed:
                await svc.store.release(conv.key, owner=ctx.request_id)
            result = str(rec)
    except StoreError:
        result = "store_unavailable"
        if isinstance(rec, ConversationRecord) and rec.handle is not None:
            _release(svc, rec.handle, "store_unavailable")  # nobody can use it: do not pin D for nothing
    kept = result == "stored"
    if not kept and new_handle and new_handle.get("do_remote_decode") and result != "store_unavailable" \
            and not result.startswith("stored_"):
        # D pinned its blocks for a next turn that will not use them (a stateless turn, a failed one, or a
        # handle that could not be kept): give the memory back now rather than after decoder_kv_blocks_ttl
        _release(svc, new_handle, "unused" if ok else "failed_turn")
    if old is not None and old.handle is not None and not ctx.handle_spent:
        # the claimed handle was not handed to P (decode-local, or the turn ended): it pins D for nothing
        _release(svc, old.handle, "superseded")
    ctx.capture_result = result
    svc.metrics.captures.labels(result if conv is not None else "no_session").inc()
    _account(ctx)


async def end(ctx: TurnContext, *, ok: bool) -> None:
    """``finish``, bounded in time, shielded from the client leaving, and never raising: the client's
    answer is complete whatever happens to the next turn's record (a failure is logged)."""
    try:
        with anyio.CancelScope(shield=True), anyio.move_on_after(FINISH_TIMEOUT_S):
            await finish(ctx, ok=ok)
    except Exception:
        log.exception("capture.failed request_id=%s", ctx.request_id)
    finally:
        ctx.svc.drain.untrack(ctx)


def _release(svc: Services, handle: dict[str, Any], why: str) -> None:
    if svc.releaser is not None and svc.settings.release_unused:
        svc.releaser.submit(handle, why)


def _account(ctx: TurnContext) -> None:
    svc = ctx.svc
    m = svc.metrics
    outcome = ctx.outcome
    a = ctx.assessment
    m.decisions.labels(outcome, ctx.action.value, ctx.reason.value).inc()
    n_prompt = len(ctx.prompt_ids) if ctx.prompt_ids is not None else (
        len(ctx.capture.prompt_token_ids) if ctx.capture.prompt_token_ids else 0)
    reused = ctx.pull_tokens
    cached = ctx.prefill_cached if ctx.prefill_cached is not None else ctx.expected_cached
    computed = max(n_prompt - cached, 0)
    m.tokens.labels("prompt").inc(n_prompt)
    m.tokens.labels("pulled").inc(reused)
    m.tokens.labels("computed").inc(computed)
    m.tokens.labels("generated").inc(len(ctx.capture.token_ids))
    ttft_ms = None
    if ctx.first_token_at is not None:
        ttft = ctx.first_token_at - ctx.started
        ttft_ms = round(ttft * 1e3, 2)
        m.ttft.labels(turn_bucket(ctx.turn_index), outcome).observe(ttft)
    conv = ctx.conversation
    svc.log.info(
        "turn", request_id=ctx.request_id, conversation=conv.log_id if conv else None, turn=ctx.turn_index,
        outcome=outcome, action=ctx.action.value, reason=ctx.reason.value,
        matched_tokens=a.tokens if a else 0, tokens_pulled=reused, tokens_cached=cached, tokens_computed=computed,
        prompt_tokens=n_prompt, generated_tokens=len(ctx.capture.token_ids), prefill=ctx.prefill_url,
        decode=ctx.decode_url, render_ms=round(ctx.render_s * 1e3, 2), planned_ms=round(ctx.planned_s * 1e3, 2),
        prefill_ms=round(ctx.prefill_s * 1e3, 2), ttft_ms=ttft_ms,
        capture=ctx.capture_result, retries=ctx.retries or None, estimates_ms=ctx.estimates or None,
        direct=ctx.direct or None,
        conversation_source=conv.source if conv else None,
    )
