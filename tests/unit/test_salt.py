"""The cache salt of a pull sent ahead of the token check: its own per turn, the client's folded in."""

from __future__ import annotations

from turnkv.gateway.turn.salt import salted


def test_each_turn_gets_a_salt_of_its_own() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    a, b = salted(body, "req-1"), salted(body, "req-2")
    assert a["cache_salt"] != b["cache_salt"]
    assert salted(body, "req-1") == a  # the same turn's retries on the same request id agree
    assert "cache_salt" not in body  # the client's request is not changed
    assert {k: v for k, v in a.items() if k != "cache_salt"} == body


def test_the_clients_salt_is_folded_in() -> None:
    plain = salted({"messages": []}, "req-1")["cache_salt"]
    own = salted({"messages": [], "cache_salt": "tenant-7"}, "req-1")["cache_salt"]
    other = salted({"messages": [], "cache_salt": "tenant-8"}, "req-1")["cache_salt"]
    assert len({plain, own, other}) == 3 and "tenant-7" not in own
