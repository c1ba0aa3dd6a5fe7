"""What a reuse policy answers for a turn, and the shape every policy has.

``Decision``: the action (pull, recompute, decode-local), the reason where the policy declines usable KV, and
the estimates and charges it weighed (logged with the turn). ``Keep``: whether a turn's new handle stays
pinned for the next turn, and why. ``ReusePolicy``: what the planner asks of a policy
(``reuse.policies`` registers them by name).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts


class Keep(enum.StrEnum):
    """Whether a turn's new handle stays pinned for the next turn, and why (CAPTURE logs and counts it)."""

    PULL = "pull"  # the policy would pull it on a next turn like this one
    # it would not now (D would take the turn, or P's cache would hold the history), but should D not take
    # the next turn and P's cache have lost the history, pulling it beats P recomputing it all
    HEDGE = "hedge"
    NOT_NEEDED = "not_needed"  # recomputing on P is as fast either way: no pull would use it

    @property
    def kept(self) -> bool:
        return self is not Keep.NOT_NEEDED


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason | None = None  # set when the policy declines usable KV
    estimates: Mapping[Action, float] = field(default_factory=dict)  # TTFT per action (s)
    charges: Mapping[Action, float] = field(default_factory=dict)  # P's compute x the turns behind it (s)


def cheapest(est: Mapping[Action, float], charges: Mapping[Action, float] | None = None) -> Action:
    """The action with the lowest estimate plus charge (recompute among equals)."""
    c = charges or {}
    return min(est, key=lambda a: (est[a] + c.get(a, 0.0), a != Action.RECOMPUTE))


class ReusePolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def checks_tokens(self) -> bool: ...

    @property
    def may_decode_local(self) -> bool: ...

    @property
    def may_decode_local_first(self) -> bool:
        """Whether a conversation's first turn may be asked about decode-local (``decide``) at all."""

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision: ...

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        """Whether a handle is worth its pinned bytes, and why: a pull could use it on a next turn like
        ``facts`` (a handle only a pull can use; decode-local and recompute do without it)."""


class PolicyParams(BaseModel):
    """A policy's parameters: validated at start, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
