"""CLAIM: take the conversation's record for this turn (single use: a concurrent turn finds it in flight).

A conversation named by an id has one record. One found from its history (or a previous response) takes a
record from its key's pool (``state.base.pool``), the one holding the answer the client sent back where
there is one; when that pool holds none, a request answered before (a retry after a failure the record
outlived, a regenerated answer) takes the record of that earlier answer, from the pool of its own digest:
the history up to its last message is D's, and the token check reuses it up to there.

A store that failed, or was too busy to answer (every connection stayed busy past the pool's wait:
``store_busy``), costs this turn its reuse and nothing else: the turn goes on, and says why.
Transition: CLAIM → SHORTCUT (the record read first), or → PLAN beside RENDER (both at once).
"""

from __future__ import annotations

import time
from dataclasses import replace

from turnkv.errors import StoreBusy, StoreError
from turnkv.gateway.identity import Conversation
from turnkv.gateway.services import Services
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Claimed
from turnkv.gateway.writeback import job_key
from turnkv.reuse.assess import Reason
from turnkv.state.base import Claim, ClaimStatus, base_of, pool


async def run(svc: Services, turn: Turn) -> Claimed:
    """The conversation's record, claimed, and why the turn reuses nothing as far as the claim can tell:
    ``no_session`` when claimed (PLAN says why, from the record); otherwise ``store_busy`` (load, this call
    only) or ``store_unavailable`` (the store failed)."""
    assert turn.conversation is not None, "only a conversation's turn claims a record"
    t0 = time.perf_counter()
    try:
        key, claim = await _take(svc, turn, turn.conversation)
    except StoreBusy:
        return Claimed(None, Reason.STORE_BUSY, time.perf_counter() - t0)
    except StoreError:
        return Claimed(None, Reason.STORE_UNAVAILABLE, time.perf_counter() - t0)
    rec = claim.record if claim.status is ClaimStatus.FOUND else None
    if rec is not None:
        svc.write_backs.think.observe(time.time() - rec.created_at)  # the conversation is back: how long it thought
    if rec is not None and rec.unpinned == "write_back":
        # a write-back of its last turn not yet sent is dropped, its handle (still pinned on D) the record's
        # again, for this turn to pull or release; found by the record's own sequence: of identical
        # conversations in a pool, only its own handle
        handle = svc.write_backs.reclaim(job_key(base_of(key), rec))
        if handle is not None:
            claim = replace(claim, record=rec.repin(handle, svc.engine.pin_id(handle)))
    return Claimed(claim, Reason.NO_SESSION, time.perf_counter() - t0, key)


async def _take(svc: Services, turn: Turn, conv: Conversation) -> tuple[str, Claim]:
    """The key claimed and the claim: the conversation's own, or one of its pool's, or the record a request
    answered before left under its own digest."""
    records, owner = svc.store.records, turn.request_id
    if not conv.pooled:
        return conv.key, await records.claim(conv.key, owner=owner)
    key, claim = conv.key, Claim(ClaimStatus.MISSING)
    if conv.continues:
        key, claim = await records.claim_any(pool(conv.key), owner=owner, prefer=conv.prefer)
    if claim.status is not ClaimStatus.FOUND and conv.store_key != conv.key:
        answered_key, answered = await records.claim_any(pool(conv.store_key), owner=owner)
        if answered.status is ClaimStatus.FOUND or claim.status is ClaimStatus.MISSING:
            return answered_key, answered
    return key, claim
