"""The cost model and the policies' decisions, as tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from turnkv.config import ConfigError
from turnkv.reuse.adaptive import decode_step_now_ms, step_added_ms
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import (
    Action,
    CostParams,
    TurnFacts,
    decode_step_s,
    estimate,
    pulled_tokens,
    step_added_s,
    transfer_s,
)
from turnkv.reuse.decision import Keep
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
        ("vllm-multiturn", facts(16400, 16000), Action.PULL),
        ("vllm-multiturn", facts(16400, 16000, local=True, d_cached=16000), Action.PULL),  # never decode-local
        ("vllm-multiturn", facts(16400, 0), Action.RECOMPUTE),
        # P holds all but 48 tokens of what D has: below kv_recompute_threshold, P would not pull
        ("vllm-multiturn", facts(16400, 16000, p_cached=15952), Action.RECOMPUTE),
    ],
)
def test_fixed_policies(name: str, f: TurnFacts, action: Action) -> None:
    assert build_policy(name).decide(f, NVLINK).action is action


def test_only_the_unchecked_baselines_skip_the_token_check() -> None:
    assert [n for n in POLICY_NAMES if not build_policy(n).checks_tokens] == [
        "always-reuse-unchecked",
        "vllm-multiturn",
    ]
    assert not build_policy("vllm-multiturn").may_decode_local


@pytest.mark.parametrize(
    ("name", "params"),
    [("nope", {}), ("adaptive", {"margin": -1}), ("adaptive", {"unknown": 1}), ("never-pull", {"x": 1})],
)
def test_bad_policy_config_fails_at_start(name: str, params: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build_policy(name, params)


@pytest.mark.parametrize(
    ("name", "params", "costs", "f", "keep"),
    [
        # a pull never pays over the host's TCP link, even with P's cache lost: not worth its pinned bytes
        (
            "adaptive",
            {"decode_local": False},
            HOST,
            facts(16_000, 15_800, local=True, d_cached=15_792),
            Keep.NOT_NEEDED,
        ),
        # it pays over RDMA with P's cache cold, while D is too busy for decode-local
        ("adaptive", {}, RDMA, facts(16_000, 15_800, local=True, d_cached=15_792, busy=100), Keep.PULL),
        # D will most likely take the next turn itself, from its own prefix cache; should it not (under load
        # it may have no room), pulling beats P recomputing the history: kept as a hedge
        ("adaptive", {}, RDMA, facts(16_000, 15_800, local=True, d_cached=15_792), Keep.HEDGE),
        # before the hedge: dropped
        (
            "adaptive",
            {"keep_hedge": False},
            RDMA,
            facts(16_000, 15_800, local=True, d_cached=15_792),
            Keep.NOT_NEEDED,
        ),
        # P's cache holds all but the answer: recomputing that beats a pull (a tie below the threshold)...
        ("adaptive", {"keep_hedge": False}, RDMA, facts(16_000, 15_800, p_cached=15_792), Keep.NOT_NEEDED),
        # ...but should P's cache lose the history, the pull beats recomputing 16k tokens: a hedge
        ("adaptive", {}, RDMA, facts(16_000, 15_800, p_cached=15_792), Keep.HEDGE),
        ("always-pull", {}, HOST, facts(16_000, 15_800), Keep.PULL),
        ("always-reuse-unchecked", {}, HOST, facts(16_000, 15_800), Keep.PULL),
        ("vllm-multiturn", {}, HOST, facts(16_000, 15_800), Keep.PULL),
        ("never-pull", {}, NVLINK, facts(16_000, 15_800), Keep.NOT_NEEDED),
        ("decode-local", {}, NVLINK, facts(16_000, 15_800, local=True), Keep.NOT_NEEDED),
    ],
)
def test_a_handle_is_kept_pinned_only_where_a_pull_could_use_it(
    name: str, params: dict[str, object], costs: CostParams, f: TurnFacts, keep: Keep
) -> None:
    got = build_policy(name, params).keeps_pin(f, costs)
    assert got is keep and got.kept is (keep is not Keep.NOT_NEEDED)


def test_the_hedge_is_not_kept_where_recompute_wins_anyway() -> None:
    # a short history over NVLink-class links: P recomputes 300 tokens faster than any pull, cache or not
    f = facts(400, 300, p_cached=288)
    assert build_policy("adaptive").keeps_pin(f, NVLINK) is Keep.NOT_NEEDED
    assert build_policy("adaptive").keeps_pin(facts(400, 300), NVLINK) is Keep.NOT_NEEDED


# -- the ITL budget: decode-local only while D's running streams stay within it -------------------------

EIGHT_K = 8400  # an 8k history with a few turns: the workload of the goodput suite


def turn(
    running: int | None = None,
    *,
    busy: int = 0,
    budget: float | None = None,
    step_ms: float | None = None,
    context: int | None = None,
    new: int = 328,
) -> TurnFacts:
    """A later turn on the D that holds the conversation: ``new`` tokens over an 8.4k-token history."""
    return TurnFacts(
        EIGHT_K + new,
        EIGHT_K,
        0,
        EIGHT_K,
        True,
        busy,
        decode_running=running,
        decode_context_tokens=context,
        decode_step_ms=step_ms,
        itl_budget_ms=budget,
    )


@pytest.mark.parametrize(
    ("running", "new", "steps"),
    [
        (0, 328, 1),
        (30, 8162, 1),  # the budget less the streams' tokens holds it
        (30, 20_000, 3),  # 8162 + 8162 + 3676
        (8192, 100, 100),  # a full batch: one token a step
    ],
)
def test_a_decode_local_prefill_is_chunked_over_steps(running: int, new: int, steps: int) -> None:
    assert step_added_s(HOST, running, new, 8000)[1] == steps


def test_what_a_chunk_adds_to_a_step() -> None:
    # 30 streams: 328 new tokens over 8.4k: compute past the free tokens and the chunk's attention
    added, _ = step_added_s(HOST, 30, 328, EIGHT_K)
    want = HOST.prefill_per_token_s * (30 + 328 - HOST.step_free_tokens) + HOST.prefill_attn_s * 328 * (EIGHT_K + 164)
    assert added == pytest.approx(want)
    assert step_added_s(HOST, 30, 0, EIGHT_K) == (0.0, 0)
    # the longest step of a chunked prefill is the one with the most context before it
    assert step_added_s(HOST, 30, 20_000, 0)[0] > step_added_s(HOST, 30, 8162, 0)[0]
    assert decode_step_s(HOST, 0, 0) == 0.0
    assert decode_step_s(HOST, 40, 40 * 8192) > decode_step_s(HOST, 10, 10 * 8192) > HOST.step_base_s


@pytest.mark.parametrize(
    ("params", "f", "action", "reason"),
    [
        # no budget anywhere (and no headroom): decode-local whatever D runs
        ({}, turn(60, busy=60), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # a budget, but nothing runs on D: nobody waits
        ({"itl_budget_ms": 30}, turn(0), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # 10 streams: a ~12 ms step plus ~8 ms of chunk stays within 30 ms
        ({"itl_budget_ms": 30}, turn(10, busy=10), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # 40 streams over 8k each: a ~26 ms step plus the chunk goes past 30 ms
        ({"itl_budget_ms": 30}, turn(40, busy=40), Action.RECOMPUTE, Reason.ITL_BUDGET),
        # without decode_running, the streams the gateway counts on D stand for the batch
        ({"itl_budget_ms": 30}, turn(busy=40), Action.RECOMPUTE, Reason.ITL_BUDGET),
        # the turn's own budget wins over the parameter
        ({"itl_budget_ms": 30}, turn(40, busy=40, budget=60), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        ({}, turn(40, busy=40, budget=30), Action.RECOMPUTE, Reason.ITL_BUDGET),
        # D's measured step time stands over the estimate: a slow D refuses at 10 streams, a fast one
        # takes the turn at 40
        ({"itl_budget_ms": 30}, turn(10, busy=10, step_ms=25.0), Action.RECOMPUTE, Reason.ITL_BUDGET),
        ({"itl_budget_ms": 30}, turn(40, busy=40, step_ms=12.0), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # the streams' context as measured: 40 short streams read little KV
        ({"itl_budget_ms": 30}, turn(40, busy=40, context=40 * 500), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # a long user turn (4k tokens) adds ~0.1 s to one step: refused even beside one stream
        ({"itl_budget_ms": 30}, turn(1, busy=1, new=4000), Action.RECOMPUTE, Reason.ITL_BUDGET),
    ],
)
def test_adaptive_keeps_decode_local_within_the_itl_budget(
    params: dict[str, object], f: TurnFacts, action: Action, reason: Reason
) -> None:
    d = build_policy("adaptive", {**params, "itl_headroom": None}).decide(f, HOST)  # the budget alone
    assert (d.action, d.reason) == (action, reason)


def test_the_itl_budget_reason_only_when_decode_local_would_have_won() -> None:
    # D's cache lost the conversation while P's holds it: P is faster anyway, the budget decided nothing
    f = TurnFacts(EIGHT_K + 328, EIGHT_K, EIGHT_K, 0, True, 40, decode_running=40, itl_budget_ms=30)
    params = {"decode_local_max_new_tokens": 100_000, "decode_local_max_stall_ms": 10_000}
    d = build_policy("adaptive", params).decide(f, NVLINK)
    assert (d.action, d.reason) == (Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE)


def test_the_itl_estimate_is_the_step_now_plus_the_chunk() -> None:
    f = turn(30, context=30 * 8192)
    want = (decode_step_s(HOST, 30, 30 * 8192) + step_added_s(HOST, 30, 328, EIGHT_K)[0]) * 1e3
    assert decode_step_now_ms(f, HOST) + step_added_ms(f, HOST) == pytest.approx(want)
    measured = turn(30, step_ms=20.0)
    assert decode_step_now_ms(measured, HOST) + step_added_ms(measured, HOST) == pytest.approx(
        20.0 + step_added_s(HOST, 30, 328, EIGHT_K)[0] * 1e3
    )


def test_new_turn_facts_default_to_todays_behaviour() -> None:
    f = facts(16400, 16000, local=True, d_cached=16000, busy=60)
    assert (f.decode_running, f.decode_context_tokens, f.decode_step_ms, f.itl_budget_ms) == (None, None, None, None)
    assert (f.decode_prefills, f.decode_prefill_tokens) == (0, 0)
    assert build_policy("adaptive", {"itl_headroom": None}).decide(f, HOST).action is Action.DECODE_LOCAL
    assert build_policy("adaptive", {"itl_budget_ms": 30}).decide(f, HOST).reason is Reason.ITL_BUDGET


THIN = CostParams(decode_chunk_tokens=64)  # D runs with --long-prefill-token-threshold 64


def test_thin_chunks_spread_a_turn_over_steps_that_grow_by_little() -> None:
    added, steps = step_added_s(THIN, 40, 328, EIGHT_K)
    assert steps == 6  # 64 x 5 + 8
    # 40 streams and 64 tokens stay within the tokens a step computes for free: only the chunk's attention
    assert added == pytest.approx(THIN.prefill_attn_s * 64 * (EIGHT_K + 4 * 64 + 32))
    assert added < step_added_s(HOST, 40, 328, EIGHT_K)[0] / 5


def test_with_thin_chunks_decode_local_stays_within_the_budget_and_waits_a_few_steps() -> None:
    f = turn(40, busy=40)
    assert build_policy("adaptive", {"itl_budget_ms": 30}).decide(f, HOST).reason is Reason.ITL_BUDGET
    d = build_policy("adaptive", {"itl_budget_ms": 30, "decode_chunk_tokens": 64}).decide(f, HOST)
    assert (d.action, d.reason) == (Action.DECODE_LOCAL, Reason.DECODE_LOCAL)
    # its first token after 6 steps of D's batch: 5 steps more than one chunk would take
    step = decode_step_s(HOST, 40, 40 * (EIGHT_K + 328))
    one = estimate(HOST, f)[Action.DECODE_LOCAL]
    assert estimate(THIN, f)[Action.DECODE_LOCAL] == pytest.approx(one + 5 * step)
    assert d.estimates[Action.DECODE_LOCAL] == pytest.approx(one + 5 * step)


def test_thin_chunks_change_nothing_without_the_setting() -> None:
    f = turn(40, busy=40)
    assert estimate(CostParams(), f) == estimate(HOST, f)
    assert build_policy("adaptive", {"decode_chunk_tokens": 0}).decide(f, HOST) == build_policy("adaptive").decide(
        f, HOST
    )


@pytest.mark.parametrize(
    ("params", "f", "local"),
    [
        # no usage known, or no limit: D's cache is taken to hold the conversation
        ({}, turn(30, busy=30), True),
        ({"decode_cache_max_usage": 0.75}, turn(30, busy=30), True),
        # D's running streams and pins hold 90% of its KV: the conversation's blocks are likely gone
        ({"decode_cache_max_usage": 0.75}, replace(turn(30, busy=30), decode_kv_usage=0.9), False),
        ({"decode_cache_max_usage": 0.75}, replace(turn(30, busy=30), decode_kv_usage=0.5), True),
        # estimated from the batch: 30 streams of ~8.7k tokens in 288k tokens of KV is 91%; 10 is 30%
        ({"decode_cache_max_usage": 0.75, "decode_kv_tokens": 288_000}, turn(30, busy=30), False),
        ({"decode_cache_max_usage": 0.75, "decode_kv_tokens": 288_000}, turn(10, busy=10), True),
    ],
)
def test_a_crowded_d_is_taken_to_have_lost_the_conversation(
    params: dict[str, object], f: TurnFacts, local: bool
) -> None:
    d = build_policy("adaptive", {**params, "itl_headroom": None}).decide(f, HOST)  # D's cache alone
    assert (d.action is Action.DECODE_LOCAL) is local
    if not local:
        assert d.reason is Reason.CHEAPER_TO_RECOMPUTE  # the whole prompt on D loses to P


def test_ps_queue_counts_against_the_paths_through_p() -> None:
    # D is idle and the turn thin-chunked: at an idle P, recomputing there is estimated faster...
    f = turn(10, busy=10)
    thin = {"itl_budget_ms": 30, "decode_chunk_tokens": 64}
    assert build_policy("adaptive", thin).decide(f, NVLINK).action is not Action.DECODE_LOCAL
    # ...but P's first turns keep it busy: with 100 ms of queue there, D's own steps are faster
    queued = replace(f, prefill_queue_ms=100.0)
    assert build_policy("adaptive", thin).decide(queued, NVLINK).action is Action.DECODE_LOCAL
    assert build_policy("adaptive", {**thin, "prefill_queue_ms": 100}).decide(f, NVLINK).action is Action.DECODE_LOCAL
    est, est_q = estimate(NVLINK, f), estimate(NVLINK, queued)
    assert est_q[Action.RECOMPUTE] == pytest.approx(est[Action.RECOMPUTE] + 0.1)
    assert est_q[Action.PULL] == pytest.approx(est[Action.PULL] + 0.1)


# -- the ITL headroom: a decode-local turn's prefill lengthens D's step by at most a share of it ---------


@pytest.mark.parametrize(
    ("params", "costs", "f", "action", "reason"),
    [
        # nothing runs on D: nobody's ITL to keep
        ({}, HOST, turn(0), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # D as vLLM runs it by default: 328 tokens in one step beside 10 streams add ~8 ms to a ~12 ms step
        ({}, HOST, turn(10, busy=10), Action.RECOMPUTE, Reason.ITL_HEADROOM),
        # without the headroom (before it): taken
        ({"itl_headroom": None}, HOST, turn(10, busy=10), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # ... and with a generous one
        ({"itl_headroom": 1.0}, HOST, turn(10, busy=10), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # D taking 64 tokens a step: beside 40 streams a chunk adds its attention only (~0.7 ms of ~27 ms)
        ({}, THIN, turn(40, busy=40), Action.DECODE_LOCAL, Reason.DECODE_LOCAL),
        # ... but six other decode-local turns prefilling on D put 384 more tokens into the same step
        (
            {},
            THIN,
            replace(turn(40, busy=40), decode_prefills=6, decode_prefill_tokens=6 * 328),
            Action.RECOMPUTE,
            Reason.ITL_HEADROOM,
        ),
        # one other, nearly done (10 tokens left): still within
        (
            {},
            THIN,
            replace(turn(40, busy=40), decode_prefills=1, decode_prefill_tokens=10),
            Action.DECODE_LOCAL,
            Reason.DECODE_LOCAL,
        ),
        # past the absolute budget too: the budget's reason
        ({"itl_budget_ms": 20}, HOST, turn(10, busy=10), Action.RECOMPUTE, Reason.ITL_BUDGET),
    ],
)
def test_adaptive_keeps_ds_step_within_its_headroom(
    params: dict[str, object], costs: CostParams, f: TurnFacts, action: Action, reason: Reason
) -> None:
    d = build_policy("adaptive", params).decide(f, costs)
    assert (d.action, d.reason) == (action, reason)


def test_the_headroom_is_relative_to_ds_own_step() -> None:
    # the same chunks pass beside a D whose step is ten times what they add, and not beside a faster one
    f = replace(turn(40, busy=40), decode_prefills=1, decode_prefill_tokens=64)
    added = step_added_s(THIN, 40, 328, EIGHT_K, 1, 64)[0] * 1e3
    policy = build_policy("adaptive")
    slow = replace(f, decode_step_ms=added / 0.10 + 0.5)
    fast = replace(f, decode_step_ms=added / 0.10 - 0.5)
    assert policy.decide(slow, THIN).action is Action.DECODE_LOCAL
    assert policy.decide(fast, THIN).reason is Reason.ITL_HEADROOM


def test_other_prefills_on_d_share_the_step() -> None:
    alone, steps = step_added_s(THIN, 40, 328, EIGHT_K)
    both, steps2 = step_added_s(THIN, 40, 328, EIGHT_K, 2, 1000)
    # two more chunks of 64: their compute past the free tokens (40 + 64 + 128 - 128 = 104) and attention
    want = THIN.prefill_per_token_s * (40 + 64 + 128 - THIN.step_free_tokens) + THIN.prefill_attn_s * (
        64 * (EIGHT_K + 4 * 64 + 32) + 128 * (EIGHT_K + 32)
    )
    assert both == pytest.approx(want) and both > alone and steps2 == steps == 6
    # what is left of them bounds their share: 10 tokens, not two chunks
    assert step_added_s(THIN, 40, 328, EIGHT_K, 2, 10)[0] < both
    # an unchunked D: the others' tokens as they are, the turn's chunk what the budget leaves
    assert step_added_s(HOST, 30, 328, EIGHT_K, 1, 200)[0] > step_added_s(HOST, 30, 328, EIGHT_K)[0]


def test_on_a_shared_gpu_the_itl_checks_refuse_only_what_p_would_compute_less_of() -> None:
    # P and D on one GPU: the recompute the headroom sends the turn to is 8.7k tokens of P's compute on
    # D's device, against the 328 tokens D would prefill; refusing spares D's streams nothing
    alone = turn(10, busy=10)
    f = replace(alone, shared_gpu=True)
    policy = build_policy("adaptive")
    assert policy.decide(alone, HOST).reason is Reason.ITL_HEADROOM
    d = policy.decide(f, HOST)
    assert (d.action, d.reason) == (Action.DECODE_LOCAL, Reason.SHARED_GPU)
    # ... and a pull computes on P what D would (the new tokens) and more: decode-local still
    assert policy.decide(f, SLOWISH).action is Action.DECODE_LOCAL
    # D's cache lost the history (crowded) while P's holds it: D would prefill it all, P only the new part
    # (P queued, so that decode-local would still be the faster)
    crowded = replace(f, prefill_cached_tokens=EIGHT_K, decode_kv_usage=0.99, prefill_queue_ms=5000.0)
    params = {
        "decode_cache_max_usage": 0.9,
        "decode_local_max_stall_ms": 10_000,
        "decode_local_max_new_tokens": 10_000,
    }
    d = build_policy("adaptive", params).decide(crowded, HOST)
    assert (d.action, d.reason) == (Action.RECOMPUTE, Reason.ITL_HEADROOM)
    # the budget's refusal is lifted alike
    assert build_policy("adaptive", {"itl_budget_ms": 20}).decide(f, HOST).action is Action.DECODE_LOCAL


@pytest.mark.parametrize("bad", [-0.1, "x"])
def test_a_bad_headroom_fails_at_start(bad: object) -> None:
    with pytest.raises(ConfigError):
        build_policy("adaptive", {"itl_headroom": bad})


# -- P's queue: an action's P compute charged for the turns that will wait behind it ----------

# a link where a whole-history pull is a little slower than P recomputing it at an idle P (~0.4 s each)
SLOWISH = CostParams(link_fixed_s=0.005, link_bytes_per_s=3.2e9)


def test_at_an_idle_p_the_faster_action_wins_and_nothing_is_charged() -> None:
    f = facts(EIGHT_K, 8200)
    est = estimate(SLOWISH, f)
    assert est[Action.RECOMPUTE] < est[Action.PULL]  # what the case is about
    d = build_policy("adaptive").decide(f, SLOWISH)
    assert (d.action, d.reason, dict(d.charges)) == (Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE, {})


@pytest.mark.parametrize("waiting", [1, 4])
def test_with_prefills_waiting_at_p_a_pull_that_spares_ps_compute_wins(waiting: int) -> None:
    f = replace(facts(EIGHT_K, 8200), prefill_waiting=waiting)
    d = build_policy("adaptive").decide(f, SLOWISH)
    assert d.action is Action.PULL and d.reason is None
    # the recompute is charged its whole history's compute per waiting prefill, the pull only its new part
    assert d.charges[Action.RECOMPUTE] > waiting * 0.2 and d.charges[Action.PULL] < d.charges[Action.RECOMPUTE] / 20
    assert d.estimates[Action.RECOMPUTE] < d.estimates[Action.PULL]  # the estimates stay TTFT: logged as such
    # prefill_crowding 0: each turn minimises its own TTFT, as before
    assert build_policy("adaptive", {"prefill_crowding": 0}).decide(f, SLOWISH).action is Action.RECOMPUTE


def test_a_handle_is_kept_where_prefills_wait_at_p_and_dropped_at_an_idle_one() -> None:
    # P's cache holds the history but the answer: recomputing that part beats a pull at an idle P, and a
    # whole-history pull is no faster than P recomputing it all: no hedge either
    f = facts(EIGHT_K, 8200, p_cached=8192)
    policy = build_policy("adaptive")
    assert policy.keeps_pin(f, SLOWISH) is Keep.NOT_NEEDED
    # with prefills waiting there, P's compute is dear: should its cache have lost the history, the pull
    # spares P 8k tokens of it
    assert policy.keeps_pin(replace(f, prefill_waiting=3), SLOWISH) is Keep.HEDGE


def test_a_d_that_prefills_in_chunks_may_take_a_whole_first_turn_within_its_itl_checks() -> None:
    # an 8k first turn, nothing cached on D: past the new-token cap and the stall limit, D prefilling it
    # all in one step would stall its streams for its whole prefill
    f = TurnFacts(8229, 0, 0, 0, True, 20, decode_step_ms=18.0, prefill_queue_ms=4000.0, prefill_waiting=8)
    assert build_policy("adaptive").decide(f, NVLINK).action is Action.RECOMPUTE
    # a chunk a step: its streams wait a chunk's attention a step, the headroom's business; its own first
    # token 129 steps later, which beats 4 s of P's queue
    d = build_policy("adaptive", {"decode_chunk_tokens": 64}).decide(f, NVLINK)
    assert (d.action, d.reason) == (Action.DECODE_LOCAL, Reason.DECODE_LOCAL)
    # with P idle the split stands on the estimate alone: 128 steps of D lose to P's prefill
    idle = replace(f, prefill_queue_ms=0.0, prefill_waiting=0)
    assert build_policy("adaptive", {"decode_chunk_tokens": 64}).decide(idle, NVLINK).action is Action.RECOMPUTE
