"""Decode admission (gateway.decode_admission): who gets in, in what order, and what waiting costs."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from turnkv.errors import Overloaded
from turnkv.gateway.decode_admission import DecodeAdmission

D = "http://d"


def admission(capacity: int | None = 1000, pinned: int = 0, wait_s: float = 5.0) -> DecodeAdmission:
    pins = {D: pinned}
    return DecodeAdmission(capacity=lambda url: capacity, pinned=lambda url: pins[url], admit_share=0.9, wait_s=wait_s)


async def test_turns_that_fit_go_at_once_and_the_next_waits_its_turn() -> None:
    adm = admission()  # room: 900 tokens
    order: list[str] = []
    entered = asyncio.Event()
    release_first = asyncio.Event()

    async def turn(name: str, tokens: int, hold: asyncio.Event | None = None) -> None:
        async with adm.hold(D, tokens):
            order.append(name)
            entered.set()
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(turn("a", 600, release_first))
    await entered.wait()
    waiting = [asyncio.create_task(turn("b", 400)), asyncio.create_task(turn("c", 100))]
    await asyncio.sleep(0)
    assert order == ["a"]  # b does not fit beside a; c would, but does not pass b
    release_first.set()
    await asyncio.gather(first, *waiting)
    assert order == ["a", "b", "c"] and adm.reserved(D) == 0


async def test_a_turn_that_waits_too_long_is_told_to_come_back() -> None:
    adm = admission(wait_s=0.05)
    async with adm.hold(D, 800):
        with pytest.raises(Overloaded) as err:
            async with adm.hold(D, 800):
                pass
    assert err.value.status == 503 and "retry-after" in err.value.headers()
    assert adm.reserved(D) == 0


@pytest.mark.parametrize(
    ("capacity", "pinned", "beside", "tokens", "admitted"),
    [
        (None, 0, 10**6, 10**6, True),  # capacity unknown: no limit
        (1000, 500, 1, 500, False),  # pins take room: 900 - 500 - 1 leaves 399
        (1000, 500, None, 500, True),  # ... but a turn alone is never held back (D queues it itself)
        (1000, 0, None, 5000, True),  # larger than the whole share: admitted alone
    ],
)
async def test_what_fits(capacity: int | None, pinned: int, beside: int | None, tokens: int, admitted: bool) -> None:
    adm = admission(capacity, pinned, wait_s=0.05)
    async with contextlib.AsyncExitStack() as stack:
        if beside is not None:
            await stack.enter_async_context(adm.hold(D, beside))
        try:
            async with adm.hold(D, tokens):
                got_in = True
        except Overloaded:
            got_in = False
    assert got_in is admitted


async def test_a_waiter_that_gives_up_lets_the_next_in() -> None:
    adm = admission()
    async with adm.hold(D, 900):
        gone = asyncio.create_task(adm.hold(D, 900).__aenter__())
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
    async with adm.hold(D, 900):
        assert adm.reserved(D) == 900
