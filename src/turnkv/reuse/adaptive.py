"""The ``adaptive`` reuse policy: the action with the lowest estimated time to first token, within what it
costs D's running streams and the turns queued at P.

Decode-local is bounded by what it costs the streams already running on that D: while D prefills
the turn, their next tokens wait. Above ``decode_local_max_stall_ms`` of estimated prefill (or above
``decode_local_max_busy`` streams) the turn goes through P; not so with D prefilling in chunks
(``decode_chunk_tokens``): its streams then wait a chunk a step, which the ITL checks below bound, and the
estimate prices the prefill's many steps. A conversation's first turn may run decode-local too
(``decode_local_first``, the gateway's ``plan.first``): D prefills its whole prompt, as colocated serving
does, where P's queue and its charge make P's path the slower. With an ITL budget (the turn's
``itl_budget_ms`` fact, else the ``itl_budget_ms`` parameter; set it to the TPOT SLO), decode-local is
also refused when D's step time now plus what the turn's prefill adds to a step (chunked: each step
that carries a chunk is that much longer for every running stream) would exceed the budget while any
stream runs there: the reason is then ``itl_budget``. Relative to D's own step, ``itl_headroom`` (on by
default, 0.10) refuses a decode-local turn whose prefill would lengthen D's step by more than that share of
D's step without it (measured, else estimated), with the chunks of the other decode-local turns this gateway
has prefilling on that D (``TurnFacts.decode_prefills``) in the same step: the reason is ``itl_headroom``.
TTFT is never bought with the ITL of others. Where P and D share a GPU (two engines on one device, as on the
project's H200: the deployment's setting ``shared_gpu``, a turn fact here), P's prefill slows D's steps as
much as D's own: refusing decode-local then spares D's streams nothing unless the path through P prefills
less than D would (D's cache lost the history, P's holds it), and only then do the ITL checks refuse it; a
turn they would have refused says ``shared_gpu``. On the H200 with the checks applied as for separate GPUs,
every later turn went through P and waited behind its first turns (BENCHMARKS.md 8).
A D run with ``--long-prefill-token-threshold`` (``decode_chunk_tokens``) takes a turn's prefill a few
tokens a step: each step then grows by little (within the tokens a step computes for free, it is only
the chunk's attention), and the turn's first token comes a few steps later. Where D's KV is crowded
(``decode_cache_max_usage``), its prefix cache has likely evicted the conversation: decode-local is
then costed as prefilling the whole prompt on D. Requests waiting on D (``decode_queue_ms``) delay a
decode-local turn by D's whole queue, a turn through P only by what is left of it once P's queue is waited
(``reuse.cost.estimate``): where that alone turns the choice to P, the reason is ``decode_queue``.

A turn's TTFT is not all that an action costs: where prefills wait at P (``TurnFacts.prefill_waiting``),
the P compute an action adds (``reuse.cost.prefill_work``: a recompute the whole uncached history, a pull
only what is past the pulled blocks, decode-local nothing) delays every turn that comes to P behind it
before P's queue drains. The policy takes about as many to come as wait there now (``prefill_crowding``
per waiting prefill, 1.0 by default) and charges each action its P compute that many times over
(``Decision.charges``, logged beside the estimates). Minimising each turn's own TTFT alone, a saturated P
recomputed histories a pull would have spared it (vLLM's multi-turn proxy, which always pulls, had twice
adaptive's goodput there: docs/history.md). At an idle P nothing is charged.

``keeps_pin`` says whether a turn's new handle stays pinned for the next turn (``Keep``): ``pull`` where a
next turn like this one would pull it; ``hedge`` where it would not (D would take it, or P's cache hold the
history) but a pull beats P recomputing the history should D not take the turn and P's cache have lost it
(``keep_hedge``, on by default: under load both happen, and without the handle the turn recomputes the whole
history on P); else ``not_needed``. What hedges hold is bounded by D's pin budget and the crowded rule
(``gateway.pins``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pydantic import Field

from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import (
    Action,
    CostParams,
    TurnFacts,
    decode_step_now_s,
    estimate,
    prefill_s,
    prefill_work,
    step_added_s,
)
from turnkv.reuse.decision import Decision, Keep, PolicyParams, cheapest


def decode_step_now_ms(facts: TurnFacts, costs: CostParams) -> float:
    """D's step time now, without this turn (ms; ``reuse.cost.decode_step_now_s``)."""
    if facts.decode_step_ms is not None:
        return facts.decode_step_ms  # as measured, not through seconds and back
    return decode_step_now_s(costs, facts) * 1e3


