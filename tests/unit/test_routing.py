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
        scraped=True,  # its running count is another client's, as its metrics said
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


# -- load-affinity: P by the turn's estimated wait, its cache counted; D as affinity ------------


def queued(url: str, work_s: float, since: float = 100.0) -> InstanceView:
    """A P with this gateway's prefills in flight, ``work_s`` of estimated work sent at ``since``."""
    return dataclasses.replace(engine(url, in_flight=1), queued_prefill_s=work_s, queued_since=since)


TURN = {"prompt_tokens": 8600, "prefer_cached_tokens": 8320, "prefill_s_per_token": 25e-6, "now": 100.0}


@pytest.mark.parametrize(
    ("engines", "req", "want"),
    [
        # the conversation's P computes 280 tokens (7 ms), another all 8600 (215 ms): home wins while its queue
        # is shorter than that difference, however many requests it has in flight
        ([queued("http://p0", 0.1), engine("http://p1")], {"prefer": "http://p0", **TURN}, {"http://p0"}),
        (
            [dataclasses.replace(queued("http://p0", 0.1), in_flight=12), engine("http://p1")],
            {"prefer": "http://p0", **TURN},
            {"http://p0"},
        ),
        # home's queue is longer than recomputing the whole prompt elsewhere: the less loaded P
        ([queued("http://p0", 0.6), engine("http://p1")], {"prefer": "http://p0", **TURN}, {"http://p1"}),
        # P has worked 0.5 s of it already: what is left is short again
        ([queued("http://p0", 0.6), engine("http://p1")], {"prefer": "http://p0", **TURN, "now": 100.5}, {"http://p0"}),
        # a first turn (no home): the shortest queue
        (
            [queued("http://p0", 0.3), queued("http://p1", 0.2), queued("http://p2", 0.4)],
            {"prompt_tokens": 8000, "now": 100.0},
            {"http://p1"},
        ),
    ],
)
def test_load_affinity_sends_p_work_where_it_waits_least(
    engines: list[InstanceView], req: dict[str, object], want: set[str]
) -> None:
    assert set(picks(router("load-affinity", engines), req)) == want


def test_load_affinity_keeps_the_conversation_on_its_d_within_the_slack() -> None:
    ds = [dataclasses.replace(engine(u, in_flight=n), role="decode") for u, n in (("http://d0", 6), ("http://d1", 0))]
    r = Router(build_profile("load-affinity"), lambda role: tuple(ds))
    home = r.route(RouteRequest("decode", prefer="http://d0"), ds)
    assert home is not None and home.url == "http://d0"
    busy = [dataclasses.replace(ds[0], in_flight=20), ds[1]]
    moved = r.route(RouteRequest("decode", prefer="http://d0"), busy)
    assert moved is not None and moved.url == "http://d1"
    # a first turn: the least loaded D
    first = r.route(RouteRequest("decode"), ds)
    assert first is not None and first.url == "http://d1"
