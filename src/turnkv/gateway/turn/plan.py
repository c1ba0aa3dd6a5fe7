"""PLAN: how a turn runs and why, from what is known of it. One decision path for every turn that is planned.

What is known of the prompt differs (``Basis``): a turn rendered, its ids checked against the claimed record
(``check``: ``reuse.assess`` says how many of D's tokens the prompt extends, and why not more); a turn planned
from its record before any render (``from_record``, for the SHORTCUT step: the record proves the history, so
D's whole sequence matches, and the prompt's size is estimated); a conversation's first turn, nothing stored
(``first``: its size estimated); and the next turn like this one, for CAPTURE's question (``after_turn``).
From there the path is one (``decide``): the routing picks P and D; the engines' load (``reuse.load``: D's
step time and the KV its streams read, P's queue; a fact the fleet cannot give is left to the policy's
model, and the turn log says which and why); where D stands (``Seat``): whether the D routing picked holds
the conversation and has room for a decode-local turn (``reuse.room``: not when short of KV, ``decode_busy``,
whose idle conversations' freed blocks it evicts first; nor when requests wait on it longer than the turn
would wait at P, ``decode_queue``), or is another D than the one holding it (``decode_moved``: the turn runs
through P, pulling the old D's blocks where that pays); the facts the policy is told (``facts``); its
decision; the reason (``reason``, the one place it is chosen); and the ``Plan``. A handle that is not pulled
goes to P to be released, so D frees its blocks at once.

A conversation's first turn runs on D (``prefill_busy``) only where the policy finds that faster than P's
path (its queue, and the charge for the turns behind it) while prefills wait at P: at an idle P the P/D
split stands, even where D alone would be faster. After a turn (``after_turn``): D's new handle stays pinned
where a pull would use it on a next turn like this one (or as the policy's hedge), is released at once
where requests wait on D for blocks, and is otherwise left to D's prefix cache.
Transition: PLAN → PREFILL, or → DECODE for decode-local.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from turnkv.engine.base import HandleUse
from turnkv.gateway.services import Services
from turnkv.gateway.turn.direct import size_guess
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.results import AfterTurn, Ahead, Claimed, Plan, Rendered
from turnkv.gateway.writeback import room_for
from turnkv.openai.answer import echoed_answer
from turnkv.reuse import writeback as write_back
from turnkv.reuse.assess import Assessment, EngineView, Reason, assess, unpinned_reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts, pulled_tokens, transfer_s
from turnkv.reuse.decision import Decision, Keep
from turnkv.reuse.load import LoadFacts, load_facts
from turnkv.reuse.room import DecodeRoom, decode_room
from turnkv.routing.base import InstanceView
from turnkv.state.base import Claim
from turnkv.state.record import ConversationRecord


class Basis(enum.Enum):
    """What a plan is made from."""

    RENDERED = "rendered"  # the prompt's ids, checked against the claimed record
    RECORD = "record"  # before any render: the record proves the history; the prompt's size estimated
    FIRST = "first"  # a conversation's first turn, nothing stored; its size estimated
    NEXT = "next"  # after a turn: a next turn like it, for what becomes of D's new handle


@dataclass(frozen=True)
class Ask:
    """What the planner is asked about: the claimed record (None: nothing stored), what of D's sequence the
    prompt extends and why not more, and the prompt's length in tokens (rendered, or estimated)."""

    basis: Basis
    record: ConversationRecord | None
    match: Assessment
    prompt_tokens: int


@dataclass(frozen=True)
class Seat:
    """Where the D routing picked stands to the conversation: whether it is another D than the one holding
    it (``moved``), and whether it has room for the turn decode-local (``room``: weighed only where it could
    take the turn itself, its own prefix cache holding the conversation, or a first turn's whole prompt)."""

    decode: InstanceView | None
    moved: bool = False
    room: DecodeRoom | None = None

    @property
    def holds(self) -> bool:
        """D may take the turn decode-local (the policy still decides whether it should)."""
        return self.room is not None and self.room.ok


@dataclass(frozen=True)
class Told:
    """What the policy is told of a turn, and where its D stands."""

    seat: Seat
    facts: TurnFacts
    load: LoadFacts


# -- the entry points: what is known of the turn ---------------------------------------------------------
def check(svc: Services, turn: Turn, rendered: Rendered, claim: Claim | None) -> Assessment | None:
    """The token check of a rendered turn against its claimed record (None: nothing to check)."""
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
        return Assessment.whole(rec)  # the unchecked baseline believes the handle covers the prompt
    return a


