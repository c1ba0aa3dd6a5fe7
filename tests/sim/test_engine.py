"""The engine's KV-connector decisions, driven on Engine objects (time scale 0) over a real side channel.

What is pulled: a D request with ``do_remote_prefill`` pulls everything its prefix cache lacks; a P
request carrying D's handle pulls ``min(remote_num_tokens, prompt) - local_hit`` tokens unless that
is below ``kv_recompute_threshold``, and D is told to free its pin either way; remote blocks are
end-trimmed to the local ones, as vLLM's NIXL connector does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from turnkv.sim.costs import CostModel
from turnkv.sim.engine import Engine, EngineConfig
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import Sampling
from turnkv.sim.sequence import EngineError, Output
from turnkv.sim.tokenizer import Tokenizer

TOK = Tokenizer()
MakeEngine = Callable[..., Awaitable[Engine]]


@pytest.fixture
async def make_engine() -> AsyncIterator[MakeEngine]:
    engines: list[Engine] = []

    async def make(role: str = "decode", **cfg: Any) -> Engine:
        e = Engine(EngineConfig(role=role, costs=CostModel(time_scale=0), **cfg), TOK, EngineMetrics("m"))
        await e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        await e.stop()


def words(n: int, start: int = 0) -> list[int]:
    return TOK.word_ids[start : start + n]


async def run(
    engine: Engine, prompt: list[int], params: dict[str, Any] | None = None, max_tokens: int = 30
) -> tuple[list[int], Output]:
    ids: list[int] = []
    last = None
    sampling = Sampling(max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate(prompt, sampling, params, "req"):
        ids += out.token_ids
        last = out
    assert last is not None and last.finish_reason is not None
    return ids, last


def tokens(engine: Engine, source: str) -> float:
    value = engine.metrics.registry.get_sample_value(
        "vllm:prompt_tokens_by_source_total", {"model_name": "m", "engine": "0", "source": source}
    )
    return value or 0.0


def local_hits(engine: Engine) -> float:
    value = engine.metrics.registry.get_sample_value("vllm:prefix_cache_hits_total", {"model_name": "m", "engine": "0"})
    return value or 0.0


P_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_decode_pulls_everything_its_prefix_cache_lacks(make_engine: MakeEngine) -> None:
    p, d, c = await make_engine("prefill"), await make_engine("decode"), await make_engine("colocated")
    shared, prompt = words(40), words(40) + words(30, 500)
    await run(d, shared)  # D now caches two full blocks (32 tokens) of the shared prefix
    _, p_out = await run(p, prompt, dict(P_REQUEST), max_tokens=1)
    params = p_out.kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == 70
    assert len(params["remote_block_ids"][0]) == 5  # ceil(70 / 16)
    assert len(p.pins) == 1
    hits_before = local_hits(d)
    answer, _ = await run(d, prompt, params)
    assert local_hits(d) - hits_before == 32
    assert tokens(d, "external_kv_transfer") == 70 - 32
    assert p.pins == {}  # D's notification freed P's lease
    assert answer == (await run(c, prompt))[0]


async def test_decode_with_a_full_local_hit_only_notifies(make_engine: MakeEngine) -> None:
    p, d = await make_engine("prefill"), await make_engine("decode")
    prompt = words(33)  # two full blocks cached; the hit is capped below the prompt length
    await run(d, prompt)
    _, p_out = await run(p, prompt, dict(P_REQUEST), max_tokens=1)
    await run(d, prompt, p_out.kv_transfer_params)
    assert tokens(d, "external_kv_transfer") == 1  # 33 - 32: the token after the cached blocks
    assert p.pins == {}


async def decode_handle(
    make_engine: MakeEngine, prompt: list[int], **d_cfg: Any
) -> tuple[Engine, dict[str, Any], list[int]]:
    """A bidirectional D that answered ``prompt`` (P's blocks pulled), its handle and its sequence."""
    p, d = await make_engine("prefill"), await make_engine("decode", **d_cfg)
    _, p_out = await run(p, prompt, dict(P_REQUEST), max_tokens=1)
    answer, d_out = await run(d, prompt, p_out.kv_transfer_params, max_tokens=40)
    handle = d_out.kv_transfer_params
    assert handle is not None
    return d, handle, prompt + answer


async def test_decode_returns_its_handle_in_its_own_clock(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40), decoder_kv_blocks_ttl=480.0)
    assert handle["do_remote_prefill"] is False and handle["do_remote_decode"] is True
    assert handle["remote_engine_id"] == d.engine_id
    assert handle["remote_port"] == d.side_channel_port
    assert handle["remote_num_tokens"] == len(seq) - 1  # the last sampled token has no KV yet
    assert len(handle["remote_block_ids"][0]) == -(-(len(seq) - 1) // 16)
    assert d.clock() < handle["remote_blocks_expiry_time"] <= d.clock() + 480.0
    assert list(d.pins) == [handle["remote_request_id"]]


@pytest.mark.parametrize(
    ("case", "warm", "expected_pull", "correct"),
    [
        ("extension", 0, 79, True),  # min(79, 90) - 0
        ("extension", 40, 79 - 32, True),  # P's own cache covers two blocks
        ("exact", 0, 79, True),  # P's prompt is exactly D's computed tokens
        ("shorter", 0, 50, False),  # min(79, 50): end-trim puts D's tail at P's head
    ],
)
async def test_prefill_pulls_min_of_remote_and_prompt_minus_its_local_hit(
    make_engine: MakeEngine,
    case: str,
    warm: int,
    expected_pull: int,
    correct: bool,
) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40))
    assert handle["remote_num_tokens"] == 79
    prompt = {"extension": seq + words(10, 900), "exact": seq[:79], "shorter": seq[:50]}[case]
    p2 = await make_engine("prefill", kv_recompute_threshold=0)
    c = await make_engine("colocated")
    if warm:
        await run(p2, seq[:warm], max_tokens=1)  # caches the full blocks of seq[:warm], nothing more
    answer, _ = await run(p2, prompt, {**handle, "do_remote_decode": True, "do_remote_prefill": False})
    assert tokens(p2, "external_kv_transfer") == expected_pull
    assert d.pins == {}  # single use: the read's notification freed D's blocks
    truth, _ = await run(c, prompt)
    assert (answer == truth) is correct


