"""CLAIM: take the conversation's record for this turn (single use: a concurrent turn finds it in flight).

A store that failed, or was too busy to answer (every connection stayed busy past the pool's wait:
``store_busy``), costs this turn its reuse and nothing else: the turn goes on, and says why.
Transition: CLAIM → SHORTCUT (the record read first), or → PLAN beside RENDER (both at once).
"""

from __future__ import annotations

import time
from dataclasses import replace

from turnkv.errors import StoreBusy, StoreError
from turnkv.gateway.services import Services
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Claimed
from turnkv.reuse.assess import Reason
from turnkv.state.base import ClaimStatus


async def run(svc: Services, turn: Turn) -> Claimed:
    """The conversation's record, claimed, and why the turn reuses nothing as far as the claim can tell:
    ``no_session`` when claimed (PLAN says why, from the record); otherwise ``store_busy`` (load, this call
    only) or ``store_unavailable`` (the store failed)."""
    assert turn.conversation is not None, "only a conversation's turn claims a record"
    t0 = time.perf_counter()
    try:
        claim = await svc.store.records.claim(turn.conversation.key, owner=turn.request_id)
    except StoreBusy:
        return Claimed(None, Reason.STORE_BUSY, time.perf_counter() - t0)
    except StoreError:
        return Claimed(None, Reason.STORE_UNAVAILABLE, time.perf_counter() - t0)
    if claim.status is ClaimStatus.FOUND and claim.record is not None:
        # the conversation is back: how long it thought; and a write-back of its last turn not yet sent is
        # dropped, its handle (still pinned on D) the record's again, for this turn to pull or release
        svc.write_backs.think.observe(time.time() - claim.record.created_at)
        handle = svc.write_backs.reclaim(turn.conversation.key)
        if handle is not None and claim.record.unpinned == "write_back":
            claim = replace(claim, record=claim.record.repin(handle, svc.engine.pin_id(handle)))
    return Claimed(claim, Reason.NO_SESSION, time.perf_counter() - t0)