def rendered(svc: Services, turn: Turn, claimed: Claimed, rendered: Rendered) -> Plan:
    """The plan for a rendered turn, or one whose render failed, or whose record could not be claimed."""
    if rendered.failure is not None:
        return Plan.plain(rendered.reason or Reason.RENDER_FAILED)  # the client hears why; logged with it
    rec, ids = claimed.record, rendered.prompt_ids
    a = check(svc, turn, rendered, claimed.claim)
    if a is None or ids is None:
        n = len(ids) if ids is not None else size_guess(turn.messages)
        return _unchecked(svc, rec, n, rendered.reason or claimed.reason)
    return decide(svc, Ask(Basis.RENDERED, rec, a, len(ids)))


def from_record(svc: Services, record: ConversationRecord, prompt_tokens: int) -> Plan:
    """The plan for a turn whose record proves its history (or whose policy checks no tokens), made before any
    render: D's whole sequence is taken to match, the prompt being ``prompt_tokens`` long, as estimated."""
    return decide(svc, Ask(Basis.RECORD, record, Assessment.whole(record), prompt_tokens))


def first(svc: Services, prompt_tokens: int) -> Plan:
    """The plan for a conversation's first turn, nothing stored, its prompt estimated at ``prompt_tokens``:
    decode-local (``prefill_busy``), or through P as plain P/D (``no_record``)."""
    return decide(svc, Ask(Basis.FIRST, None, Assessment(None, 0, False, Reason.NO_RECORD, False), prompt_tokens))


def _unchecked(svc: Services, rec: ConversationRecord | None, prompt_tokens: int, reason: Reason) -> Plan:
    """A turn with nothing to check (its render or the store failed): plain P/D on the engines routing picks,
    P preferring the conversation's; a claimed handle goes to P to be released when the render failed."""
    costs = svc.estimator.params()
    prefill = _pick_prefill(svc, rec, prompt_tokens, costs)
    decode = svc.router.pick("decode", prefer=rec.decode_url if rec else None)
    handle = rec.handle if rec is not None and reason is Reason.RENDER_FAILED else None
    return Plan(
        Action.RECOMPUTE,
        reason,
        prefill_url=prefill.url if prefill else None,
        decode_url=decode.url if decode else None,
        send=HandleUse.release(handle) if handle is not None else None,
    )


# -- the one decision path ---------------------------------------------------------------------------
def decide(svc: Services, ask: Ask) -> Plan:
    """Facts to plan: the routing picks, the engines' load, where D stands, the policy's decision, the reason."""
    costs = svc.estimator.params()
    rec = ask.record
    prefill = _pick_prefill(svc, rec, ask.prompt_tokens, costs)
    decode = svc.router.pick("decode", prefer=rec.decode_url if rec else None)
    told = tell(svc, ask, prefill, decode, costs)
    decision = svc.policy.decide(told.facts, costs)
    action, why = choose(ask, decision, told)
    return _built(svc, ask, action, why, decision, prefill, told, costs)


def tell(svc: Services, ask: Ask, prefill: InstanceView | None, decode: InstanceView | None, costs: CostParams) -> Told:
    """What the policy is told of a turn on ``prefill`` and ``decode``: the engines' load, where D stands, the
    facts."""
    load = turn_load(svc, prefill, decode, costs)
    seat = _seat(svc, ask, decode, load)
    f = facts(
        ask.record,
        prompt_tokens=ask.prompt_tokens,
        matched=ask.match.tokens,
        prefill=prefill,
        decode=decode,
        decode_holds=seat.holds,
        block_size=svc.settings.block_size,
        load=load,
    )
    return Told(seat, f, load)


def _seat(svc: Services, ask: Ask, decode: InstanceView | None, load: LoadFacts) -> Seat:
    rec = ask.record
    if decode is None:
        return Seat(None)
    if ask.basis is not Basis.FIRST and (rec is None or not ask.match.releasable):
        return Seat(decode)  # nothing of D's may serve the turn
    if rec is not None and decode.url != rec.decode_url:
        return Seat(decode, moved=True)  # routing chose another D than the conversation's, by load
    return Seat(decode, room=room(svc, decode, load))


def choose(ask: Ask, decision: Decision, told: Told) -> tuple[Action, Reason]:
    """The action the plan takes and why: the policy's, but a pull of nothing is a recompute, and a first
    turn runs on D only while prefills wait at P (P/D's split stands while P keeps up)."""
    if ask.basis is Basis.FIRST:
        f = told.facts
        if decision.action is Action.DECODE_LOCAL and (f.prefill_waiting or f.prefill_queue_ms):
            return Action.DECODE_LOCAL, Reason.PREFILL_BUSY
        return Action.RECOMPUTE, ask.match.reason
    action = decision.action
    if action is Action.PULL and (ask.record is None or ask.record.handle is None):
        action = Action.RECOMPUTE
    return action, reason(ask, action, decision, told.seat)


