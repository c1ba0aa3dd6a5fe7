"""``Router``: a routing profile, built from its plugins, run over one snapshot of the engines per pick.

Profiles are named (``settings.routing``): the built-in ``affinity`` (the default: the engine that holds
the conversation unless it is much busier than the least loaded, else the least loaded, in turn among
equals), ``least-loaded`` and ``round-robin`` (benchmark baselines that ignore the conversation), or
one of ``settings.routing_profiles``. Every built-in keeps the same filters: not tried, not avoided,
routable. ``affinity`` weighs its scorer 2 against ``load``'s 1, so the conversation's engine, when
within its slack, beats any other however idle. ``load-affinity`` (docs/load.md)
picks P by the turn's estimated wait there (``ttft``: P's queue, then what the turn computes on it, the
conversation's P computing only what its cache lacks: affinity as a term of the estimate), and D as
``affinity`` does (the D holding the conversation, unless much busier), except that a D on which requests
wait over 100 ms longer than on another loses the conversation (its turn goes through P, pulling
the old D's blocks where that pays, to the other D; the turn says ``decode_moved``). A single candidate left by the
filters is picked without scoring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from turnkv.errors import ConfigError
from turnkv.routing import plugins
from turnkv.routing.base import Filter, InstanceView, Picker, RouteRequest, Scorer
from turnkv.routing.profile import RoutingPlugin, RoutingProfile

BUILTIN: dict[str, RoutingProfile] = {
    "affinity": RoutingProfile(scorers=[RoutingPlugin(type="affinity", weight=2.0), RoutingPlugin(type="load")]),
    "load-affinity": RoutingProfile(
        scorers=[
            RoutingPlugin(type="ttft", weight=3.0),
            RoutingPlugin(type="affinity", weight=2.0, params={"roles": ["decode"], "queue_slack_ms": 100.0}),
            RoutingPlugin(type="load", params={"roles": ["decode"], "signal": "queued"}),
        ]
    ),
    "least-loaded": RoutingProfile(scorers=[RoutingPlugin(type="load")]),
    "round-robin": RoutingProfile(),
}


@dataclass(frozen=True)
class Profile:
    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[float, Scorer]]
    picker: Picker


def build_profile(name: str, custom: Mapping[str, RoutingProfile] | None = None) -> Profile:
    """The profile called ``name``: one of ``custom``, else a built-in one. Raises ``ConfigError``."""
    spec = (custom or {}).get(name) or BUILTIN.get(name)
    if spec is None:
        known = sorted({*BUILTIN, *(custom or {})})
        raise ConfigError(f"unknown routing profile {name!r}; known: {', '.join(known)}")
    return Profile(
        name=name,
        filters=[plugins.build("filter", plugins.FILTERS, f.type, f.params) for f in spec.filters],
        scorers=[(s.weight, plugins.build("scorer", plugins.SCORERS, s.type, s.params)) for s in spec.scorers],
        picker=plugins.build("picker", plugins.PICKERS, spec.picker.type, spec.picker.params),
    )


class Router:
    def __init__(self, profile: Profile, snapshot: Callable[[str], Sequence[InstanceView]]) -> None:
        self.profile = profile
        self.snapshot = snapshot

    def pick(
        self,
        role: str,
        prefer: str | None = None,
        exclude: frozenset[str] = frozenset(),
        avoid: frozenset[str] = frozenset(),
        *,
        prompt_tokens: int = 0,
        prefer_cached_tokens: int = 0,
        prefill_s_per_token: float = 25e-6,
    ) -> InstanceView | None:
        """The engine of ``role`` for one request, from the engines as they are now (a prefill: what the
        turn would compute there, for the ``ttft`` scorer)."""
        req = RouteRequest(
            role,
            prefer,
            exclude,
            avoid,
            prompt_tokens=prompt_tokens,
            prefer_cached_tokens=prefer_cached_tokens,
            prefill_s_per_token=prefill_s_per_token,
            now=time.monotonic(),
        )
        return self.route(req, self.snapshot(role))

    def route(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView | None:
        p = self.profile
        for f in p.filters:
            candidates = f.filter(req, candidates)
        if len(candidates) <= 1:  # nothing to weigh (one P and one D: every pick)
            return candidates[0] if candidates else None
        totals = [0.0] * len(candidates)
        for weight, scorer in p.scorers:
            for i, s in enumerate(scorer.score(req, candidates)):
                totals[i] += weight * s
        return p.picker.pick(req, candidates, totals)
