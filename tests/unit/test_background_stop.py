"""The gateway's background loops end when it stops, even when a library swallowed the first cancellation."""

from __future__ import annotations

import asyncio

from turnkv.gateway.app import stop_tasks


async def _survives_one_cancel(state: list[str]) -> None:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        state.append("swallowed")  # as redis-py or aiohttp may, turning it into their own timeout error
    await asyncio.sleep(60)


def test_a_loop_that_survives_one_cancel_is_stopped() -> None:
    async def main() -> tuple[list[str], asyncio.Task[None], asyncio.Task[None]]:
        state: list[str] = []
        stubborn = asyncio.create_task(_survives_one_cancel(state))
        plain = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)  # both started
        await asyncio.wait_for(stop_tasks([stubborn, plain]), timeout=30)
        return state, stubborn, plain

    state, stubborn, plain = asyncio.run(main())
    assert state == ["swallowed"]
    assert stubborn.cancelled() and plain.cancelled()
