"""The four-hop suite's matrix: each two-hop configuration beside its four-hop twin (never timings)."""

from __future__ import annotations

from turnkv.bench.scenarios import four_hop
from turnkv.bench.scenarios.fifth_turn import LINKS


def test_every_link_and_policy_runs_on_two_hops_and_on_four() -> None:
    benches = four_hop.benches(2)
    pairs: dict[tuple[str, str], set[str]] = {}
    for b in benches:
        (plan,) = b.plans
        pairs.setdefault((plan.tags["link"], plan.tags["policy"]), set()).add(plan.tags["hops"])
        assert plan.workload.conversations == 2 and plan.workload.system_tokens == four_hop.HISTORY
        commands = " ".join(b.deployment.commands())
        assert "--text-us-per-token 2.42" in commands  # both sides pay for what they render
        if b.deployment.four_hop:
            assert "--role render" in commands and "--tokens-only" in commands and "vllm-four-hop" in commands
        else:
            assert "--tokens-only" not in commands
    assert set(pairs) == {(link, p) for link in LINKS for p in four_hop.POLICIES}
    assert all(hops == {"two-hop", "four-hop"} for hops in pairs.values())