async def test_below_the_recompute_threshold_nothing_is_pulled_but_d_is_freed(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40))
    p2, c = await make_engine("prefill", kv_recompute_threshold=80), await make_engine("colocated")
    prompt = seq + words(5, 900)
    answer, _ = await run(p2, prompt, {**handle, "do_remote_decode": True, "do_remote_prefill": False})
    assert tokens(p2, "external_kv_transfer") == 0  # 79 < 80
    assert d.pins == {}
    assert answer == (await run(c, prompt))[0]


async def test_zero_remote_tokens_frees_the_pin_without_a_pull(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40))
    p2 = await make_engine("prefill", kv_recompute_threshold=0)
    await run(p2, seq, {**handle, "remote_num_tokens": 0, "do_remote_decode": True, "do_remote_prefill": False})
    assert tokens(p2, "external_kv_transfer") == 0
    assert d.pins == {}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_read_within_five_seconds_of_expiry_is_declined(make_engine: MakeEngine, policy: str) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40), decoder_kv_blocks_ttl=4.0)
    p2 = await make_engine("prefill", kv_recompute_threshold=0, kv_load_failure_policy=policy)
    c = await make_engine("colocated")
    prompt = seq + words(10, 900)
    params = {**handle, "do_remote_decode": True, "do_remote_prefill": False}
    if policy == "fail":
        with pytest.raises(EngineError):
            await run(p2, prompt, params)
    else:
        assert (await run(p2, prompt, params))[0] == (await run(c, prompt))[0]
    assert tokens(p2, "external_kv_transfer") == 0
    assert (
        p2.metrics.registry.get_sample_value("vllm:nixl_num_kv_expired_reqs_total", {"model_name": "m", "engine": "0"})
        == 1
    )


