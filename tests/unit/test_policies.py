"""The cost model and the policies' decisions, as tables."""

from __future__ import annotations

import pytest

from turnkv.config import ConfigError
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts, estimate, pulled_tokens, transfer_s
from turnkv.reuse.policies import POLICY_NAMES, build_policy

HOST = CostParams()  # 0.43 GB/s, the project's H200 host as measured
RDMA = CostParams(link_fixed_s=0.005, link_bytes_per_s=45e9)
NVLINK = CostParams(link_fixed_s=0.002, link_bytes_per_s=300e9)


def facts(
    prompt: int, reusable: int, p_cached: int = 0, *, local: bool = False, d_cached: int = 0, busy: int = 0
) -> TurnFacts:
    return TurnFacts(prompt, reusable, p_cached, d_cached, local, busy)


def test_transfer_time_is_fixed_cost_plus_bytes() -> None:
    assert transfer_s(HOST, 0) == 0.0
    # 16 tokens of 144 KiB at 0.43 GB/s, plus 2 ms
    assert transfer_s(HOST, 16) == pytest.approx(0.002 + 16 * 147456 / 0.43e9)


@pytest.mark.parametrize(
    ("f", "pulled"),
    [
        (facts(1000, 800), 800),
        (facts(1000, 800, p_cached=768), 0),  # 32 tokens: below vLLM's 64-token threshold
        (facts(1000, 800, p_cached=640), 160),
        (facts(1000, 800, p_cached=800), 0),
        (facts(500, 800), 500),  # never more than the prompt
    ],
)
def test_pulled_tokens(f: TurnFacts, pulled: int) -> None:
    assert pulled_tokens(HOST, f) == pulled


@pytest.mark.parametrize(
    ("costs", "f", "best"),
    [
        # the H200 host: pulling 16k tokens at 0.45 GB/s (5 s) loses to recomputing them (~0.7 s)
        (HOST, facts(16400, 16000), Action.RECOMPUTE),
        # P's cache is warm: only the last answer is missing; still cheaper to recompute over TCP
        (HOST, facts(16400, 16000, p_cached=15600), Action.RECOMPUTE),
        # fast links with a cold P cache: pulling wins by far
        (RDMA, facts(16400, 16000), Action.PULL),
        (NVLINK, facts(32400, 32000), Action.PULL),
        # nothing reusable
        (NVLINK, facts(16400, 0), Action.RECOMPUTE),
        # a small delta on the decode engine that holds the conversation
        (HOST, facts(16400, 16000, local=True, d_cached=16000), Action.DECODE_LOCAL),
    ],
)
def test_adaptive_picks_the_cheapest(costs: CostParams, f: TurnFacts, best: Action) -> None:
    d = build_policy("adaptive").decide(f, costs)
    assert d.action is best
    assert d.action is min(estimate(costs, f), key=lambda a: estimate(costs, f)[a])


def test_adaptive_says_why_it_declines_usable_kv() -> None:
    d = build_policy("adaptive", {"decode_local": False}).decide(facts(16400, 16000), HOST)
    assert (d.action, d.reason) == (Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE)
    assert set(d.estimates) == {Action.RECOMPUTE, Action.PULL}


@pytest.mark.parametrize(
    ("params", "f"),
    [
        ({"decode_local": False}, facts(16400, 16000, local=True, d_cached=16000)),
        ({"decode_local_max_new_tokens": 100}, facts(16400, 16000, local=True, d_cached=16000)),
        ({"decode_local_max_busy": 4}, facts(16400, 16000, local=True, d_cached=16000, busy=5)),
        # 4k new tokens over 32k of context: ~0.26 s of prefill that D's streams would wait through
        ({}, facts(36000, 32000, local=True, d_cached=32000)),
        ({"decode_local_max_stall_ms": 50}, facts(18000, 16000, local=True, d_cached=16000)),
    ],
)
def test_adaptive_decode_local_limits(params: dict[str, object], f: TurnFacts) -> None:
    assert build_policy("adaptive", params).decide(f, HOST).action is not Action.DECODE_LOCAL


def test_adaptive_prefills_a_long_user_message_on_decode_within_the_stall_budget() -> None:
    # 2k new tokens over 16k: ~90 ms on D, against ~0.9 s of recompute on P over the host link
    f = facts(18000, 16000, local=True, d_cached=16000)
    assert build_policy("adaptive").decide(f, HOST).action is Action.DECODE_LOCAL


def test_margin_makes_pull_prove_itself() -> None:
    f = facts(4000, 3800)
    costs = CostParams(link_fixed_s=0.0, link_bytes_per_s=7e9)
    est = estimate(costs, f)
    assert est[Action.PULL] < est[Action.RECOMPUTE] < est[Action.PULL] * 1.5
    assert build_policy("adaptive").decide(f, costs).action is Action.PULL
    assert build_policy("adaptive", {"margin": 0.5}).decide(f, costs).action is Action.RECOMPUTE


@pytest.mark.parametrize(
    ("name", "f", "action"),
    [
        ("always-pull", facts(16400, 16000), Action.PULL),
        ("always-pull", facts(16400, 0), Action.RECOMPUTE),
        ("never-pull", facts(16400, 16000), Action.RECOMPUTE),
        ("decode-local", facts(16400, 16000, local=True), Action.DECODE_LOCAL),
        ("decode-local", facts(16400, 16000), Action.RECOMPUTE),
        ("always-reuse-unchecked", facts(16400, 16000), Action.PULL),
    ],
)
def test_fixed_policies(name: str, f: TurnFacts, action: Action) -> None:
    assert build_policy(name).decide(f, NVLINK).action is action


def test_only_the_unchecked_baseline_skips_the_token_check() -> None:
    assert [n for n in POLICY_NAMES if not build_policy(n).checks_tokens] == ["always-reuse-unchecked"]


@pytest.mark.parametrize(
    ("name", "params"),
    [("nope", {}), ("adaptive", {"margin": -1}), ("adaptive", {"unknown": 1}), ("never-pull", {"x": 1})],
)
def test_bad_policy_config_fails_at_start(name: str, params: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build_policy(name, params)


@pytest.mark.parametrize(
    ("name", "params", "costs", "f", "keeps"),
    [
        # a pull never pays over the host's TCP link: a handle is not worth its pinned bytes
        ("adaptive", {"decode_local": False}, HOST, facts(16_000, 15_800, local=True, d_cached=15_792), False),
        # it pays over RDMA with P's cache cold, while D is too busy for decode-local
        ("adaptive", {}, RDMA, facts(16_000, 15_800, local=True, d_cached=15_792, busy=100), True),
        # D will most likely take the next turn itself, from its own prefix cache: no pin needed
        ("adaptive", {}, RDMA, facts(16_000, 15_800, local=True, d_cached=15_792), False),
        ("always-pull", {}, HOST, facts(16_000, 15_800), True),
        ("always-reuse-unchecked", {}, HOST, facts(16_000, 15_800), True),
        ("never-pull", {}, NVLINK, facts(16_000, 15_800), False),
        ("decode-local", {}, NVLINK, facts(16_000, 15_800, local=True), False),
    ],
)
def test_a_handle_is_kept_pinned_only_where_a_pull_would_use_it(
    name: str, params: dict[str, object], costs: CostParams, f: TurnFacts, keeps: bool
) -> None:
    assert build_policy(name, params).keeps_pin(f, costs) is keeps