def reason(ask: Ask, action: Action, decision: Decision, seat: Seat) -> Reason:
    """Why the turn runs as it does: the one place a turn's reason is chosen (a first turn's: ``choose``)."""
    if action is Action.DECODE_LOCAL:
        return decision.reason or Reason.DECODE_LOCAL
    if decision.reason is not None:
        return decision.reason  # the policy declined usable KV, and says why
    if action is Action.RECOMPUTE and seat.room is not None and seat.room.reason is not None:
        return seat.room.reason  # D would have taken it, but is short of KV or its queue is longer than P's
    if seat.moved:
        return Reason.DECODE_MOVED  # routing chose another D than the conversation's, by load
    rec = ask.record
    if action is Action.RECOMPUTE and rec is not None and rec.handle is None and ask.match.full:
        return unpinned_reason(rec)  # D's KV matched, but its handle was given back
    return ask.match.reason


def _built(
    svc: Services,
    ask: Ask,
    action: Action,
    why: Reason,
    decision: Decision,
    prefill: InstanceView | None,
    told: Told,
    costs: CostParams,
) -> Plan:
    """The plan: one construction for every basis."""
    f, seat = told.facts, told.seat
    local, checks = action is Action.DECODE_LOCAL, svc.policy.checks_tokens
    pulled = pulled_tokens(costs, f) if action is Action.PULL else 0
    ahead = _ahead(ask.basis, action, checks)
    return Plan(
        action,
        why,
        prefill_url=prefill.url if prefill else None,
        decode_url=_decode_url(ask.record, seat, local),
        send=_send(ask, action),
        pull_tokens=pulled,
        expected_cached=f.decode_cached_tokens if local else f.prefill_cached_tokens + pulled,
        planned_tokens=0 if ask.basis is Basis.RENDERED else ask.prompt_tokens,
        local_new_tokens=f.prompt_tokens - f.decode_cached_tokens if local else 0,
        estimates=estimates_ms(decision),
        charges=charges_ms(decision),
        load={**told.load.log(), **({"decode_room": seat.room.log()} if seat.room is not None else {})},
        assessment=_assessment(ask, checks),
        direct=local and ask.basis is not Basis.RENDERED,
        # a pull ahead of the check is salted apart in P's cache: it finds nothing there
        expect_hits=0 if local or ahead is Ahead.CHECKED else _expect_hits(ask.record, prefill, svc),
        ahead=ahead,
    )


def _ahead(basis: Basis, action: Action, checks: bool) -> Ahead | None:
    """How a pull or recompute planned from the record stands to the token check (None: rendered, or not
    through P)."""
    if basis is not Basis.RECORD or action is Action.DECODE_LOCAL:
        return None
    return Ahead.CHECKED if action is Action.PULL and checks else Ahead.SKIPPED


def _assessment(ask: Ask, checks: bool) -> Assessment | None:
    """What the plan says the token check found: the check's result; for a plan from the record, what the
    unchecked baselines believe (a checking policy's check is still to run: ``Plan.checked``)."""
    if ask.basis is Basis.RENDERED or (ask.basis is Basis.RECORD and not checks):
        return ask.match
    return None


def _decode_url(rec: ConversationRecord | None, seat: Seat, local: bool) -> str | None:
    if local and rec is not None:
        return rec.decode_url  # D's own cache holds the conversation
    return seat.decode.url if seat.decode is not None else None


def _send(ask: Ask, action: Action) -> HandleUse | None:
    """What P gets of the stored handle: pulled as far as it matches, or released (P frees it at D on the
    way); none for a decode-local turn (D's own cache serves it; CAPTURE releases the claimed handle)."""
    rec = ask.record
    if rec is None or rec.handle is None:
        return None
    if action is Action.PULL:
        return HandleUse(rec.handle, ask.match.tokens)
    if action is Action.RECOMPUTE and ask.match.releasable:
        return HandleUse.release(rec.handle)
    return None


