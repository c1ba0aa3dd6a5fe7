"""A turn's waits on its engines (``TurnRun.until_aborted``): they run in the turn's own task, so what ends
them must leave that task as it found it: a deadline or an abort becomes the turn's error and no pending
cancellation, and a cancellation from outside (the client left) stays one."""

from __future__ import annotations

import asyncio

import pytest

from tests.pipeline.harness import P0, gateway
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


async def test_a_missed_deadline_is_the_turns_error_and_leaves_no_cancellation() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        with pytest.raises(FirstTokenDeadline):
            await run.until_aborted(_forever(), DEADLINE)
        await _nothing_pending()


async def test_an_abort_ends_a_wait_and_leaves_no_cancellation() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        asyncio.get_running_loop().call_soon(run.abort, "shutdown")
        with pytest.raises(ShuttingDown):
            await run.until_aborted(_forever())
        await _nothing_pending()


async def test_a_call_that_ends_its_own_way_when_given_up_on_keeps_its_error() -> None:
    async with gateway() as gw:
        run = _run(gw.svc)
        with pytest.raises(UpstreamUnavailable):
            await run.until_aborted(_turns_cancel_into_error(), DEADLINE)
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
