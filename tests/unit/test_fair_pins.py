"""``state.fair.fair_evictions``: what an evict takes from the tenants pinning on one decode engine."""

from __future__ import annotations

import random

import pytest

from turnkv.state.base import PinEntry
from turnkv.state.fair import fair_evictions


def pin(key: str, tenant: str, tokens: int, at: float) -> PinEntry:
    return PinEntry(key, "http://d", tokens, {}, f"p-{key}", at, 1e12, None, tenant)


def test_one_tenant_loses_its_idle_longest_first() -> None:
    pins = [pin("c", "a", 10, 3.0), pin("a", "a", 10, 1.0), pin("b", "a", 10, 2.0)]
    assert [e.key for e in fair_evictions(pins, 15)] == ["a", "b"]
    assert fair_evictions(pins, 30) == []


def test_a_tenant_within_its_share_keeps_its_pins_though_idle_longest() -> None:
    pins = [pin("q", "quiet", 10, 1.0), *(pin(f"b{i}", "busy", 10, 2.0 + i) for i in range(6))]
    assert [e.key for e in fair_evictions(pins, 40)] == ["b0", "b1", "b2"]


def test_a_tenant_left_with_nothing_leaves_its_share_to_the_others() -> None:
    # keep 12 over three tenants: 4 each; c's one pin (5) goes, then a and b share 6 each: a's 6 stays
    pins = [pin("c", "c", 5, 1.0), pin("a", "a", 6, 2.0), pin("b1", "b", 6, 3.0), pin("b2", "b", 6, 4.0)]
    assert [e.key for e in fair_evictions(pins, 12)] == ["c", "b1"]


@pytest.mark.parametrize("seed", range(200))
def test_it_ends_within_keep_and_never_takes_a_tenant_below_its_share(seed: int) -> None:
    rng = random.Random(seed)
    pins = [pin(f"k{i}", rng.choice("abcd"), rng.randint(1, 50), rng.random()) for i in range(rng.randint(1, 40))]
    held = {t: sum(e.tokens for e in pins if e.tenant == t) for t in {e.tenant for e in pins}}
    keep = rng.randint(0, sum(held.values()))
    out = fair_evictions(pins, keep)
    assert sum(held.values()) - sum(e.tokens for e in out) <= keep
    assert len({e.key for e in out}) == len(out)
    left = dict(held)
    for e in out:  # each pin taken was its tenant's while that tenant held more than its share then
        tenants = sum(1 for v in left.values() if v > 0)
        assert left[e.tenant] > keep / tenants
        left[e.tenant] -= e.tokens
    # and the last pin taken was needed: without it more than keep would stay
    if out:
        assert sum(left.values()) + out[-1].tokens > keep