def step_added_ms(facts: TurnFacts, costs: CostParams) -> float:
    """What the longest step that prefills this turn adds to D's step (ms): the turn's chunk, and those of
    the other decode-local turns prefilling on D now (``TurnFacts.decode_prefills``) in the same step."""
    added, _ = step_added_s(
        costs,
        facts.running,
        facts.prompt_tokens - facts.decode_cached_tokens,
        facts.decode_cached_tokens,
        facts.decode_prefills,
        facts.decode_prefill_tokens,
    )
    return added * 1e3


@dataclass(frozen=True)
class _Weighed:
    """The actions weighed for a turn: each one's TTFT estimate and its charge, and the best of them."""

    facts: TurnFacts
    costs: CostParams
    estimates: dict[Action, float]
    charges: dict[Action, float]
    best: Action


class AdaptiveParams(PolicyParams):
    decode_local: bool = Field(True, description="turns may run on the D that holds the conversation")
    decode_local_max_new_tokens: int = Field(
        8192, ge=0, description="larger deltas always go through P (unless D prefills in chunks)"
    )
    decode_local_max_stall_ms: float = Field(
        150.0,
        ge=0,
        description="longest estimated prefill D may run for one turn (its streams wait that long); not applied "
        "when D prefills in chunks (decode_chunk_tokens): the ITL checks bound what a chunk adds to a step",
    )
    decode_local_first: bool = Field(
        False,
        description="a conversation's first turn (nothing stored) may run on D too, its whole prompt prefilled "
        "there as colocated serving does, where P's load (its queue, the charge for it) makes P's path the "
        "slower, within D's room and ITL checks (reason prefill_busy); false: first turns always go through P",
    )
    decode_local_max_busy: int = Field(64, ge=0, description="streams on D above which D is not asked to prefill")
    itl_budget_ms: float | None = Field(
        None,
        gt=0,
        description="longest ITL D's running streams may see in a step that also prefills a decode-local "
        "turn (D's step now plus the turn's chunk); the TPOT SLO. Used when the turn's facts carry none; "
        "none: no ITL check",
    )
    itl_headroom: float | None = Field(
        0.10,
        ge=0,
        description="how much longer than D's decode step alone (measured, else estimated) a step that also "
        "prefills a decode-local turn may be, with the chunks of the other decode-local turns prefilling on D "
        "counted (0.10: 10%); none: no relative check (itl_budget_ms still applies)",
    )
    keep_hedge: bool = Field(
        True,
        description="keep a turn's handle pinned also where the next turn would likely not pull it (D would "
        "take it, or P's cache hold the history) but a pull would beat P recomputing the whole history, should "
        "D not take it and P's cache have lost it; false: only where the policy would pull it",
    )
    decode_cache_max_usage: float | None = Field(
        None,
        gt=0,
        le=1,
        description="D's KV usage above which its prefix cache is taken to have lost the "
        "conversation (decode-local would prefill it all again); none: D's cache is taken to hold it",
    )
    decode_kv_tokens: int | None = Field(
        None,
        gt=0,
        description="D's KV capacity in tokens, to estimate its usage (running streams times this "
        "prompt's length) when the turn's facts carry none",
    )
    prefill_queue_ms: float | None = Field(
        None,
        ge=0,
        description="how long a turn waits at P before its prefill, when the turn's facts do not "
        "say (P is shared: its first turns queue the others); none: 0, an idle P",
    )
    decode_chunk_tokens: int | None = Field(
        None,
        ge=0,
        description="D's --long-prefill-token-threshold (the most tokens of one prefill per step); "
        "none: the cost model's (0: one chunk of what the token budget leaves)",
    )
    margin: float = Field(0.0, ge=0, description="pull only when it beats recompute by this fraction")
    prefill_crowding: float = Field(
        1.0,
        ge=0,
        description="turns taken to queue behind a turn's P compute per prefill waiting at P now: each action "
        "is charged its P compute times this times the prefills there (0: each turn minimises its own TTFT)",
    )


