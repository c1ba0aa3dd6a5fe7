"""Reuse policies: given what D's KV can offer a turn, pull it, recompute, or go decode-local.

Each policy is a small class with a pure ``decide``; they are registered by name and take their
parameters as a pydantic model, validated at start. ``adaptive`` (the default) picks the action
with the lowest estimated time to first token, P's compute charged for the turns that will wait behind it
(``reuse.adaptive``); the fixed ones here are the benchmark baselines.
``always-reuse-unchecked`` skips the token check, as vLLM's example proxy does: it exists to show
in tests and benchmarks what that costs, and must not serve users. ``vllm-multiturn`` is vLLM's
multi-turn proxy (``disagg_proxy_multiturn.py``) as a policy: it hands P the conversation's previous
handle on every turn, unchecked, and P pulls it unless the pull is below ``kv_recompute_threshold``;
like ``always-reuse-unchecked`` it is wrong on templates that strip reasoning or rewrite history
(positions shift and the answer is silently wrong), and is a benchmark baseline only.

    policy:
      name: adaptive
      params: {decode_local: true, decode_local_max_stall_ms: 150, itl_budget_ms: 30, itl_headroom: 0.1, margin: 0.0}

What a policy answers (``Decision``, ``Keep``) and the shape it has (``ReusePolicy``): ``reuse.decision``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from turnkv.errors import ConfigError
from turnkv.reuse.adaptive import AdaptiveParams, AdaptivePolicy
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts, pulled_tokens
from turnkv.reuse.decision import Decision, Keep, PolicyParams, ReusePolicy


class FixedParams(PolicyParams):
    pass


class AlwaysPullPolicy:
    name = "always-pull"
    checks_tokens = True
    may_decode_local = False
    may_decode_local_first = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.PULL if facts.reusable_tokens > 0 else Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.PULL


class NeverPullPolicy:
    name = "never-pull"
    checks_tokens = True
    may_decode_local = False
    may_decode_local_first = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE if facts.reusable_tokens > 0 else None)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.NOT_NEEDED


class DecodeLocalPolicy:
    name = "decode-local"
    checks_tokens = True
    may_decode_local = True
    may_decode_local_first = False  # a baseline of later turns: first turns go through P

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        if facts.decode_local_possible:
            return Decision(Action.DECODE_LOCAL, Reason.DECODE_LOCAL)
        return Decision(Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.NOT_NEEDED


class UncheckedPolicy:
    """Pulls D's whole handle whenever there is one, without looking at the tokens. Unsafe."""

    name = "always-reuse-unchecked"
    checks_tokens = False
    may_decode_local = False
    may_decode_local_first = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        return Decision(Action.PULL if facts.reusable_tokens > 0 else Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.PULL


class VllmMultiturnPolicy:
    """vLLM's multi-turn proxy (``disagg_proxy_multiturn.py``): every turn hands P the previous handle,
    unchecked, and P pulls it unless that is below ``kv_recompute_threshold``; never decode-local.
    Unsafe on templates that strip reasoning or rewrite history. A benchmark baseline."""

    name = "vllm-multiturn"
    checks_tokens = False
    may_decode_local = False
    may_decode_local_first = False

    def __init__(self, params: FixedParams) -> None:
        pass

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        if facts.reusable_tokens > 0 and pulled_tokens(costs, facts) > 0:
            return Decision(Action.PULL)
        return Decision(Action.RECOMPUTE)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.PULL  # the proxy keeps every handle until the next turn takes it (or its TTL)


# the one place where policy names map to their parameter models and factories
POLICIES: dict[str, tuple[type[PolicyParams], Callable[[Any], ReusePolicy]]] = {
    "adaptive": (AdaptiveParams, AdaptivePolicy),
    "always-pull": (FixedParams, AlwaysPullPolicy),
    "never-pull": (FixedParams, NeverPullPolicy),
    "decode-local": (FixedParams, DecodeLocalPolicy),
    "always-reuse-unchecked": (FixedParams, UncheckedPolicy),
    "vllm-multiturn": (FixedParams, VllmMultiturnPolicy),
}

POLICY_NAMES = tuple(POLICIES)  # the built-in ones


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> ReusePolicy:
    try:
        model, factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    try:
        return factory(model.model_validate(dict(params or {})))
    except ValidationError as exc:
        raise ConfigError(f"policy {name}: {exc}") from exc
