"""The write-back service (``gateway.writeback``): sent only while P has room, a few at a time, given up (the
handle released) when P has none in time, when it fails, or when the conversation's next turn comes first.
An engine whose write-backs a handler answers, a real fleet fed metrics readings."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.store_contract import rec
from turnkv.config import WriteBackSettings
from turnkv.engine.base import LoadSample, WriteBackResult
from turnkv.engine.mock import Call, MockEngine, WriteBackCall
from turnkv.errors import UpstreamStatus
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.writeback import Job, ThinkTimes, WriteBacks, job_key
from turnkv.reuse.chain import sequence_digest

P, D = "http://p0", "http://d0"


class Rig:
    def __init__(self, handler: Any = None, **settings: Any) -> None:
        self.fleet = Fleet([P], [D])
        self.fleet.apply_load(P, LoadSample(kv_usage=0.2, capacity_tokens=10_000))
        self.metrics = GatewayMetrics(None, prefill=[P], decode=[D])
        self.released: list[tuple[str, str]] = []
        self.engine = MockEngine(handler or (lambda call: None))
        self.wb = WriteBacks(
            self.engine,
            self.fleet,
            self.metrics,
            WriteBackSettings(**settings),
            lambda h, why, url, tokens: self.released.append((h["pin"], why)),
            lambda: "m",
        )

    def job(self, pin: str, key: str = "conv", lacks: int = 500) -> Job:
        handle = {"pin": pin, "tokens": 600}
        return Job(key, handle, list(range(600)), P, D, lacks, expires_at=time.time() + 300)

    def count(self, result: str) -> float:
        return self.metrics.write_backs.labels(result)._value.get()  # type: ignore[no-any-return]

    def sent(self) -> list[str]:
        return [c.call.handle["pin"] for c in self.engine.calls if isinstance(c, WriteBackCall)]


async def until(predicate: Any) -> None:
    for _ in range(500):  # bounded: 5 s
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came true")


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_write_back_goes_to_p_with_the_sequence_and_frees_nothing_else(running: list[Any]) -> None:
    rig = Rig(priority=10)
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await asyncio.wait_for(rig.wb.drain(5), 5)
    (call,) = [c for c in rig.engine.calls if isinstance(c, WriteBackCall)]
    assert call.base == P and list(call.call.token_ids) == list(range(600))
    assert (call.call.model, call.call.priority, call.call.release_via) == ("m", 10, D)
    assert rig.count("cached") == 1 and rig.released == []
    v = rig.fleet.view(P)
    assert v is not None and v.in_flight == 0


async def test_p_without_room_defers_it_and_the_handle_is_released(running: list[Any]) -> None:
    # P's KV at 84% of 10,000 tokens: 500 more would pass 85%; past max_wait_s it is given up
    rig = Rig(max_wait_s=0.0)
    rig.fleet.apply_load(P, LoadSample(kv_usage=0.84, capacity_tokens=10_000))
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    rig.wb.submit(rig.job("b", key="other", lacks=50))  # 50 more fit
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.sent() == ["b"]
    assert rig.released == [("a", "write_back_deferred")] and rig.count("deferred") == 1


def held(rig: Rig) -> int:
    v = rig.fleet.view(D)
    assert v is not None
    return v.let_go_tokens


async def test_d_counts_a_write_backs_blocks_in_use_until_p_has_read_them(running: list[Any]) -> None:
    # D frees a written-back handle's blocks only when P's read tells it: until then they are D's KV in use
    gate = asyncio.Event()

    async def slow(call: Call) -> None:
        await gate.wait()

    rig = Rig(handler=slow)
    rig.wb.submit(rig.job("a"))
    rig.wb.submit(rig.job("b", key="other"))
    assert held(rig) == 1_200
    assert rig.wb.reclaim("other") is not None and held(rig) == 600  # a record pins it again
    running.append(asyncio.create_task(rig.wb.run()))
    await until(lambda: len(rig.sent()) == 1)
    assert held(rig) == 600  # being read
    gate.set()
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert held(rig) == 0 and rig.count("cached") == 1


async def test_a_write_back_given_up_hands_its_blocks_to_the_release(running: list[Any]) -> None:
    rig = Rig(max_wait_s=0.0)
    rig.fleet.apply_load(P, LoadSample(kv_usage=0.99, capacity_tokens=10_000))
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.released == [("a", "write_back_deferred")] and held(rig) == 0  # the releaser counts them now


async def test_at_most_max_in_flight_run_at_once_on_one_p(running: list[Any]) -> None:
    gate = asyncio.Event()
    started = asyncio.Event()

    async def handler(call: Call) -> None:
        started.set()
        await gate.wait()

    rig = Rig(handler, max_in_flight=1, max_wait_s=30.0)
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    rig.wb.submit(rig.job("b", key="other"))
    await asyncio.wait_for(started.wait(), 5)
    await until(lambda: rig.wb.waiting == 1)  # the other waits for P's room
    assert rig.sent() == ["a"]
    gate.set()
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.sent() == ["a", "b"] and rig.count("cached") == 2


async def test_a_failed_write_back_releases_the_handle(running: list[Any]) -> None:
    def handler(call: Call) -> None:
        raise UpstreamStatus(500, {"error": {"message": "Internal server error"}}, leg="prefill")

    rig = Rig(handler)
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.released == [("a", "write_back_failed")] and rig.count("failed") == 1


async def test_the_next_turn_takes_back_a_write_back_not_yet_sent(running: list[Any]) -> None:
    rig = Rig(max_wait_s=30.0)
    rig.fleet.apply_load(P, LoadSample(kv_usage=0.99, capacity_tokens=10_000))  # no room: it waits
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await until(lambda: rig.wb.waiting == 1)
    assert rig.wb.reclaim("other") is None  # another conversation's turn takes nothing
    handle = rig.wb.reclaim("conv")
    assert handle is not None and handle["pin"] == "a"
    assert rig.wb.reclaim("conv") is None  # once
    await asyncio.wait_for(rig.wb.drain(5), 5)
    # still pinned on D, the turn's now: neither sent nor released
    assert rig.sent() == [] and rig.released == [] and rig.count("reclaimed") == 1


def test_a_write_back_is_found_by_its_records_pool_sequence_and_moment() -> None:
    """Identical conversations share a pool (one store key), each with its own handle: a turn takes back
    only the write-back of the record it claimed (the same record, stored without its handle: same key)."""
    mine = dataclasses.replace(rec("p1"), tokens_digest=sequence_digest(list(range(20))), created_at=5.0)
    assert job_key("k", mine) == job_key("k", mine.unpin("write_back"))
    assert job_key("k", mine) != job_key("other", mine)
    assert job_key("k", mine) != job_key("k", dataclasses.replace(mine, created_at=5.5))  # another run's
    assert job_key("k", mine) != job_key("k", dataclasses.replace(mine, tokens_digest=sequence_digest([1])))


async def test_a_write_back_already_sent_is_not_taken_back(running: list[Any]) -> None:
    gate, started = asyncio.Event(), asyncio.Event()

    async def handler(call: Call) -> None:
        started.set()
        await gate.wait()

    rig = Rig(handler)
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await asyncio.wait_for(started.wait(), 5)
    assert rig.wb.reclaim("conv") is None  # P is reading it: the next turn finds it in P's cache
    gate.set()
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.sent() == ["a"] and rig.count("cached") == 1 and rig.released == []


async def test_a_conversations_next_write_back_replaces_one_not_yet_sent(running: list[Any]) -> None:
    rig = Rig(max_wait_s=30.0)
    rig.fleet.apply_load(P, LoadSample(kv_usage=0.99, capacity_tokens=10_000))
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    rig.wb.submit(rig.job("b"))  # the same conversation's next turn, written back before the first was sent
    await until(lambda: rig.released == [("a", "write_back_cancelled")])
    rig.fleet.apply_load(P, LoadSample(kv_usage=0.2, capacity_tokens=10_000))
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.sent() == ["b"] and rig.count("cancelled") == 1


async def test_a_pinned_result_is_counted(running: list[Any]) -> None:
    rig = Rig(lambda call: WriteBackResult.PINNED)
    running.append(asyncio.create_task(rig.wb.run()))
    rig.wb.submit(rig.job("a"))
    await asyncio.wait_for(rig.wb.drain(5), 5)
    assert rig.count("pinned") == 1 and rig.released == []


def test_think_time_is_a_low_quantile_of_the_gaps_once_enough_are_seen() -> None:
    t = ThinkTimes()
    for gap in (5.0, 0.4, 0.6, 0.5, 0.7, 0.45, 0.55):
        t.observe(gap)
    assert t.quantile() is None  # seven: too few
    t.observe(0.05)
    assert t.quantile(0.1) == 0.05 and t.quantile() == 0.55
