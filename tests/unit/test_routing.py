"""Routing plugins and profiles as tables: candidates in, the pick (or the scores) out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from turnkv.config import RoutingPlugin, RoutingProfile, Settings
from turnkv.routing import InstanceView, Router, RouteRequest, build_profile
from turnkv.routing.base import NoParams
from turnkv.routing.scorers import Affinity, AffinityParams, Load, LoadParams, PinHeadroom

P = ("http://p0", "http://p1", "http://p2")


def engine(
    url: str,
    *,
    in_flight: int = 0,
    running: int = 0,
    healthy: bool = True,
    routable: bool | None = None,
    pinned: int = 0,
    budget: int | None = None,
) -> InstanceView:
    return InstanceView(
        url=url,
        role="prefill",
        healthy=healthy,
        routable=healthy if routable is None else routable,
        in_flight=in_flight,
        running=running,
        waiting=0,
        kv_usage=0.0,
        epoch=None,
        version=None,
        stream_handles=None,
        takes_prompt_ids=False,
        cache_factor=1.0,
        capacity_tokens=None,
        pinned_tokens=pinned,
        pin_budget_tokens=budget,
        progressed_at=0.0,
    )


def router(profile: str, engines: Sequence[InstanceView], custom: dict[str, RoutingProfile] | None = None) -> Router:
    return Router(build_profile(profile, custom), lambda role: tuple(engines))


def picks(r: Router, req: dict[str, object] | None = None, n: int = 9) -> list[str]:
    out = []
    for _ in range(n):
        v = r.route(RouteRequest("prefill", **req or {}), r.snapshot("prefill"))  # type: ignore[arg-type]
        out.append(v.url if v else "none")
    return out


EQUAL = [engine(u) for u in P]


@pytest.mark.parametrize(
    ("profile", "engines", "req", "want"),
    [
        # affinity: the conversation's engine, while within its slack of the least loaded
        ("affinity", EQUAL, {"prefer": "http://p2"}, {"http://p2"}),
        (
            "affinity",
            [engine("http://p0"), engine("http://p1"), engine("http://p2", in_flight=8)],
            {"prefer": "http://p2"},
            {"http://p2"},
        ),
        (
            "affinity",
            [engine("http://p0"), engine("http://p1"), engine("http://p2", in_flight=9)],
            {"prefer": "http://p2"},
            {"http://p0", "http://p1"},
        ),
        # the least loaded, in turn among equals
        (
            "affinity",
            [engine("http://p0", in_flight=3), engine("http://p1"), engine("http://p2")],
            {},
            {"http://p1", "http://p2"},
        ),
        ("least-loaded", EQUAL, {"prefer": "http://p2"}, set(P)),
        ("round-robin", [engine("http://p0", in_flight=5), *EQUAL[1:]], {"prefer": "http://p2"}, set(P)),
        # tried engines never; avoided and unhealthy ones only when nothing else is left
        ("affinity", EQUAL, {"exclude": frozenset({"http://p0", "http://p1"})}, {"http://p2"}),
        ("affinity", EQUAL, {"exclude": frozenset(P)}, {"none"}),
        ("affinity", EQUAL, {"avoid": frozenset({"http://p0", "http://p1"}), "prefer": "http://p0"}, {"http://p2"}),
        ("affinity", EQUAL, {"avoid": frozenset(P), "prefer": "http://p0"}, {"http://p0"}),
        (
            "affinity",
            [engine("http://p0", healthy=False), engine("http://p1", routable=False), EQUAL[2]],
            {"prefer": "http://p0"},
            {"http://p2"},
        ),
        ("affinity", [engine(u, healthy=False) for u in P], {"prefer": "http://p1"}, {"http://p1"}),
    ],
)
def test_profiles(profile: str, engines: list[InstanceView], req: dict[str, object], want: set[str]) -> None:
    assert set(picks(router(profile, engines), req)) == want


def test_equals_take_turns() -> None:
    assert picks(router("least-loaded", EQUAL), n=6) == [*P, *P]


@pytest.mark.parametrize(
    ("scorer", "engines", "req", "want"),
    [
        (
            Load(LoadParams()),
            [engine("p0"), engine("p1", in_flight=1), engine("p2", in_flight=3)],
            RouteRequest("prefill"),
            [1.0, 0.5, 0.25],
        ),
        (
            Load(LoadParams(signal="busy")),
            [engine("p0", running=3), engine("p1", in_flight=1)],
            RouteRequest("prefill"),
            [0.5, 1.0],
        ),
        (
            Affinity(AffinityParams(slack=1)),
            [engine("p0"), engine("p1", in_flight=1)],
            RouteRequest("prefill", "p1"),
            [0.0, 1.0],
        ),
        (
            Affinity(AffinityParams(slack=0)),
            [engine("p0"), engine("p1", in_flight=1)],
            RouteRequest("prefill", "p1"),
            [0.0, 0.0],
        ),
        (
            PinHeadroom(NoParams()),
            [
                engine("d0", pinned=0, budget=100),
                engine("d1", pinned=75, budget=100),
                engine("d2", pinned=150, budget=100),
                engine("d3", pinned=5),
            ],
            RouteRequest("decode"),
            [1.0, 0.25, 0.0, 1.0],
        ),
    ],
)
def test_scorers(scorer: object, engines: list[InstanceView], req: RouteRequest, want: list[float]) -> None:
    assert list(scorer.score(req, engines)) == want  # type: ignore[attr-defined]


def test_a_profile_of_ones_own_by_name() -> None:
    headroom = RoutingProfile(scorers=[RoutingPlugin(type="pin-headroom", weight=2), RoutingPlugin(type="load")])
    full = dataclasses.replace(engine("http://p0"), pinned_tokens=90, pin_budget_tokens=100)
    r = router("headroom", [full, engine("http://p1", in_flight=2)], {"headroom": headroom})
    assert set(picks(r)) == {"http://p1"}  # 2 x 1.0 + 1/3 beats 2 x 0.1 + 1
    s = Settings(prefill=["http://p"], decode=["http://d"], routing="headroom", routing_profiles={"headroom": headroom})
    assert s.routing == "headroom"


@pytest.mark.parametrize(
    ("routing", "profiles", "error"),
    [
        ("nearest", {}, "unknown routing profile 'nearest'"),
        ("mine", {"mine": RoutingProfile(scorers=[RoutingPlugin(type="fastest")])}, "unknown routing scorer 'fastest'"),
        ("mine", {"mine": RoutingProfile(scorers=[RoutingPlugin(type="affinity", params={"slack": -1})])}, "slack"),
        ("mine", {"mine": RoutingProfile(scorers=[RoutingPlugin(type="load", params={"signal": "gpu"})])}, "signal"),
        ("mine", {"mine": RoutingProfile(picker=RoutingPlugin(type="load"))}, "unknown routing picker 'load'"),
        ("mine", {"mine": RoutingProfile(filters=[RoutingPlugin(type="routable", params={"x": 1})])}, "x"),
    ],
)
def test_a_bad_profile_refuses_the_start(routing: str, profiles: dict[str, RoutingProfile], error: str) -> None:
    with pytest.raises(ValueError, match=error):  # ConfigError, as pydantic reports it
        Settings(prefill=["http://p"], decode=["http://d"], routing=routing, routing_profiles=profiles)