async def test_a_restarted_engine_fails_the_handshake_of_old_handles(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40))
    old = d.engine_id
    d.restart()
    assert d.engine_id != old and d.pins == {}
    p2 = await make_engine("prefill", kv_recompute_threshold=0)
    with pytest.raises(EngineError):
        await run(p2, seq, {**handle, "do_remote_decode": True, "do_remote_prefill": False})
    assert p2.pool.num_free == p2.pool.num_blocks  # the failed request left nothing allocated


async def test_without_bidirectional_decode_returns_nothing_and_frees_its_blocks(make_engine: MakeEngine) -> None:
    p, d = await make_engine("prefill"), await make_engine("decode", bidirectional=False)
    _, p_out = await run(p, words(40), dict(P_REQUEST), max_tokens=1)
    _, d_out = await run(d, words(40), p_out.kv_transfer_params)
    assert d_out.kv_transfer_params is None
    assert d.pins == {} and d.pool.num_free == d.pool.num_blocks


async def test_a_colocated_engine_ignores_kv_transfer_params(make_engine: MakeEngine) -> None:
    c = await make_engine("colocated")
    plain, _ = await run(c, words(40, 7))
    with_params, out = await run(c, words(40, 7), dict(P_REQUEST))
    assert out.kv_transfer_params is None and with_params == plain


async def test_a_handle_sent_to_a_prefill_without_bidirectional_fails_cleanly(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40))
    p2 = await make_engine("prefill", bidirectional=False)
    await run(p2, seq[:40], max_tokens=1)  # a local prefix hit that the failing request takes first
    with pytest.raises(EngineError):
        await run(p2, seq, {**handle, "do_remote_decode": True, "do_remote_prefill": False})
    assert p2.pool.num_free == p2.pool.num_blocks


async def test_a_request_waits_for_free_blocks_instead_of_failing(make_engine: MakeEngine) -> None:
    d, handle, seq = await decode_handle(make_engine, words(150), num_blocks=16)
    assert len(handle["remote_block_ids"][0]) == 12  # pinned for the TTL: 4 of 16 blocks are free
    waiting = asyncio.create_task(run(d, words(100, 300)))  # needs 7 blocks for its prompt
    for _ in range(100):  # let the request reach the engine
        if d.blocked:
            break
        await asyncio.sleep(0)
    assert d.blocked == 1 and not waiting.done()
    assert d.expire_handles() == 1  # the TTL lapses: the pin's blocks are freed
    _, out = await waiting
    assert out.finish_reason == "length" and d.blocked == 0
    with pytest.raises(EngineError):  # more than the whole cache can never be admitted
        await run(d, words(257, 1000))


@pytest.mark.parametrize(("d_skew", "p_skew"), [(1000.0, 0.0), (-1000.0, 0.0), (0.0, 5000.0)])
async def test_expiry_is_judged_on_d_clock_through_the_handshake_offset(
    make_engine: MakeEngine,
    d_skew: float,
    p_skew: float,
) -> None:
    d, handle, seq = await decode_handle(make_engine, words(40), clock_skew_s=d_skew)
    p2 = await make_engine("prefill", kv_recompute_threshold=0, clock_skew_s=p_skew)
    await run(p2, seq, {**handle, "do_remote_decode": True, "do_remote_prefill": False})
    assert tokens(p2, "external_kv_transfer") == handle["remote_num_tokens"]  # not declined


@pytest.mark.parametrize("side", ["decode_ttl", "prefill_lease"])
async def test_unread_pins_are_released_when_their_time_is_up(make_engine: MakeEngine, side: str) -> None:
    if side == "decode_ttl":
        engine, _, _ = await decode_handle(make_engine, words(40), decoder_kv_blocks_ttl=0.01)
    else:
        engine = await make_engine("prefill", kv_lease_duration=0.01)
        await run(engine, words(40), dict(P_REQUEST), max_tokens=1)  # no D ever reads it
    assert len(engine.pins) == 1
    for _ in range(200):  # the expiry sweep runs on its own schedule
        if not engine.pins:
            break
        await asyncio.sleep(0.05)
    assert engine.pins == {} and engine.pool.num_free == engine.pool.num_blocks
    assert (
        engine.metrics.registry.get_sample_value(
            "vllm:nixl_num_kv_expired_reqs_total", {"model_name": "m", "engine": "0"}
        )
        == 1
    )


