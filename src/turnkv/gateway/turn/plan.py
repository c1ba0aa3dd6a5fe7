"""PLAN: decide how much of the stored decode KV this turn reuses, and how the turn runs.

The token check (``reuse.assess``) says what may be reused and why not more; the policy says whether
pulling it pays, or whether the decode engine should prefill the turn itself. A handle that is not
pulled goes to P to be released, so D frees its blocks at once. Whether the D holding the conversation
has room for a decode-local turn is ``reuse.room``'s decision: not when short of KV (``decode_busy``: its
idle conversations' freed blocks are the first it evicts, so the turn would compute the whole history
again there), nor when requests wait on it longer than the turn would wait at P (``decode_queue``). When
routing puts the turn on another D than the one holding the conversation (by load), the turn runs
through P, pulling the old D's blocks where that pays, and says ``decode_moved``.
``direct`` is the same planner for a turn not rendered at all (``turn.direct``): its prompt's size is
estimated, and only a decode-local decision stands; ``first`` the same for a conversation's first turn,
nothing stored (D prefills its whole prompt, as colocated serving does, where P's queue makes P's path the
slower: the policy's ``decode_local_first``); ``ahead`` for a pull or recompute turn planned before
its render returns (``turn.ahead``): the same facts, the record's length standing for the match. ``facts``
is what the policy is told, the same for both and for CAPTURE's question whether a new handle is worth
keeping: the token check's result, and the engines' load (``reuse.load``: D's step time and the KV its
streams read, P's queue; a fact the fleet cannot give is left to the policy's model, and the turn log says
which and why).
Transition: PLAN → PREFILL, or → DECODE for decode-local.
"""

from __future__ import annotations

import time
from dataclasses import replace

from turnkv.engine.base import HandleUse
from turnkv.gateway.services import Services
from turnkv.gateway.turn.direct import Candidate, continuation, history_digest, size_guess
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import Ahead, Plan, Rendered
from turnkv.openai.answer import echoed_answer
from turnkv.reuse.assess import (
    Assessment,
    EngineView,
    Reason,
    TemplateClass,
    assess,
    record_unusable,
    unpinned_reason,
)
from turnkv.reuse.cost import Action, CostParams, TurnFacts, pulled_tokens
from turnkv.reuse.decision import Decision
from turnkv.reuse.load import LoadFacts, load_facts
from turnkv.reuse.room import DecodeRoom, decode_room
from turnkv.routing.base import InstanceView
from turnkv.state.base import Claim
from turnkv.state.record import ConversationRecord


def room(svc: Services, decode: InstanceView, load: LoadFacts) -> DecodeRoom:
    """Whether ``decode`` has room for a decode-local turn (``reuse.room``): its KV usage, the turns the
    gateway holds for room on it (``decode_admission``: D's queue all the same), its queue against P's (with
    ``decode_memory.local_queue: refuse``, against none: any request waiting on D refuses the turn)."""
    dm = svc.settings.decode_memory
    return decode_room(
        kv_usage=decode.kv_usage,
        pressure_kv_usage=dm.pressure_kv_usage,
        held=svc.admission.queued(decode.url),
        decode_queue_ms=load.decode_queue_ms,
        prefill_queue_ms=load.prefill_queue_ms if dm.local_queue == "weigh" else 0.0,
    )


def turn_load(svc: Services, prefill: InstanceView | None, decode: InstanceView | None, costs: CostParams) -> LoadFacts:
    """The engines' load for a turn on ``prefill`` and ``decode``, now on the fleet's clock (``reuse.load``)."""
    return load_facts(
        prefill, decode, svc.fleet.now(), default_step_ms=costs.step_base_s * 1e3, gpu_setting=svc.settings.shared_gpu
    )


