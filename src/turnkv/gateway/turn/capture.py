"""CAPTURE: after the answer, remember D's handle with the hash chain of the tokens it holds.

D's own token ids are the authority: its prompt ids and generated ids, cut to the tokens the handle
holds. A handle that is inconsistent with them is not stored. What becomes of the new handle is the
planner's decision (``plan.after_turn``): kept pinned when the policy would pull it next turn, or as a
hedge should D not take the next turn and P's cache have lost the history (``stored_hedge``: a pull then
beats P recomputing it all), and only within D's pin budget (``gateway.pins``); released at once where
requests wait on D for blocks; else left to D's prefix cache. This step carries it out, and releases the
claimed handle when P did not take it (a decode-local turn supersedes it). Only a turn that completed
replaces the record: when a turn fails (refused by an engine, aborted, drained, or answered without a
record to build), the claimed record is put back, with its handle when P did not use it and without
(``spent``) when P did, so one failure costs the conversation neither its record nor, where P still holds
the history, its reuse. Ends the turn with its log event and metrics (``report``).
Transition: CAPTURE → DONE (the turn is accounted for).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import anyio

from turnkv.engine.base import Handle, HandleProblem
from turnkv.errors import StoreError
from turnkv.gateway.identity import Conversation
from turnkv.gateway.services import Services
from turnkv.gateway.turn import plan, report
from turnkv.gateway.turn.direct import bytes_per_token, history_digest
from turnkv.gateway.turn.direct import enabled as direct_enabled
from turnkv.gateway.turn.results import AfterTurn, Capture
from turnkv.gateway.turn.run import TurnRun
from turnkv.gateway.writeback import Job, job_key
from turnkv.reuse.chain import ChainBuilder, sequence_digest
from turnkv.routing import InstanceView
from turnkv.state.base import pool
from turnkv.state.record import ConversationRecord

# the store keeps a record this long past its last usable moment, to tell "expired" from "none"
EXPIRED_GRACE_S = 120.0
SPENT = "spent"  # ``ConversationRecord.unpinned`` of a record put back after its handle went to P
FINISH_TIMEOUT_S = 5.0
UNBOUNDED = 1 << 62  # a handle's own token count, read without a sequence to hold it against
log = logging.getLogger("turnkv.capture")


def build_record(run: TurnRun) -> ConversationRecord | Capture:
    """The record for the next turn (holding D's handle, or none when D's answer carried none), or why
    there is none."""
    svc, turn, cap = run.svc, run.turn, run.collected
    s = svc.settings
    if turn.conversation is None:
        return Capture.NO_SESSION
    if cap.error is not None or cap.finish_reason is None:
        return Capture.FAILED
    d = svc.fleet.view(run.decode_url)
    _note_stream_handle(run, d)
    prompt = cap.prompt_token_ids
    if prompt is None:
        return Capture.NO_TOKEN_IDS
    held = _held(run, len(prompt) + len(cap.token_ids))
    if isinstance(held, Capture):
        return held
    n, engine_id, unpinned = held
    held_ids = (prompt + cap.token_ids)[:n]
    answer, reasoning = cap.answer.digests()
    messages, h = turn.messages, cap.handle
    # what a later direct turn is held against; not needed where no turn can be direct
    direct = direct_enabled(svc, until_audited=True)
    now = time.time()
    return ConversationRecord(
        tenant=turn.conversation.tenant,
        decode_url=str(run.decode_url),
        prefill_url=run.prefill_url,
        handle=h,
        engine_id=engine_id,
        engine_epoch=d.epoch if d else None,
        num_tokens=n,
        chain=_chain(run, prompt, held_ids).digests(),
        block_size=s.block_size,
        prompt_tokens=len(prompt),
        answer_digest=answer,
        reasoning_digest=reasoning,
        turn=turn.index,
        created_at=now,
        expires_at=now + s.handle_ttl_s,
        history_digest=history_digest(turn.body, messages) if direct else None,
        bytes_per_token=bytes_per_token(messages, len(prompt)) if direct else None,
        unpinned=unpinned,
        answer_calls=len(cap.answer.calls),
        tokens_digest=sequence_digest(held_ids),
        pin_id=None if h is None else svc.engine.pin_id(h),
    )


def _note_stream_handle(run: TurnRun, d: InstanceView | None) -> None:
    """Whether a streamed P/D turn's answer carried D's handle (the fleet learns which Ds' streams do)."""
    prefilled = run.prefilled
    stateful = prefilled is not None and prefilled.result.for_decode is not None and not run.plan.decode_local
    if run.turn.stream and d is not None and stateful:
        run.svc.fleet.saw_stream_handle(d.url, run.collected.handle is not None)


def _held(run: TurnRun, seq_len: int) -> tuple[int, str, str | None] | Capture:
    """What the record holds of D's sequence of ``seq_len`` tokens: how many tokens, the engine holding them,
    and why no handle pins them (None: D's handle does); or why no record is kept."""
    h = run.collected.handle
    if h is not None:
        held = run.svc.engine.read_handle(h, seq_len=seq_len, block_size=run.svc.settings.block_size)
        return Capture(held.value) if isinstance(held, HandleProblem) else (held.tokens, held.engine_id, None)
    # the next turn can still go decode-local (D's prefix cache holds the turn), and says why not more
    if run.plan.decode_local:
        return seq_len, "", "decode_local"  # D was asked for no handle (turn/decode.py)
    if run.turn.stream:
        return seq_len, "", "no_handle_in_stream"
    return Capture.NO_HANDLE


def _chain(run: TurnRun, prompt: list[int], held_ids: list[int]) -> ChainBuilder:
    """The hash chain of the tokens the record holds: the render's, extended by D's answer, where D computed
    the rendered prompt (a prompt D computed otherwise is counted: ``render_mismatch``)."""
    rendered = run.rendered
    same = rendered.prompt_ids is not None and prompt == rendered.prompt_ids
    if rendered.prompt_ids is not None and not same:
        run.svc.metrics.render_mismatch.inc()
    if rendered.chain is not None and same and len(held_ids) >= len(prompt):
        return rendered.chain.copy().extend(held_ids[len(prompt) :])
    return ChainBuilder(run.svc.settings.block_size).extend(held_ids)


async def finish(run: TurnRun, *, ok: bool) -> Capture:
    """Store the next record (or put the claimed one back), give back every handle nobody will use."""
    built = build_record(run) if ok else Capture.FAILED
    after = None
    if isinstance(built, ConversationRecord) and built.handle is not None:
        after = plan.after_turn(run.svc, built, run.claimed.record)
        built = _carry_out(run, built, after)
    result = await _store(run, built, after)
    _settle_new_handle(run, result, ok=ok)
    old = run.claimed.record
    if old is not None and old.handle is not None and not run.journal.handle_spent and not result.put_back:
        # the claimed handle was not handed to P (decode-local, or the turn ended): it pins D for nothing
        _release(run.svc, old.handle, "superseded", old.decode_url, old.num_tokens)
    return result


def _carry_out(run: TurnRun, rec: ConversationRecord, after: AfterTurn) -> ConversationRecord:
    """The planner's decision on the new handle, done: the record then holds it, or says why not."""
    svc = run.svc
    assert rec.handle is not None, "only a record with a handle is decided on"
    if after is AfterTurn.WRITE_BACK:
        _write_back(run, rec)  # the write-back owns the handle now: no turn may pull what it reads
    elif after is AfterTurn.DECODE_CROWDED:
        _release(svc, rec.handle, "decode_crowded", rec.decode_url, rec.num_tokens)  # for the turns waiting on D
    elif after is AfterTurn.LET_GO:
        _leave(svc, rec.decode_url, rec.handle, rec.num_tokens, "not_needed")  # then in D's prefix cache
    else:
        return rec
    return rec.unpin(after.value)


def _write_back(run: TurnRun, rec: ConversationRecord) -> None:
    """Hand the record's handle to the write-backs, with the sequence it holds (D's own ids)."""
    svc, cap, conv = run.svc, run.collected, run.turn.conversation
    assert rec.handle is not None and rec.prefill_url is not None and conv is not None, "a P/D turn's handle"
    ids = ((cap.prompt_token_ids or []) + cap.token_ids)[: rec.num_tokens]
    lacks = plan.write_back_lacks(svc, rec, svc.fleet.view(rec.prefill_url))
    key = job_key(conv.store_key, rec)
    svc.write_backs.submit(Job(key, rec.handle, ids, rec.prefill_url, rec.decode_url, lacks, rec.expires_at))


async def _store(run: TurnRun, built: ConversationRecord | Capture, after: AfterTurn | None) -> Capture:
    """The next record stored, or the claimed one put back, or the claim let go; what the turn left."""
    conv = run.turn.conversation
    try:
        if conv is None:
            assert isinstance(built, Capture), "a turn without a conversation builds no record"
            return built
        if isinstance(built, ConversationRecord):
            return await _put(run, conv, built, after)
        old = run.claimed.record
        if old is not None and old.expires_at > time.time():
            # only a turn that completed replaces the record: a failed, refused, aborted or drained one puts
            # back the one it claimed, so its retry (or the next turn) still finds the history. Where P
            # already took its handle (a pull, or a release), it goes back without one: the history is in P's
            # prefix cache now, and the next turn says so
            spent = run.journal.handle_spent and old.handle is not None
            kept = old.unpin(SPENT) if spent else old
            await run.svc.store.records.put(_claimed_key(run), kept, old.expires_at - time.time() + EXPIRED_GRACE_S)
            return built.kept_unpinned() if spent else built.kept_previous()
        if run.claimed.held:
            await run.svc.store.records.release(_claimed_key(run), owner=run.turn.request_id)
        return built
    except StoreError:
        if isinstance(built, ConversationRecord) and built.handle is not None:
            # nobody can use it: do not pin D for nothing
            _release(run.svc, built.handle, "store_unavailable", built.decode_url, built.num_tokens)
        return Capture.STORE_UNAVAILABLE


async def _put(run: TurnRun, conv: Conversation, rec: ConversationRecord, after: AfterTurn | None) -> Capture:
    svc = run.svc
    if rec.handle is not None:
        await svc.pins.make_room(rec.decode_url, rec.num_tokens)
    # a conversation found from its history moves on: stored under this request's digest, in its pool
    ttl_s, owner = svc.settings.handle_ttl_s + EXPIRED_GRACE_S, run.turn.request_id
    if conv.pooled:
        stored, replaced = await svc.store.records.put_any(pool(conv.store_key), rec, ttl_s, owner=owner)
        if replaced is not None and replaced.handle is not None:
            # a full pool (more identical conversations than slots): one of its records gave way
            _release(svc, replaced.handle, "pool_full", replaced.decode_url, replaced.num_tokens)
    else:
        stored = conv.store_key
        await svc.store.records.put(stored, rec, ttl_s)
    if run.claimed.held and _claimed_key(run) != stored:
        await svc.store.records.release(_claimed_key(run), owner=owner)
    if rec.handle is None:
        return Capture.unpinned(str(rec.unpinned))
    return Capture.STORED_HEDGE if after is AfterTurn.HEDGE else Capture.STORED


def _claimed_key(run: TurnRun) -> str:
    """The key the turn claimed (of a pool: the slot), where its record goes back or its marker is let go."""
    conv = run.turn.conversation
    assert conv is not None, "only a conversation's turn claims"
    return run.claimed.key or conv.key


def _settle_new_handle(run: TurnRun, result: Capture, *, ok: bool) -> None:
    """D pinned its blocks for a next turn that will not use them (a stateless turn, a failed one, or a handle
    that could not be kept): a failed turn's go back now; an answered one's are left to D's TTL as plain P/D
    leaves them, within decode_memory.unused_share (gateway/pins.py)."""
    svc, new_handle = run.svc, run.collected.handle
    if result.stored or result is Capture.STORE_UNAVAILABLE or not new_handle or not svc.engine.pins_memory(new_handle):
        return
    if not ok or run.decode_url is None:
        _release(svc, new_handle, "failed_turn" if not ok else "unused")
        return
    held = svc.engine.read_handle(new_handle, seq_len=UNBOUNDED, block_size=svc.settings.block_size)
    if isinstance(held, HandleProblem):
        _release(svc, new_handle, "unused")
    else:
        _leave(svc, run.decode_url, new_handle, held.tokens, "unused")


async def end(run: TurnRun, *, ok: bool) -> None:
    """``finish``, bounded in time, shielded from the client leaving, and never raising: the client's
    answer is complete whatever happens to the next turn's record (a failure is logged). Then the turn
    is accounted for."""
    result = Capture.FAILED
    try:
        with _bounded(run.stateful):
            result = await finish(run, ok=ok)
            run.svc.metrics.captures.labels(result.value if run.stateful else Capture.NO_SESSION.value).inc()
            report.account(run, result)
    except Exception:
        log.exception("capture.failed request_id=%s", run.turn.request_id)
    finally:
        run.svc.drain.untrack(run)
        if run.ticket is not None:
            run.ticket.release()


@contextlib.contextmanager
def _bounded(stores: bool) -> Iterator[None]:
    """Around ``finish``: a turn of a conversation calls the store, in time and shielded from the client
    leaving; one without a conversation calls nothing (``finish`` then never waits: no store call, no
    pin to make room for), so it needs neither scope, whose cost is a share of a relayed turn's CPU."""
    if not stores:
        yield
        return
    with anyio.CancelScope(shield=True), anyio.move_on_after(FINISH_TIMEOUT_S):
        yield


def _leave(svc: Services, decode_url: str, handle: Handle, tokens: int, why: str) -> None:
    """A handle nobody will pull: left to D's TTL within the unused share, else released."""
    if svc.settings.release_unused:
        svc.pins.unused(decode_url, handle, tokens, why)


def _release(svc: Services, handle: Handle, why: str, decode_url: str | None = None, tokens: int = 0) -> None:
    if svc.settings.release_unused:
        svc.releaser.submit(handle, why, decode_url, tokens)