class AdaptivePolicy:
    name = "adaptive"
    checks_tokens = True

    def __init__(self, params: AdaptiveParams) -> None:
        self.p = params
        self.may_decode_local = params.decode_local
        self.may_decode_local_first = params.decode_local and params.decode_local_first

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        facts, costs = self._as_seen(facts, costs)
        # D's prefill of the turn, were it decode-local
        local_s = prefill_s(costs, facts.prompt_tokens - facts.decode_cached_tokens, facts.decode_cached_tokens)
        local_ok = self._may_go_local(facts, costs, local_s)
        itl_why = self.itl_refusal(facts, costs) if local_ok else None
        work = prefill_work(costs, facts)
        w = self._weighed(replace(facts, decode_local_possible=local_ok and itl_why is None), costs, work)
        # on a shared GPU the path through P costs D's streams at least as much: refusing spares them nothing
        if itl_why is not None and facts.shared_gpu and local_s <= work[w.best]:
            itl_why = None
            w = self._weighed(replace(facts, decode_local_possible=True), costs, work)
            if w.best is Action.DECODE_LOCAL:  # taken where the ITL checks alone would have refused it
                return Decision(w.best, Reason.SHARED_GPU, w.estimates, w.charges)
        return Decision(w.best, self._why(w, itl_why, local_ok=local_ok), w.estimates, w.charges)

    def _as_seen(self, facts: TurnFacts, costs: CostParams) -> tuple[TurnFacts, CostParams]:
        """The facts and costs as this policy's parameters say to see them: D's chunk size, P's queue where
        the turn's facts do not say it, and D's cache taken to have lost the conversation where its KV is
        crowded."""
        if self.p.decode_chunk_tokens is not None:
            costs = replace(costs, decode_chunk_tokens=self.p.decode_chunk_tokens)
        if facts.prefill_queue_ms is None and self.p.prefill_queue_ms is not None:
            facts = replace(facts, prefill_queue_ms=self.p.prefill_queue_ms)
        usage = self.kv_usage(facts)
        if usage is not None and self.p.decode_cache_max_usage is not None and usage > self.p.decode_cache_max_usage:
            # D's running streams crowd its KV: the conversation's cached blocks have likely been evicted
            facts = replace(facts, decode_cached_tokens=0)
        return facts, costs

    def _may_go_local(self, facts: TurnFacts, costs: CostParams, local_s: float) -> bool:
        """Whether D may prefill the turn at all: decode-local is on, D holds the conversation and runs few
        enough streams, and (unless it prefills in chunks, which the ITL checks bound, and whose many steps
        the estimate prices) the turn's prefill would stall D's streams little enough."""
        if not (self.p.decode_local and facts.decode_local_possible):
            return False
        if facts.decode_busy > self.p.decode_local_max_busy:
            return False
        if costs.decode_chunk_tokens > 0:
            return True
        new = facts.prompt_tokens - facts.decode_cached_tokens
        return new <= self.p.decode_local_max_new_tokens and local_s * 1e3 <= self.p.decode_local_max_stall_ms

    def _weighed(self, facts: TurnFacts, costs: CostParams, work: Mapping[Action, float]) -> _Weighed:
        est = self.estimates(facts, costs)
        charges = self.charges(facts, work)
        return _Weighed(facts, costs, est, charges, cheapest(est, charges))

    def _why(self, w: _Weighed, itl_why: Reason | None, *, local_ok: bool) -> Reason | None:
        """Why the policy's action is not the fastest for the turn alone, or declines D's usable KV."""
        facts, best = w.facts, w.best
        if itl_why is not None:
            local = estimate(w.costs, replace(facts, decode_local_possible=True))
            if local[Action.DECODE_LOCAL] < w.estimates[best] + w.charges.get(best, 0.0):
                return itl_why  # decode-local would have won: the ITL check said no
        elif local_ok and best is not Action.DECODE_LOCAL and facts.decode_queue_ms:
            unqueued = self.estimates(replace(facts, decode_queue_ms=0.0), w.costs)
            if cheapest(unqueued, w.charges) is Action.DECODE_LOCAL:
                return Reason.DECODE_QUEUE  # decode-local would have won but for D's queue
        if best is Action.RECOMPUTE and facts.reusable_tokens > 0:
            return Reason.CHEAPER_TO_RECOMPUTE
        if best is Action.DECODE_LOCAL:
            return Reason.DECODE_LOCAL
        return None

    def charges(self, facts: TurnFacts, work: Mapping[Action, float]) -> dict[Action, float]:
        """What each action's P compute costs the turns that will queue behind it at P (s): that compute
        (``work``, ``reuse.cost.prefill_work``) times ``prefill_crowding`` per prefill waiting there now; none
        at an idle P."""
        behind = self.p.prefill_crowding * facts.prefill_waiting
        if behind <= 0:
            return {}
        return {a: w * behind for a, w in work.items()}

    def estimates(self, facts: TurnFacts, costs: CostParams) -> dict[Action, float]:
        """The TTFT estimates, a pull's with the policy's margin."""
        est = estimate(costs, facts)
        if Action.PULL in est:
            est[Action.PULL] *= 1.0 + self.p.margin
        return est

    def kv_usage(self, facts: TurnFacts) -> float | None:
        """D's KV usage: as measured, else estimated from its running streams (each about this long)."""
        if facts.decode_kv_usage is not None:
            return facts.decode_kv_usage
        if self.p.decode_kv_tokens is None:
            return None
        return facts.running * facts.prompt_tokens / self.p.decode_kv_tokens

    def itl_refusal(self, facts: TurnFacts, costs: CostParams) -> Reason | None:
        """Why D's running streams would not stay within their ITL while D prefills this turn (None: they
        would, or no stream runs there): the step that carries the turn's chunk (and those of the other
        decode-local turns prefilling on D) past the budget (``itl_budget``), or longer than D's decode
        step alone by more than the headroom (``itl_headroom``)."""
        if facts.running <= 0:
            return None
        budget = facts.itl_budget_ms if facts.itl_budget_ms is not None else self.p.itl_budget_ms
        step, added = decode_step_now_ms(facts, costs), step_added_ms(facts, costs)
        if budget is not None and step + added > budget:
            return Reason.ITL_BUDGET
        if self.p.itl_headroom is not None and added > self.p.itl_headroom * step:
            return Reason.ITL_HEADROOM
        return None

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        # a pull on a next turn like this one: keep. Otherwise D would likely take it (decode-local, from
        # its own prefix cache) or P recompute it from its cache; but under load D may not have room then,
        # and P's cache may have lost the history: keep it as a hedge where a pull beats P recomputing the
        # whole history (the pin budget and the crowded rule bound what hedges hold).
        now = self.decide(facts, costs).action
        if now is Action.PULL:
            return Keep.PULL
        no_local = replace(facts, decode_local_possible=False)
        if not self.p.keep_hedge:  # without the hedge: none after a turn D would take itself
            if now is Action.DECODE_LOCAL or self.decide(no_local, costs).action is not Action.PULL:
                return Keep.NOT_NEEDED
            return Keep.PULL
        for f in (no_local, replace(no_local, prefill_cached_tokens=0)):
            if self.decide(f, costs).action is Action.PULL:
                return Keep.HEDGE
        return Keep.NOT_NEEDED