def _expect_hits(rec: ConversationRecord | None, prefill: InstanceView | None, svc: Services) -> int:
    """The tokens P should find in its prefix cache, for the cache-factor measurement: the last prompt, where
    P computed it."""
    if rec is None or prefill is None or prefill.url != rec.prefill_url:
        return 0
    bs = svc.settings.block_size
    return (prefill_holds(rec) // bs) * bs


# -- after the turn -------------------------------------------------------------------------------------
_AFTER = {Keep.PULL: AfterTurn.PIN, Keep.HEDGE: AfterTurn.HEDGE, Keep.NOT_NEEDED: AfterTurn.LET_GO}


def after_turn(svc: Services, rec: ConversationRecord, claimed: ConversationRecord | None) -> AfterTurn:
    """What becomes of the new handle in ``rec`` once its turn is answered (``claimed``: the record the turn
    continued). ``decode_memory.pin: always`` keeps it. Otherwise the policy says whether it is worth its
    pinned bytes until a next turn like this one (``keeps_pin``), told the same facts as a turn's plan, on the
    conversation's own P and D; and ``reuse.writeback`` whether it goes to P's prefix cache instead (D's pin
    freed), stays pinned, or is let go. Where D is short of KV or requests wait on it, nothing stays pinned:
    written back where P can take it, else released at once where turns wait for blocks its pins hold
    (``decode_crowded``: plain P/D, which pins nothing, serves them first), else let go."""
    if svc.settings.decode_memory.pin == "always":
        return AfterTurn.PIN
    decode = svc.fleet.view(rec.decode_url)
    crowded = decode is not None and svc.pins.crowded(decode, rec.num_tokens)
    costs = svc.estimator.params()
    prefill = svc.fleet.view(rec.prefill_url)
    ask = Ask(Basis.NEXT, rec, Assessment.whole(rec), rec.num_tokens + _next_new_tokens(svc, rec, claimed))
    told = tell(svc, ask, prefill, decode, costs)
    keep = svc.policy.keeps_pin(told.facts, costs)
    pressed = crowded or (decode is not None and _decode_pressed(svc, decode))
    lacks = write_back_lacks(svc, rec, prefill)
    wb = svc.settings.write_back
    choice = write_back.after_turn(
        write_back.AfterFacts(
            keep=keep,
            decode_pressed=pressed,
            has_prefill=prefill is not None and prefill.routable,
            prefill_kv_usage=room_for(prefill, lacks) if prefill is not None else 1.0,
            prefill_cache_factor=prefill.cache_factor if prefill is not None else 0.0,
            transfer_s=transfer_s(costs, lacks, svc.settings.block_size),
            think_s=svc.write_backs.think.quantile(),
        ),
        write_back.AfterParams(wb.mode, wb.prefill_max_kv_usage, wb.min_cache_factor),
    ).choice
    if choice is write_back.AfterChoice.WRITE_BACK:
        return AfterTurn.WRITE_BACK
    if choice is write_back.AfterChoice.KEEP:
        return _AFTER[keep]
    return AfterTurn.DECODE_CROWDED if crowded else AfterTurn.LET_GO


def _decode_pressed(svc: Services, decode: InstanceView) -> bool:
    """D short of KV now, or requests waiting on it (other clients' as last read, or turns held for room)."""
    dm = svc.settings.decode_memory
    return decode.kv_usage_now >= dm.pressure_kv_usage or decode.waiting_now > 0 or svc.admission.queued(decode.url) > 0


def write_back_lacks(svc: Services, rec: ConversationRecord, prefill: InstanceView | None) -> int:
    """Tokens of the record's sequence the P it would be written back to likely lacks: all past what it
    computed for the turn and still caches (``likely_prefill_cached``)."""
    return max(0, rec.num_tokens - likely_prefill_cached(rec, prefill, svc.settings.block_size))


def _next_new_tokens(svc: Services, rec: ConversationRecord, claimed: ConversationRecord | None) -> int:
    """The next turn's new part, guessed: as much as this turn added, else an eighth of its prompt."""
    grown = rec.prompt_tokens - claimed.num_tokens if claimed is not None else rec.prompt_tokens // 8
    return max(svc.settings.block_size, grown)


# -- what the policy is told ------------------------------------------------------------------------------
def room(svc: Services, decode: InstanceView, load: LoadFacts) -> DecodeRoom:
    """Whether ``decode`` has room for a decode-local turn (``reuse.room``): its KV usage, the turns the
    gateway holds for room on it (``decode_admission``: D's queue all the same), its queue against P's (with
    ``decode_memory.local_queue: refuse``, against none: any request waiting on D refuses the turn)."""
    dm = svc.settings.decode_memory
    return decode_room(
        kv_usage=decode.kv_usage_now,
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


def prefill_holds(rec: ConversationRecord) -> int:
    """Tokens of the conversation its P was given: the last prompt it computed, or, written back, the whole
    sequence D held."""
    return rec.num_tokens if rec.unpinned == "write_back" else rec.prompt_tokens


def likely_prefill_cached(rec: ConversationRecord | None, prefill: InstanceView | None, block_size: int) -> int:
    """Prompt tokens the chosen P likely still caches: what it was given of the conversation if it served the
    last turn (``prefill_holds``); how much of that survives there is measured (``InstanceView.cache_factor``)."""
    if rec is None or prefill is None or prefill.url != rec.prefill_url:
        return 0
    bs = block_size
    return int((prefill_holds(rec) // bs) * bs * prefill.cache_factor) // bs * bs


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
        decode_busy=load.decode_running,
        # for the ITL budget: D's decode batch and how full its KV is, now (``reuse.load``)
        decode_running=load.decode_running if decode is not None else None,
        decode_kv_usage=load.decode_kv_usage if decode is not None and load.decode_kv_usage > 0 else None,
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
