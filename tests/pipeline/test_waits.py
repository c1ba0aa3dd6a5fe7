"""A turn's waits on its engines (``TurnRun.until_aborted``): they run in the turn's own task, so what ends
them must leave that task as it found it: a deadline or an abort becomes the turn's error and no pending
cancellation, and a cancellation from outside (the client left) stays one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tests.pipeline.harness import D0, P0, Chat, Gateway, gateway
from turnkv.engine.base import CallMeta
from turnkv.errors import FirstTokenDeadline, ShuttingDown, UpstreamUnavailable
from turnkv.gateway.services import Services
from turnkv.gateway.turn.deadline import Deadline
from turnkv.gateway.turn.request import Turn
from turnkv.gateway.turn.run import TurnRun

DEADLINE = Deadline("prefill", P0, first_s=0.01, cap_s=0.01)  # never renewed: its cap is its first deadline


def _run(svc: Services) -> TurnRun:
    turn = Turn(request_id="r", body={}, stream=True, meta=CallMeta("r"), conversation=None, index=1)
    return TurnRun(svc, turn)


async def _forever() -> None:
    await asyncio.Event().wait()


async def _turns_cancel_into_error() -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        raise UpstreamUnavailable("the call ended its own way", leg="prefill") from None


async def _nothing_pending() -> None:
    """The turn's task carries no cancellation the wait asked for."""
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # a cancellation left pending would be thrown here


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (_forever, FirstTokenDeadline),  # a missed deadline is the turn's error
        (_turns_cancel_into_error, UpstreamUnavailable),  # a call that ends its own way keeps its error
    ],
    ids=["missed_deadline", "call_ends_its_own_way"],
)
async def test_a_wait_given_up_on_at_its_deadline_ends_with_an_error_and_leaves_no_cancellation(
    call: Callable[[], Awaitable[None]], error: type[Exception]
) -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        with pytest.raises(error):
            await run.until_aborted(call(), DEADLINE)
        await _nothing_pending()


async def test_an_abort_ends_a_wait_and_leaves_no_cancellation() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        asyncio.get_running_loop().call_soon(run.abort, "shutdown")
        with pytest.raises(ShuttingDown):
            await run.until_aborted(_forever())
        await _nothing_pending()


async def test_a_cancellation_from_outside_stays_one() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        waiting = asyncio.ensure_future(run.until_aborted(_forever(), DEADLINE))
        await asyncio.sleep(0)  # the wait has begun
        waiting.cancel()  # the client left, before the deadline
        await asyncio.wait({waiting})
        assert waiting.cancelled()


async def test_a_cancellation_from_outside_stays_one_when_an_abort_comes_with_it() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        waiting = asyncio.ensure_future(run.until_aborted(_forever()))
        await asyncio.sleep(0)  # the wait has begun

        def both() -> None:  # a shutdown's abort and the client leaving, before the turn runs again
            run.abort("shutdown")
            waiting.cancel()

        asyncio.get_running_loop().call_soon(both)
        await asyncio.wait({waiting})
        assert waiting.cancelled()


N = 12  # conversations at once


async def _conversations(gw: Gateway, *, stream: bool) -> list[Chat]:
    chats = [Chat(gw, session=f"c{i}", stream=stream) for i in range(N)]
    firsts = await asyncio.gather(*(c.say(f"question {i}") for i, c in enumerate(chats)))
    assert all(a.status == 200 and a.error is None for a in firsts)
    return chats


async def test_a_shutdown_ends_many_turns_waiting_on_p_at_once() -> None:
    # every later turn's call to P hangs; the shutdown's abort must end each wait, and leave no call hanging
    async with gateway(drain_s=0.0, timeouts={"prefill_first_token_s": 30.0}) as gw:
        chats = await _conversations(gw, stream=False)
        gw.engine.faults(P0, hang=N, leg="prefill")
        turns = [asyncio.create_task(c.say("and then?")) for c in chats]
        await gw.wait_for("every turn to wait on P", lambda: gw.engine[P0].hung == N)
        gw.svc.drain.bind(asyncio.get_running_loop())
        gw.svc.drain.begin()
        await asyncio.wait(turns, timeout=10)  # not wait_for: cancelling the clients would end the turns too
        assert all(t.done() for t in turns), "the abort did not end every turn's wait on P"
        errors = [t.result().error for t in turns]
        assert all(e is not None and e["code"] == "shutting_down" for e in errors), errors
        assert gw.engine[P0].hung == 0  # each call was given up on, none left waiting


@pytest.mark.parametrize("small_d", [False, True])
async def test_many_turns_whose_d_streams_stall_each_end_and_their_conversations_go_on(small_d: bool) -> None:
    # D's streams open and show nothing: each turn misses its first-token deadline and runs once more; a
    # rerun may meet a stall too (which turn's call meets one is the scheduler's), and then ends with an
    # OpenAI error. Either way no turn hangs, no stream stays open, and every conversation's next turn works;
    # also on a D whose KV holds the pins of a third of the conversations only
    async with gateway(timeouts={"decode_first_token_s": 0.25}) as gw:
        chats = await _conversations(gw, stream=True)
        d = gw.engine[D0]
        if small_d:
            d.capacity_tokens = d.pinned_tokens // 3
            await gw.wait_for("D's capacity to be read", lambda: gw.svc.pins.capacity(D0) == d.capacity_tokens)
        gw.engine.faults(D0, stall=N)
        answers = await asyncio.gather(*(c.say("and then?") for c in chats))
        for a in answers:
            assert a.done, a.events[-1:]  # ended as OpenAI streams end, with or without an error
            assert a.error is None or a.error["code"], a.error
        answered = [a for a in answers if a.error is None]
        assert answered, "no turn got its answer after a stall"
        # every stall was met (N turns made at least N calls) and each stalled stream given up on once
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="decode") == N
        await gw.wait_for("D's streams to close", lambda: gw.engine[D0].running == 0)
        for c, a in zip(chats, answers, strict=True):
            if a.error is not None:
                c.messages.pop()  # the client sends that turn again
        again = await asyncio.gather(*(c.say("once more") for c in chats))
        assert all(a.error is None and a.done for a in again)
        if small_d:
            await gw.wait_for("D's pins to fit its KV", lambda: d.pinned_tokens <= (d.capacity_tokens or 0))
