"""SHORTCUT: before RENDER, from the claimed record and the messages, either a plan or the render asked for.

The render call sits on a turn's critical path, and some turns need none:

* a conversation's first turn with nothing stored: there is nothing of D's to check it against; P and D
  render the messages themselves, as in plain P/D, or D alone computes it where P's queue makes that the
  faster (``plan.first``, the policy's ``decode_local_first``);
* a decode-local turn (``direct``): D's own prefix cache, keyed by the token ids themselves, serves it
  correctly whatever the prompt is (the token check guards pulls, not this); the render would only size
  the new part for the cost estimate, which the new messages' bytes estimate instead (``turn.direct``);
* a pull or recompute turn planned ahead of its render (``ahead``): sent to P with the messages at once;
  a pull's token check then runs on the ids P returns, or on a render beside P's leg, and gates D
  (``turn.ahead``); a recompute reuses nothing of D's and needs no check.

The last two only where the record proves the history (``proves_history``: the template keeps history, the
client echoed the last answer as D produced it, and the history before it digests as stored; a policy
that checks no tokens needs no proof to plan ahead), the record is usable, and routing keeps the turn on
the D holding the conversation. The planner decides as for any turn (``plan.from_record``); a plan stands
without a render where its shortcut is open (``Shortcuts``): decode-local for ``direct``, a pull or
recompute for ``ahead``, unless P likely caches the conversation and would pull ahead (its salted request
could not use that cache). Which shortcuts are open is configuration: ``Shortcuts.RENDER_FIRST`` opens none
(a render service's ids are every prompt, and the check runs before P).
Before the record is read, ``way`` says whether any shortcut could apply: if not, CLAIM and RENDER run
side by side.
Transition: SHORTCUT → PREFILL or DECODE (a plan made without a render), or → RENDER.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from turnkv.config import Settings
from turnkv.gateway.services import Services
from turnkv.gateway.turn import direct, plan
from turnkv.gateway.turn.direct import Candidate, continuation, history_digest, size_guess
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Claimed, Plan
from turnkv.openai.answer import last_assistant
from turnkv.reuse.assess import EngineView, Reason, TemplateClass, record_unusable
from turnkv.state.base import Claim, ClaimStatus
from turnkv.state.record import ConversationRecord


@dataclass(frozen=True)
class Shortcuts:
    """Which turns may be planned without waiting for a render: the configuration of this step. A turn with
    nothing to claim (no conversation, not a chat, several choices) goes as the client sent it in every
    configuration: how it reaches the engines is their business (``engine``)."""

    first: bool = True  # a conversation's first turn with nothing stored: plain P/D, or D alone
    direct: bool = True  # decode-local turns the record proves (setting ``decode_local_direct``)
    ahead: bool = True  # pull or recompute turns the record proves (setting ``render_ahead``)

    RENDER_FIRST: ClassVar[Shortcuts]  # every turn rendered first: its ids are the prompt, checked before P

    @classmethod
    def of(cls, settings: Settings) -> Shortcuts:
        return cls(direct=settings.decode_local_direct, ahead=settings.render_ahead)


Shortcuts.RENDER_FIRST = Shortcuts(first=False, direct=False, ahead=False)


@dataclass(frozen=True)
class Way:
    """What the messages allow before the record is read."""

    plain: Reason | None = None  # nothing to claim: plain P/D without a render, for this reason
    first: bool = False  # a conversation's first turn (no assistant message), planned unrendered if nothing is stored
    candidate: Candidate | None = None  # the messages continue the last answer with text only
    direct: bool = False  # a decode-local turn may go without a render
    ahead: bool = False  # a pull or recompute turn may be planned from the record

    @property
    def record_first(self) -> bool:
        """The record is read before rendering (instead of beside it): a shortcut may spare the render."""
        return self.first or self.direct or self.ahead


def way(svc: Services, turn: Turn, open_: Shortcuts | None = None) -> Way:
    """Which shortcuts may apply to ``turn`` (``open_``: the configuration, by default the settings')."""
    sc = open_ if open_ is not None else Shortcuts.of(svc.settings)
    unclaimed = _unclaimed(turn)
    if unclaimed is not None:
        return Way(plain=unclaimed)
    if last_assistant(turn.messages) is None:
        return Way(first=sc.first)
    cand = continuation(turn.messages)
    policy = svc.policy
    return Way(
        candidate=cand,
        direct=sc.direct and cand is not None and direct.enabled(svc) and policy.may_decode_local,
        ahead=sc.ahead and (not policy.checks_tokens or (_keeps_history(svc) and cand is not None)),
    )


def _unclaimed(turn: Turn) -> Reason | None:
    """Why the turn has no record to claim (None: it has one)."""
    if not turn.chat or turn.conversation is None:
        return Reason.NO_SESSION
    if turn.n != 1:
        return Reason.UNSUPPORTED_REQUEST
    return None


def _keeps_history(svc: Services) -> bool:
    return svc.catalog.template.cls is TemplateClass.PRESERVES


def take(svc: Services, turn: Turn, claimed: Claimed, way: Way) -> Plan | None:
    """The plan of a turn that goes without a render, from its claimed record and its messages; None: render
    it (the planner then plans it from its ids)."""
    if way.first:
        return _first(svc, turn, claimed)
    claim = claimed.claim
    if claim is None or claim.record is None:
        return None  # nothing usable claimed: rendered and planned, the plan says why
    return _from_record(svc, turn, claim, claim.record, way)


def _first(svc: Services, turn: Turn, claimed: Claimed) -> Plan | None:
    """A conversation's first turn: with nothing stored, plain P/D, or D alone where the planner puts it there;
    with a record under its key (a conversation id used again), rendered and checked."""
    claim = claimed.claim
    if claim is None:
        return Plan.plain(claimed.reason)  # the store failed: plain P/D, and it says why
    if claim.status is not ClaimStatus.MISSING:
        return None
    n = size_guess(turn.messages)
    if svc.policy.may_decode_local_first and n > 0:
        made = plan.first(svc, n)
        if made.decode_local:
            return made
    return Plan.plain(Reason.NO_RECORD)


def _from_record(svc: Services, turn: Turn, claim: Claim, rec: ConversationRecord, way: Way) -> Plan | None:
    """A later turn planned from its record, where the record proves its history; None: render it."""
    if not (way.direct or way.ahead) or turn.conversation is None:
        return None
    d = svc.fleet.view(rec.decode_url)
    usable = EngineView(d.routable, d.epoch) if d is not None else None
    if record_unusable(claim, tenant=turn.conversation.tenant, now=time.time(), decode=usable) is not None:
        return None  # rendered and planned: the plan says why
    proved = proves_history(svc, turn, rec, way.candidate)
    if not proved and (svc.policy.checks_tokens or not way.ahead):
        return None
    made = plan.from_record(svc, rec, _estimated_size(turn, rec, way.candidate))
    return made if _stands(svc, made, rec, way, proved=proved) else None


def _stands(svc: Services, made: Plan, rec: ConversationRecord, way: Way, *, proved: bool) -> bool:
    """Whether a plan made from the record goes without a render."""
    if made.decode_url != rec.decode_url:
        return False  # routing moves the conversation off its D: rendered and planned (decode_moved)
    if made.decode_local:
        return way.direct and proved
    if not way.ahead:
        return False
    if not made.pulls_ahead:
        return True
    # a pull ahead of the check is salted apart in P's cache: where P likely caches the conversation, the turn
    # is rendered first, so P's cache serves it
    cached = plan.likely_prefill_cached(rec, svc.fleet.view(made.prefill_url), svc.settings.block_size)
    return cached == 0


def proves_history(svc: Services, turn: Turn, rec: ConversationRecord, cand: Candidate | None) -> bool:
    """What the record says of the prompt before any render: the template keeps history, the client echoed the
    last answer as D produced it, and the history before it digests as stored."""
    if cand is None or not _keeps_history(svc) or rec.history_digest is None:
        return False
    echoed = cand.echoed
    if echoed.answer_digest != rec.answer_digest or (
        rec.had_reasoning and echoed.reasoning_digest != rec.reasoning_digest
    ):
        return False
    return history_digest(turn.body, turn.messages[: cand.answer_at]) == rec.history_digest


def _estimated_size(turn: Turn, rec: ConversationRecord, cand: Candidate | None) -> int:
    """The prompt's tokens, unrendered: D's sequence and the new messages' text; a turn that is not text (an
    unchecked policy's) as P will see it, at least D's sequence."""
    if cand is not None:
        return rec.num_tokens + cand.new_tokens(rec.bytes_per_token)
    return max(size_guess(turn.messages), rec.num_tokens + 1)
