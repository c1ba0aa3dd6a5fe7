"""CAPTURE: after the answer, remember D's handle with the hash chain of the tokens it holds.

D's own token ids are the authority: its prompt ids and generated ids, cut to the handle's
``remote_num_tokens``. A handle that is inconsistent with them is not stored. Also: when a turn
fails before P used the claimed handle, the record is put back, so one failure does not cost the
conversation its reuse. Ends the turn with one log event and its metrics.
"""

from __future__ import annotations

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
from turnkv.reuse.chain import ChainBuilder
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
    """The record for the next turn, or the reason there is none."""
    cap = ctx.capture
    s = ctx.svc.settings
    if ctx.conversation is None:
        return "no_session"
    if cap.error is not None or cap.finish_reason is None:
        return "failed"
    d = ctx.svc.registry.get(ctx.decode_url)
    if ctx.stream and d is not None and ctx.turn_is_stateful:
        d.stream_handles = cap.kv_transfer_params is not None  # what this engine's streams carry, as seen
    if cap.kv_transfer_params is None:
        return "no_handle_in_stream" if ctx.stream else "no_handle"
    if cap.prompt_token_ids is None:
        return "no_token_ids"
    seq_len = len(cap.prompt_token_ids) + len(cap.token_ids)
    why = _handle_ok(cap.kv_transfer_params, seq_len, s.block_size)
    if why is not None:
        return why
    h = cap.kv_transfer_params
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
        handle=h, engine_id=str(h["remote_engine_id"]), engine_epoch=d.epoch if d else None, num_tokens=n,
        chain=chain.digests(), block_size=s.block_size, prompt_tokens=len(prompt), answer_digest=answer,
        reasoning_digest=reasoning, turn=ctx.turn_index, created_at=now, expires_at=now + s.handle_ttl_s,
        history_digest=history_digest(ctx.body, messages) if direct else None,
        bytes_per_token=bytes_per_token(messages, len(prompt)) if direct else None,
    )


async def finish(ctx: TurnContext, *, ok: bool) -> None:
    """Store the next record (or put the claimed one back), then account for the turn."""
    svc = ctx.svc
    conv = ctx.conversation
    rec = build_record(ctx) if ok else "failed"
    stored = False
    d = svc.registry.get(ctx.decode_url)
    if isinstance(rec, ConversationRecord) and d is not None and d.kv_usage > svc.settings.release_above_kv_usage:
        _release(svc, rec.handle, "decode_memory")
        rec = "released_decode_memory"
    if conv is not None:
        try:
            if isinstance(rec, ConversationRecord):
                # a conversation found from its history moves on: stored under this request's digest
                await svc.store.put(conv.store_key, rec, svc.settings.handle_ttl_s + EXPIRED_GRACE_S)
                stored = True
                if conv.store_key != conv.key and ctx.claimed:
                    await svc.store.release(conv.key, owner=ctx.request_id)
            elif not ctx.handle_spent and ctx.claim is not None and ctx.claim.status is ClaimStatus.FOUND \
                    and ctx.claim.record is not None and ctx.claim.record.expires_at > time.time():
                old = ctx.claim.record
                await svc.store.put(conv.key, old, old.expires_at - time.time() + EXPIRED_GRACE_S)
                rec = f"{rec}_kept_previous"
            elif ctx.claimed:
                await svc.store.release(conv.key, owner=ctx.request_id)
        except StoreError:
            if isinstance(rec, ConversationRecord):
                _release(svc, rec.handle, "store_unavailable")  # nobody can use it: do not pin D for nothing
            rec = "store_unavailable"
    handle = ctx.capture.kv_transfer_params
    handled = stored or rec == "store_unavailable" or str(rec).startswith("released")
    if not handled and handle and handle.get("do_remote_decode") and svc.settings.release_unused:
        # D pinned its blocks for a next turn that will not use them (a stateless turn, or a handle
        # that could not be kept): give the memory back now rather than after decoder_kv_blocks_ttl
        _release(svc, handle, "unused")
    ctx.capture_result = "stored" if stored else str(rec)
    svc.metrics.captures.labels(ctx.capture_result if stored or conv is not None else "no_session").inc()
    _account(ctx)


async def end(ctx: TurnContext, *, ok: bool) -> None:
    """``finish``, bounded in time, shielded from the client leaving, and never raising: the client's
    answer is complete whatever happens to the next turn's record (a failure is logged)."""
    try:
        with anyio.CancelScope(shield=True), anyio.move_on_after(FINISH_TIMEOUT_S):
            await finish(ctx, ok=ok)
    except Exception:
        log.exception("capture.failed request_id=%s", ctx.request_id)


def _release(svc: Services, handle: dict[str, Any], why: str) -> None:
    if svc.releaser is not None:
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
