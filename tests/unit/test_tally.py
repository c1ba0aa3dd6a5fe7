"""The edge's caps (gateway/tally.py, gateway/inflight.py): totals, per-key caps, the reserve kept for those
holding little, and the table workers share."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import pytest

from turnkv.config import Limits
from turnkv.errors import Overloaded, TenantLimit
from turnkv.gateway.inflight import RequestLimits
from turnkv.gateway.tally import Caps, Gate, SharedCounts, Tally


def fill(gate: Gate, keys: Mapping[str, str | None], n: int) -> None:
    for _ in range(n):
        assert gate.refusal(keys) is None
        gate.take(keys)


def test_the_reserve_is_kept_for_whoever_holds_little() -> None:
    gate = Gate("connection", Caps.of(64, 0.25), Tally())  # 16 in reserve; light: under 2
    heavy = {"ip": "10.0.0.1"}
    fill(gate, heavy, 48)  # up to the reserve, one address alone
    refused = gate.refusal(heavy)
    assert refused is not None and refused.reason == "connection_cap_per_ip"
    for i in range(16):  # others, each holding little, still get in, until the total
        fill(gate, {"ip": f"10.0.1.{i // 2}"}, 1)
    total = gate.refusal({"ip": "10.0.2.1"})
    assert total is not None and total.reason == "connection_cap"
    gate.give(heavy)
    assert gate.refusal({"ip": "10.0.2.1"}) is None and gate.refusal(heavy) is not None


def test_per_key_caps_hold_whatever_room_is_left() -> None:
    gate = Gate("inflight", Caps.of(100, 0.0, ip=3, tenant=None), Tally())
    fill(gate, {"ip": "a", "tenant": "t"}, 3)
    refused = gate.refusal({"ip": "a", "tenant": "u"})
    assert refused is not None and refused.kind == "ip"
    assert gate.refusal({"ip": "b", "tenant": "t"}) is None  # tenants have no cap here
    assert gate.refusal({"ip": None, "tenant": "t"}) is None  # no address (a Unix socket): not counted by one


def test_with_no_reserve_one_key_may_take_everything() -> None:
    gate = Gate("connection", Caps.of(8, 0.0), Tally())
    fill(gate, {"ip": "lb"}, 8)  # behind a load balancer every peer is the balancer
    assert gate.refusal({"ip": "lb"}) is not None


def test_request_limits_answer_503_when_full_and_429_when_one_client_holds_too_much() -> None:
    limits = Limits(max_inflight=16, max_arriving=8, reserve_share=0.5, max_inflight_per_tenant=5, retry_after_s=7)
    req = RequestLimits(limits, Tally(), tenants=True)
    a = req.keys("10.0.0.1", "acme")
    holds = [req.hold(a) for _ in range(5)]
    for h in holds:
        h.__enter__()
    with pytest.raises(TenantLimit) as err:
        req.check(a)
    assert err.value.status == 429 and err.value.headers() == {"retry-after": "7"}
    assert "API key" in err.value.message
    b = req.keys("10.0.0.2", "beta")
    with contextlib.ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(req.arrive(b))
        with pytest.raises(TenantLimit) as arriving:  # half of 8 in reserve: b, holding 4, gets none of it
            stack.enter_context(req.arrive(b))
    assert "still arriving" in arriving.value.message
    for h in holds:
        h.__exit__(None, None, None)
    assert req.inflight.held == 0 and req.arriving.held == 0
    anonymous = RequestLimits(Limits(max_inflight=1), Tally(), tenants=False)
    assert anonymous.keys("10.0.0.1", "anonymous")["tenant"] is None  # without keys a tenant is a client's word
    with anonymous.hold(anonymous.keys("10.0.0.1", "x")), pytest.raises(Overloaded) as full:
        anonymous.check(anonymous.keys("10.0.0.2", "y"))
    assert full.value.status == 503 and not isinstance(full.value, TenantLimit)


def test_a_place_is_given_back_when_the_request_fails() -> None:
    req = RequestLimits(Limits(max_inflight=1), Tally(), tenants=True)
    keys = req.keys("10.0.0.1", "acme")
    with pytest.raises(RuntimeError), req.hold(keys):
        raise RuntimeError("the route failed")
    req.check(keys)
    assert req.inflight.tally.held("inflight:tenant:acme") == 0


def test_workers_see_what_the_others_hold(tmp_path: Path) -> None:
    path = str(tmp_path / "limits")
    salt = SharedCounts.create(path, rows=3)
    workers = [Tally(SharedCounts(path, 3, row, salt)) for row in range(3)]
    gates = [Gate("connection", Caps.of(10, 0.0, ip=4), t) for t in workers]
    fill(gates[0], {"ip": "a"}, 3)
    fill(gates[1], {"ip": "a"}, 1)
    refused = gates[2].refusal({"ip": "a"})  # 4 from "a" in all, though worker 2 holds none
    assert refused is not None and refused.kind == "ip"
    fill(gates[2], {"ip": "b"}, 4)
    fill(gates[1], {"ip": "c"}, 2)
    assert gates[0].refusal({"ip": "d"}) is not None and gates[0].refusal({"ip": "d"}).kind is None  # type: ignore[union-attr]
    SharedCounts.clear_row(path, 3, 1)  # worker 1 exited: what it held is gone
    assert workers[0].held("connection") == 3 + 4 and gates[0].refusal({"ip": "a"}) is None
    for t in workers:
        assert t.shared is not None
        t.shared.close()