async def test_requests_that_outgrow_the_cache_are_preempted_and_answer_the_same(make_engine: MakeEngine) -> None:
    # 4 requests of 64 prompt + 200 generated tokens need 4 x 17 blocks; the engine has 40: some must
    # give their blocks back mid-answer and be computed again, as vLLM preempts them, never hang
    small = await make_engine("colocated", num_blocks=40)
    big = await make_engine("colocated")
    prompts = [words(64, 100 * i) for i in range(4)]
    expected = [await run(big, p, max_tokens=200) for p in prompts]
    got = await asyncio.wait_for(asyncio.gather(*(run(small, p, max_tokens=200) for p in prompts)), 60)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    assert (
        small.metrics.registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "m", "engine": "0"}) or 0
    ) >= 1


async def _until(cond: Callable[[], bool], what: str) -> None:
    """Yield to the loop until ``cond`` holds (bounded: a failure names what never happened)."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


async def test_admission_is_first_come_first_served(make_engine: MakeEngine) -> None:
    """vLLM's FCFS scheduler stops at the first waiting request it cannot allocate: a small request
    that arrives after it waits too, though its blocks are free."""
    d, _, _ = await decode_handle(make_engine, words(150), num_blocks=16)  # 12 of 16 blocks pinned
    big = asyncio.create_task(run(d, words(100, 300)))  # 7 blocks: waits
    await _until(lambda: d.blocked == 1, "the long prompt waits for blocks")
    small = asyncio.create_task(run(d, words(5, 600)))  # 1 block, free now
    await _until(lambda: d.blocked == 2, "the short prompt waits behind it")
    assert not small.done()
    assert d.expire_handles() == 1
    assert (await big)[1].finish_reason == "length"
    assert (await small)[1].finish_reason == "length"


async def _release_aborted_in_queue(make_engine: MakeEngine, form: dict[str, Any]) -> Engine:
    """D's handle sent to a P whose queue is stuck (a prompt P cannot allocate is ahead of it), then
    the release aborted there, as the gateway gives up on it; D is returned for its pins."""
    d, handle, seq = await decode_handle(make_engine, words(40))
    p = await make_engine("prefill", num_blocks=16)
    _, leased = await run(p, words(200, 300), dict(P_REQUEST), max_tokens=1)  # 13 blocks leased to a D
    assert leased.kv_transfer_params is not None and len(p.pins) == 1
    stuck = asyncio.create_task(run(p, words(100, 700)))  # 7 blocks: waits, and so does all behind it
    await _until(lambda: p.blocked == 1, "P's queue stops at a prompt it cannot allocate")
    release = asyncio.create_task(run(p, words(1, 900), {**handle, **form}, max_tokens=16))
    await _until(lambda: p.blocked == 2, "the release waits behind it")
    release.cancel()  # the gateway closes the stream: P aborts the request in its queue
    with pytest.raises(asyncio.CancelledError):
        await release
    stuck.cancel()
    await _until(lambda: not p.connector.notices, "P's notices to D are out")
    return d


async def test_a_release_aborted_in_ps_queue_as_a_remote_prefill_frees_d(make_engine: MakeEngine) -> None:
    d = await _release_aborted_in_queue(make_engine, {"do_remote_prefill": True, "do_remote_decode": False})
    await _until(lambda: not d.pins, "D frees the pin on P's notice")
    assert d.connector.unrecognized_notices == 0


async def test_a_release_aborted_in_ps_queue_in_the_proxy_form_frees_nothing(make_engine: MakeEngine) -> None:
    d = await _release_aborted_in_queue(
        make_engine, {"do_remote_prefill": False, "do_remote_decode": True, "remote_num_tokens": 0}
    )
    assert len(d.pins) == 1  # vLLM: request_finished stops tracking an aborted decode-form request
