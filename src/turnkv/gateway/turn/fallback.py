"""FALLBACK: the one way a planned turn becomes plain P/D without the stored handle, and what it then says.

Why it happens (``Fallback``) decides the reason the turn reports: a failed or stalled pull reports it
only when a pull was planned (a handle sent only to be released costs the turn nothing); a decode leg
that failed before its first token reports it whenever the turn belonged to a conversation (what it
planned did not happen); a decode-local turn whose D failed keeps its reason, and releases the claimed
handle through P on the way.
"""

from __future__ import annotations

import dataclasses

from turnkv.engine.base import Handle, HandleUse
from turnkv.gateway.turn.results import Fallback, Plan
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action

_REASON = {
    Fallback.PULL_FAILED: Reason.PULL_FAILED,
    Fallback.PREFILL_DEADLINE: Reason.FIRST_TOKEN_DEADLINE,
    Fallback.DECODE_FAILED: Reason.DECODE_FAILED,
    Fallback.DECODE_DEADLINE: Reason.FIRST_TOKEN_DEADLINE,
}


def reason_after(plan: Plan, why: Fallback, *, stateful: bool) -> Reason:
    if why is Fallback.DECODE_LOCAL_FAILED:
        return plan.reason
    if why is Fallback.RENDER_MISMATCH:  # what the check found, or that there was nothing to check
        return plan.assessment.reason if plan.assessment is not None else Reason.RENDER_FAILED
    if why.leg == "prefill":
        return _REASON[why] if plan.action is Action.PULL else plan.reason
    return _REASON[why] if stateful else plan.reason


def without_handle(plan: Plan, why: Fallback, *, stateful: bool, release: Handle | None = None) -> Plan:
    """``plan`` as plain P/D: P computes what its own cache lacks, pulls nothing (P gets ``release`` to
    free, if any), and D continues from P's KV."""
    action = Action.RECOMPUTE if plan.action in (Action.PULL, Action.DECODE_LOCAL) else plan.action
    return dataclasses.replace(
        plan,
        action=action,
        reason=reason_after(plan, why, stateful=stateful),
        send=HandleUse.release(release) if release is not None else None,
        pull_tokens=0,
        expected_cached=0,
        direct=False,
    )
