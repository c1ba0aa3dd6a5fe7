"""Reuse policies: given what D's KV can offer a turn, pull it, recompute, or go decode-local.

Each policy is a small class with a pure ``decide``; they are registered by name and take their
parameters as a pydantic model, validated at start. ``adaptive`` (the default) picks the action
with the lowest estimated time to first token; the fixed ones are the benchmark baselines.
``always-reuse-unchecked`` skips the token check, as vLLM's example proxy does: it exists to show
in tests and benchmarks what that costs, and must not serve users.

    policy:
      name: adaptive
      params: {decode_local: true, decode_local_max_stall_ms: 150, margin: 0.0}

Decode-local is bounded by what it costs the streams already running on that D: while D prefills
the turn, their next tokens wait. The estimated prefill time is that stall; above
``decode_local_max_stall_ms`` (or above ``decode_local_max_busy`` streams) the turn goes through P.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnkv.config import ConfigError
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts, estimate, prefill_s


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason | None = None  # set when the policy declines usable KV
    estimates: Mapping[Action, float] = field(default_factory=dict)


class ReusePolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def checks_tokens(self) -> bool: ...

    @property
    def may_decode_local(self) -> bool: ...

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision: ...

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        """Whether a handle is worth its pinned bytes: the policy would pull it on a next turn like
        ``facts`` (a handle only a pull can use; decode-local and recompute do without it)."""


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdaptiveParams(_Params):
    decode_local: bool = True
    decode_local_max_new_tokens: int = Field(8192, ge=0, description="larger deltas always go through P")
    decode_local_max_stall_ms: float = Field(
        150.0, ge=0, description="longest estimated prefill D may run for one turn (its streams wait that long)"
    )
    decode_local_max_busy: int = Field(64, ge=0, description="streams on D above which D is not asked to prefill")
    margin: float = Field(0.0, ge=0, description="pull only when it beats recompute by this fraction")


class AdaptivePolicy:
    name = "adaptive"
    checks_tokens = True

    def __init__(self, params: AdaptiveParams) -> None:
        self.p = params
        self.may_decode_local = params.decode_local

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        new = facts.prompt_tokens - facts.decode_cached_tokens
        local_ok = (
            self.p.decode_local
            and facts.decode_local_possible
            and new <= self.p.decode_local_max_new_tokens
            and facts.decode_busy <= self.p.decode_local_max_busy
            and prefill_s(costs, new, facts.decode_cached_tokens) * 1e3 <= self.p.decode_local_max_stall_ms
        )
        est = estimate(costs, TurnFacts(**{**facts.__dict__, "decode_local_possible": local_ok}))
        if Action.PULL in est:
            est[Action.PULL] *= 1.0 + self.p.margin
        best = min(est, key=lambda a: (est[a], a != Action.RECOMPUTE))
        if best is Action.RECOMPUTE and facts.reusable_tokens > 0:
            return Decision(best, Reason.CHEAPER_TO_RECOMPUTE, est)
        if best is Action.DECODE_LOCAL:
            return Decision(best, Reason.DECODE_LOCAL, est)
        return Decision(best, None, est)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        # decode-local now: the next turn most likely too, from D's own prefix cache. Otherwise keep
        # the pin only where a pull would beat recomputing, whatever D's load allows then.
        if self.decide(facts, costs).action is Action.DECODE_LOCAL:
            return False
        no_local = TurnFacts(**{**facts.__dict__, "decode_local_possible": False})
        return self.decide(no_local, costs).action is Action.PULL


class FixedParams(_Params):
    pass


class AlwaysPullPolicy:
    name = "always-pull"
    checks_tokens = True
    may_decode_local = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.PULL if facts.reusable_tokens > 0 else Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        return True


class NeverPullPolicy:
    name = "never-pull"
    checks_tokens = True
    may_decode_local = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE if facts.reusable_tokens > 0 else None)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        return False


class DecodeLocalPolicy:
    name = "decode-local"
    checks_tokens = True
    may_decode_local = True

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        if facts.decode_local_possible:
            return Decision(Action.DECODE_LOCAL, Reason.DECODE_LOCAL)
        return Decision(Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        return False


class UncheckedPolicy:
    """Pulls D's whole handle whenever there is one, without looking at the tokens. Unsafe."""

    name = "always-reuse-unchecked"
    checks_tokens = False
    may_decode_local = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.PULL if facts.reusable_tokens > 0 else Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> bool:
        return True


_REGISTRY: dict[str, tuple[type[_Params], Callable[[Any], ReusePolicy]]] = {
    "adaptive": (AdaptiveParams, AdaptivePolicy),
    "always-pull": (FixedParams, AlwaysPullPolicy),
    "never-pull": (FixedParams, NeverPullPolicy),
    "decode-local": (FixedParams, DecodeLocalPolicy),
    "always-reuse-unchecked": (FixedParams, UncheckedPolicy),
}

POLICY_NAMES = tuple(_REGISTRY)


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> ReusePolicy:
    try:
        model, factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)}") from None
    try:
        return factory(model.model_validate(dict(params or {})))
    except ValidationError as exc:
        raise ConfigError(f"policy {name}: {exc}") from exc