def likely_prefill_cached(rec: ConversationRecord | None, prefill: InstanceView | None, block_size: int) -> int:
    """Prompt tokens the chosen P likely still caches: it computed the last prompt if it served the
    last turn; how much of that survives there is measured (``InstanceView.cache_factor``)."""
    if rec is None or prefill is None or prefill.url != rec.prefill_url:
        return 0
    bs = block_size
    return int((rec.prompt_tokens // bs) * bs * prefill.cache_factor) // bs * bs


def decode_cached(rec: ConversationRecord | None, matched: int, block_size: int) -> int:
    """What D's own prefix cache likely holds of the conversation: all it computed, unless its pin was
    released under memory pressure or while turns waited on D (then its freed blocks are the first to be
    reused)."""
    if rec is None or rec.unpinned in ("pressure", "decode_crowded"):
        return 0
    return (matched // block_size) * block_size


def facts(
    rec: ConversationRecord | None,
    *,
    prompt_tokens: int,
    matched: int,
    prefill: InstanceView | None,
    decode: InstanceView | None,
    decode_holds: bool,
    block_size: int,
    load: LoadFacts,
) -> TurnFacts:
    """What the policy is told of a turn continuing ``rec`` (None: nothing stored): ``matched`` tokens of
    D's sequence extend the prompt; D may run the turn itself when it ``decode_holds`` them; ``load``:
    the engines' load and whether they share a GPU (``turn_load``)."""
    return TurnFacts(
        prompt_tokens=prompt_tokens,
        reusable_tokens=matched if rec is not None and rec.handle is not None else 0,
        prefill_cached_tokens=likely_prefill_cached(rec, prefill, block_size),
        decode_cached_tokens=decode_cached(rec, matched, block_size) if decode_holds else 0,
        decode_local_possible=decode_holds,
        decode_busy=decode.busy if decode is not None else 0,
        # for the ITL budget: D's decode batch and how full its KV is, as its metrics last said
        decode_running=decode.busy if decode is not None else None,
        decode_kv_usage=decode.kv_usage if decode is not None and decode.kv_usage > 0 else None,
        decode_step_ms=load.decode_step_ms,
        decode_context_tokens=load.decode_context_tokens,
        prefill_queue_ms=load.prefill_queue_ms,
        decode_queue_ms=load.decode_queue_ms,
        prefill_waiting=load.prefill_waiting,
        # the decode-local turns this gateway has prefilling on that D: their chunks share its steps
        decode_prefills=load.decode_prefills,
        decode_prefill_tokens=load.decode_prefill_tokens,
        shared_gpu=load.shared_gpu,
    )


def _pick_prefill(
    svc: Services, rec: ConversationRecord | None, prompt_tokens: int, costs: CostParams
) -> InstanceView | None:
    """The P for the turn: the routing profile's, told what the turn would compute on each (the
    conversation's P computing only what it likely caches)."""
    home = rec.prefill_url if rec else None
    return svc.router.pick(
        "prefill",
        prefer=home,
        prompt_tokens=prompt_tokens,
        prefer_cached_tokens=likely_prefill_cached(rec, svc.fleet.view(home), svc.settings.block_size),
        prefill_s_per_token=costs.prefill_per_token_s,
    )


def estimates_ms(decision: Decision) -> dict[str, float]:
    """The policy's TTFT estimates per action, in ms, as the turn log shows them."""
    return {k.value: round(v * 1e3, 3) for k, v in decision.estimates.items()}


def charges_ms(decision: Decision) -> dict[str, float]:
    """What the policy charged each action for the turns waiting behind its P compute, in ms (none: P idle)."""
    return {k.value: round(v * 1e3, 3) for k, v in decision.charges.items()}


def check(svc: Services, turn: Turn, rendered: Rendered) -> Assessment | None:
    """The token check of a rendered turn against its claimed record (None: nothing to check)."""
    return _assess(svc, turn, rendered)


def _assess(svc: Services, turn: Turn, rendered: Rendered) -> Assessment | None:
    claim = rendered.claim
    if claim is None or rendered.prompt_ids is None or turn.conversation is None:
        return None
    rec = claim.record
    inst = svc.fleet.view(rec.decode_url) if rec else None
    a = assess(
        claim,
        rendered.prompt_ids,
        tenant=turn.conversation.tenant,
        now=time.time(),
        decode=None if inst is None else EngineView(inst.routable, inst.epoch),
        echoed=echoed_answer(turn.messages),
        template=svc.catalog.template.cls,
        block_size=svc.settings.block_size,
        prompt_chain=rendered.chain,
        proved=rendered.proved,
    )
    if rec is not None and not svc.policy.checks_tokens and a.releasable:
        # the unchecked baseline believes the handle covers the prompt, as vLLM's example proxy does
        return Assessment(rec, rec.num_tokens, True, Reason.FULL_MATCH, True)
    return a


def plan(svc: Services, turn: Turn, rendered: Rendered) -> Plan:
    """The plan for a rendered turn (or one whose render failed, or whose record could not be claimed)."""
    a = _assess(svc, turn, rendered)
    rec = rendered.record
    reason = a.reason if a is not None else rendered.reason
    costs = svc.estimator.params()
    n = len(rendered.prompt_ids) if rendered.prompt_ids is not None else size_guess(turn.messages)
    prefill = _pick_prefill(svc, rec, n, costs)
    decode = svc.router.pick("decode", prefer=rec.decode_url if rec else None)
    base = Plan(
        Action.RECOMPUTE,
        reason,
        prefill_url=prefill.url if prefill else None,
        decode_url=decode.url if decode else None,
        assessment=a,
    )
    if a is None or rendered.prompt_ids is None:
        if rec is not None and rec.handle is not None and reason is Reason.RENDER_FAILED:
            return replace(base, send=HandleUse.release(rec.handle))
        return base
    bs = svc.settings.block_size
    moved = rec is not None and decode is not None and decode.url != rec.decode_url and a.releasable
    holds = rec is not None and decode is not None and decode.url == rec.decode_url and a.releasable
    load = turn_load(svc, prefill, decode, costs)
    # a D short of KV, or whose queue is longer than P's, takes no decode-local turn (``reuse.room``)
    d_room = room(svc, decode, load) if holds and decode is not None else None
    pressed = d_room is not None and not d_room.ok
    holds = holds and not pressed
    f = facts(
        rec,
        prompt_tokens=len(rendered.prompt_ids),
        matched=a.tokens,
        prefill=prefill,
        decode=decode,
        decode_holds=holds,
        block_size=bs,
        load=load,
    )
    decision = svc.policy.decide(f, costs)
    if decision.reason is not None:
        reason = decision.reason
    elif pressed and d_room is not None and d_room.reason is not None and decision.action is Action.RECOMPUTE:
        reason = d_room.reason  # D would have taken it, but is short of KV or its queue is longer than P's
    elif moved:
        reason = Reason.DECODE_MOVED  # routing chose another D than the conversation's, by load
    elif rec is not None and rec.handle is None and a.full and decision.action is Action.RECOMPUTE:
        reason = unpinned_reason(rec)  # D's KV matched, but its handle was given back
    same_p = rec is not None and prefill is not None and prefill.url == rec.prefill_url
    local = decision.action is Action.DECODE_LOCAL
    decided = replace(
        base,
        action=decision.action,
        reason=reason,
        estimates=estimates_ms(decision),
        charges=charges_ms(decision),
        load={**load.log(), **({"decode_room": d_room.log()} if d_room is not None else {})},
        expected_cached=f.prefill_cached_tokens,
        expect_hits=(rec.prompt_tokens // bs) * bs if rec is not None and same_p and not local else 0,
    )
    if rec is None:
        return decided
    if decision.action is Action.PULL and rec.handle is not None:
        pulled = pulled_tokens(costs, f)
        return replace(
            decided,
            send=HandleUse(rec.handle, a.tokens),
            pull_tokens=pulled,
            expected_cached=f.prefill_cached_tokens + pulled,
        )
    if local:  # D's own cache holds the conversation
        return replace(
            decided,
            decode_url=rec.decode_url,
            expected_cached=f.decode_cached_tokens,
            local_new_tokens=f.prompt_tokens - f.decode_cached_tokens,
        )
    if rec.handle is not None and a.releasable:
        return replace(decided, send=HandleUse.release(rec.handle))  # P frees it at D on the way
    return decided


def _decide_unrendered(
    svc: Services, rec: ConversationRecord | None, prompt_tokens: int, d: InstanceView | None
) -> tuple[InstanceView | None, LoadFacts, DecodeRoom | None, TurnFacts, Decision]:
    """The policy's decision for a turn planned from its record (None: a first turn, nothing stored), its
    size estimated: the P it would use, the engines' load, whether the D has room for it (``reuse.room``;
    None: no D), and the facts the policy was told."""
    costs = svc.estimator.params()
    prefill = _pick_prefill(svc, rec, prompt_tokens, costs)
    load = turn_load(svc, prefill, d, costs)
    d_room = room(svc, d, load) if d is not None else None
    f = facts(
        rec,
        prompt_tokens=prompt_tokens,
        matched=rec.num_tokens if rec is not None else 0,
        prefill=prefill,
        decode=d,
        decode_holds=d_room is not None and d_room.ok,
        block_size=svc.settings.block_size,
        load=load,
    )
    return prefill, load, d_room, f, svc.policy.decide(f, costs)


def direct(svc: Services, turn: Turn, claim: Claim, cand: Candidate) -> Plan | None:
    """The decode-local plan for a turn that continues its last answer with text only, made without a
    render (its size estimated from the new messages' bytes); None when the record or the policy does
    not allow it (the turn is then rendered and planned as any other)."""
    rec = claim.record
    if rec is None or turn.conversation is None:
        return None
    # the D routing would pick for this turn must be the one holding the conversation
    d = svc.router.pick("decode", prefer=rec.decode_url)
    view = EngineView(d.routable, d.epoch) if d is not None and d.url == rec.decode_url else None
    if d is None or record_unusable(claim, tenant=turn.conversation.tenant, now=time.time(), decode=view) is not None:
        return None
    echoed = cand.echoed
    if echoed.answer_digest != rec.answer_digest or (
        rec.had_reasoning and echoed.reasoning_digest != rec.reasoning_digest
    ):
        return None
    history = turn.messages[: cand.answer_at]
    if rec.history_digest is None or history_digest(turn.body, history) != rec.history_digest:
        return None  # the history before the answer changed (compacted, tools, options): render and check
    prompt_tokens = rec.num_tokens + cand.new_tokens(rec.bytes_per_token)
    prefill, load, d_room, f, decision = _decide_unrendered(svc, rec, prompt_tokens, d)
    if d_room is None or not d_room.ok:
        return None  # rendered and planned: the plan says why (decode_busy, decode_queue)
    if decision.action is not Action.DECODE_LOCAL:
        return None
    why = decision.reason or Reason.DECODE_LOCAL
    return _unrendered_local(why, prefill, rec.decode_url, f, decision, load, d_room)


def _unrendered_local(
    reason: Reason,
    prefill: InstanceView | None,
    decode_url: str,
    f: TurnFacts,
    decision: Decision,
    load: LoadFacts,
    d_room: DecodeRoom,
) -> Plan:
    """A decode-local plan made without a render (``direct``, ``first``)."""
    return Plan(
        Action.DECODE_LOCAL,
        reason,
        prefill_url=prefill.url if prefill else None,
        decode_url=decode_url,
        expected_cached=f.decode_cached_tokens,
        local_new_tokens=f.prompt_tokens - f.decode_cached_tokens,
        estimates=estimates_ms(decision),
        charges=charges_ms(decision),
        load={**load.log(), "decode_room": d_room.log()},
        direct=True,
    )


def first(svc: Services, turn: Turn) -> Plan | None:
    """The decode-local plan for a conversation's first turn with nothing stored, made without a render
    (its size estimated from its messages' bytes): while prefills wait at P, D computes the whole prompt
    itself where the policy finds that faster than P's path (its queue, and the charge for the turns behind
    it) and D has room and ITL to spare; the reason is ``prefill_busy``. None: through P as plain P/D; at an
    idle P always, even where D alone would be faster (a short prompt skips the transfer): P/D's split
    stands while P keeps up."""
    if not svc.policy.may_decode_local_first or not turn.chat:
        return None
    n = size_guess(turn.messages)
    d = svc.router.pick("decode")
    if n <= 0 or d is None:
        return None
    prefill, load, d_room, f, decision = _decide_unrendered(svc, None, n, d)
    if d_room is None or not d_room.ok or decision.action is not Action.DECODE_LOCAL:
        return None
    if not f.prefill_waiting and not f.prefill_queue_ms:
        return None  # P idle: P/D's split stands, even where D alone would be faster (no transfer)
    return _unrendered_local(Reason.PREFILL_BUSY, prefill, d.url, f, decision, load, d_room)


def ahead_possible(svc: Services, turn: Turn) -> bool:
    """Whether the turn may be planned from its record, so the record is worth reading before rendering:
    the setting is on, and the policy checks no tokens or the template keeps history and the messages
    continue an answer with text."""
    if not svc.settings.render_ahead or turn.conversation is None:
        return False
    if not svc.policy.checks_tokens:
        return True
    return svc.catalog.template.cls is TemplateClass.PRESERVES and continuation(turn.messages) is not None


def _proves_history(svc: Services, turn: Turn, rec: ConversationRecord, cand: Candidate | None) -> bool:
    """What the record says of the prompt before any render: the template keeps history, the client echoed
    the last answer as D produced it, and the history before it digests as stored."""
    if cand is None or svc.catalog.template.cls is not TemplateClass.PRESERVES or rec.history_digest is None:
        return False
    echoed = cand.echoed
    if echoed.answer_digest != rec.answer_digest or (
        rec.had_reasoning and echoed.reasoning_digest != rec.reasoning_digest
    ):
        return False
    return history_digest(turn.body, turn.messages[: cand.answer_at]) == rec.history_digest


def ahead(svc: Services, turn: Turn, claim: Claim) -> Plan | None:
    """The pull or recompute plan for a turn whose record proves its history (or whose policy checks no
    tokens), made before any render; None when the turn must be rendered and planned first: the record does
    not prove it, the policy would go decode-local, or P likely caches the conversation and would pull ahead
    (its salted request could not use that cache)."""
    rec = claim.record
    if rec is None or turn.conversation is None or not svc.settings.render_ahead:
        return None
    d = svc.router.pick("decode", prefer=rec.decode_url)
    if d is None or d.url != rec.decode_url:
        return None  # routing moves the conversation off its D: rendered and planned (decode_moved)
    if record_unusable(claim, tenant=turn.conversation.tenant, now=time.time(), decode=EngineView(d.routable, d.epoch)):
        return None
    checks = svc.policy.checks_tokens
    cand = continuation(turn.messages)
    if checks and not _proves_history(svc, turn, rec, cand):
        return None
    bs = svc.settings.block_size
    if cand is not None:
        prompt_tokens = rec.num_tokens + cand.new_tokens(rec.bytes_per_token)
    else:  # an unchecked policy's turn that is not text: sized as P will see it, at least D's sequence
        prompt_tokens = max(size_guess(turn.messages), rec.num_tokens + 1)
    prefill, load, d_room, f, decision = _decide_unrendered(svc, rec, prompt_tokens, d)
    pressed = d_room is not None and not d_room.ok
    if decision.action is Action.DECODE_LOCAL:
        return None  # the direct path's, or rendered and planned
    pull = decision.action is Action.PULL and rec.handle is not None
    if pull and checks and f.prefill_cached_tokens > 0:
        return None
    reason = Reason.FULL_MATCH
    if decision.reason is not None:
        reason = decision.reason
    elif pressed and d_room is not None and d_room.reason is not None and decision.action is Action.RECOMPUTE:
        reason = d_room.reason  # D would have taken it, but is short of KV or its queue is longer than P's
    elif d is not None and d.url != rec.decode_url:
        reason = Reason.DECODE_MOVED  # routing chose another D than the conversation's, by load
    elif rec.handle is None and decision.action is Action.RECOMPUTE:
        reason = unpinned_reason(rec)
    same_p = prefill is not None and prefill.url == rec.prefill_url
    decided = Plan(
        decision.action if pull else Action.RECOMPUTE,
        reason,
        prefill_url=prefill.url if prefill else None,
        decode_url=d.url if d else None,
        estimates=estimates_ms(decision),
        charges=charges_ms(decision),
        load={**load.log(), **({"decode_room": d_room.log()} if d_room is not None else {})},
        expected_cached=f.prefill_cached_tokens,
        planned_tokens=prompt_tokens,
        ahead=Ahead.CHECKED if pull and checks else Ahead.SKIPPED,
    )
    if not pull:  # nothing of D's reused: no check needed; P frees the handle on the way
        send = HandleUse.release(rec.handle) if rec.handle is not None else None
        return replace(decided, send=send, expect_hits=(rec.prompt_tokens // bs) * bs if same_p else 0)
    assert rec.handle is not None
    pulled = pulled_tokens(svc.estimator.params(), f)
    return replace(
        decided,
        send=HandleUse(rec.handle, rec.num_tokens),
        pull_tokens=pulled,
        expected_cached=f.prefill_cached_tokens + pulled,
        # the unchecked baseline believes the handle covers the prompt, as vLLM's proxy does
        assessment=None if checks else Assessment(rec, rec.num_tokens, True, Reason.FULL_MATCH, True),
        expect_hits=(rec.prompt_tokens // bs) * bs if same_p and not checks else 0,
    )
