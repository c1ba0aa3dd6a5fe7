"""The simulated engine's step: what vLLM's chunked-prefill scheduler puts into it, and how long it lasts.

Tables over the pure parts (``schedule_chunks``, ``CostModel.step_s``), then the engine itself at time
scale 0: a long prompt arriving while a stream decodes is prefilled in chunks, and the stream keeps
getting a token every step meanwhile (counted, not timed).
"""

from __future__ import annotations

import asyncio

import pytest

from turnkv.sim import costs as c
from turnkv.sim.costs import CostModel
from turnkv.sim.engine import Engine, EngineConfig, schedule_chunks
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import Sampling
from turnkv.sim.tokenizer import Tokenizer

TOK = Tokenizer()
M = CostModel()


@pytest.mark.parametrize(
    ("budget", "batch", "remaining", "chunks"),
    [
        (8192, 0, [8000], [8000]),  # a lone prompt that fits
        (8192, 32, [8192], [8160]),  # decode tokens come out of the budget first; the rest goes on next step
        (8192, 32, [100, 9000, 50], [100, 8060]),  # in arrival order; the third waits for the next step
        (8192, 8192, [10], []),  # a full decode batch leaves nothing for prefill
        (64, 0, [64 * 10], [64]),  # a long prompt split over steps
        (8192, 4, [], []),
    ],
)
def test_schedule_chunks_shares_the_budget_with_decode(
    budget: int, batch: int, remaining: list[int], chunks: list[int]
) -> None:
    assert schedule_chunks(budget, batch, remaining) == chunks


@pytest.mark.parametrize(
    ("remaining", "chunks"),
    [
        ([328], [64]),  # --long-prefill-token-threshold 64: a turn's 328 tokens over 6 steps
        ([328, 40, 8000], [64, 40, 64]),  # every request at most 64 a step
    ],
)
def test_the_long_prefill_threshold_caps_each_request_per_step(remaining: list[int], chunks: list[int]) -> None:
    assert schedule_chunks(8192, 20, remaining, 64) == chunks


def test_a_long_prefill_needs_as_many_steps_as_budgets_it_spans() -> None:
    left, steps = 20_000, 0
    while left:
        (n,) = schedule_chunks(8192, 30, [left])
        left -= n
        steps += 1
    assert steps == 3  # 8162 + 8162 + 3676


def test_the_step_formula_with_its_named_constants() -> None:
    # 30 streams reading 8k tokens of context each, and a 328-token chunk over an 8.3k-token history
    got = M.step_s(30, 30 * 8192, [(328, 8300)])
    want = (
        c.STEP_BASE_S
        + 30 * c.DECODE_PER_SEQ_S
        + 30 * 8192 * c.DECODE_PER_CTX_TOKEN_S
        + c.PREFILL_PER_TOKEN_S * (30 + 328 - c.FREE_TOKENS)
        + c.PREFILL_ATTN_S * 328 * (8300 + 164)
    )
    assert got == pytest.approx(want)
    assert M.step_s(0, 0) == 0.0
    assert M.decode_s(1) == pytest.approx(c.STEP_BASE_S + c.DECODE_PER_SEQ_S)


def test_the_priors_match_the_h200_prefills_they_were_fitted_to() -> None:
    # a cold prefill through P took 113-121 ms for 4.2k tokens and 547-603 ms for 16.4k on the H200
    assert 0.110 <= M.prefill_s(4200, 0) <= 0.121
    assert 0.540 <= M.prefill_s(16400, 0) <= 0.603


@pytest.mark.parametrize(
    ("batch", "context", "chunks"),
    [
        (1, 1000, [(1, 1000)]),  # D's last-token recompute of a P/D turn: within the step's fixed cost
        (30, 250_000, [(1, 8000)]),
    ],
)
def test_one_prefill_token_beside_a_small_batch_costs_next_to_nothing(
    batch: int, context: int, chunks: list[tuple[int, int]]
) -> None:
    extra = M.step_s(batch, context, chunks) - M.decode_s(batch, context)
    assert 0 <= extra < 0.0005


def test_a_prefill_in_the_batch_lengthens_the_step_every_stream_waits_for() -> None:
    base = M.decode_s(30, 30 * 8192)
    with_turn = M.step_s(30, 30 * 8192, [(328, 8300)])
    with_history = M.step_s(30, 30 * 8192, [(8162, 0)])
    assert base < with_turn < with_history
    assert M.decode_s(8, 8 * 8192) < M.decode_s(64, 64 * 8192)  # a bigger batch, a longer step
    assert M.decode_s(30, 30 * 1024) < M.decode_s(30, 30 * 8192)  # longer contexts, a longer step


async def _tokens_until_first(engine: Engine, stream: asyncio.Queue[int], prompt: list[int]) -> int:
    """Tokens the running stream got between ``prompt``'s arrival and its first token."""
    before = stream.qsize()
    async for _ in engine.generate(prompt, Sampling(max_tokens=1, ignore_eos=True), None, "long"):
        break
    return stream.qsize() - before


async def _stream_tokens_during_a_long_prefill(budget: int) -> int:
    cfg = EngineConfig(role="colocated", costs=CostModel(time_scale=0), max_num_batched_tokens=budget)
    engine = Engine(cfg, TOK, EngineMetrics("m"))
    await engine.start()
    got: asyncio.Queue[int] = asyncio.Queue()
    running = asyncio.Event()

    async def decode() -> None:
        async for out in engine.generate(TOK.word_ids[:20], Sampling(max_tokens=5000, ignore_eos=True), None, "s"):
            for t in out.token_ids:
                got.put_nowait(t)
            if got.qsize() >= 3:
                running.set()

    task = asyncio.create_task(decode())
    try:
        async with asyncio.timeout(30):
            await running.wait()  # the stream runs
            return await _tokens_until_first(engine, got, TOK.word_ids[100:740])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.stop()


async def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_decodes() -> None:
    # 640 new tokens at 63 a step (a budget of 64 less the stream's token): 11 steps of prefill, each also
    # a decode step for the stream; with the default budget one step takes the whole prompt
    chunked = await _stream_tokens_during_a_long_prefill(64)
    whole = await _stream_tokens_during_a_long_prefill(8192)
    assert chunked >= 10 > whole


async def _answers(num_blocks: int, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    cfg = EngineConfig(role="colocated", costs=CostModel(time_scale=0), num_blocks=num_blocks)
    engine = Engine(cfg, TOK, EngineMetrics("m"))
    await engine.start()

    async def one(prompt: list[int], rid: str) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(prompt, Sampling(max_tokens=max_tokens, ignore_eos=True), None, rid):
            ids += out.token_ids
        return ids

    try:
        async with asyncio.timeout(30):
            got = await asyncio.gather(*(one(p, f"r{i}") for i, p in enumerate(prompts)))
        return list(got), engine.preemptions
    finally:
        await engine.stop()


async def test_streams_out_of_blocks_preempt_the_newest_and_answer_as_with_room() -> None:
    # three streams of 64-token prompts and 100-token answers need 33 blocks of 16; the pool has 20:
    # all three start (4 blocks each), then the newest is preempted, recomputed once blocks are free
    # again, and answers exactly as it would have with room to spare
    prompts = [TOK.word_ids[i * 64 : (i + 1) * 64] for i in range(3)]
    tight, preempted = await _answers(20, prompts, 100)
    roomy, none = await _answers(2000, prompts, 100)
    assert preempted >= 1 and none == 0
    assert tight == roomy
    assert all(len(a) == 100 for a in tight)
