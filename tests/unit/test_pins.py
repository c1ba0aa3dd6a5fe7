"""The pin budget and pressure relief (gateway.pins) over the in-process store: which handles are given
back, in which order, and what their records keep."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

import pytest

from turnkv.config import Settings
from turnkv.engine.base import LoadSample
from turnkv.engine.mock import MockEngine
from turnkv.errors import StoreError
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.pins import PinKeeper
from turnkv.gateway.release import Releaser
from turnkv.logging import make_logger
from turnkv.reuse.chain import chain_of
from turnkv.routing import Router, build_profile
from turnkv.state.base import ClaimStatus, PinEntry, Pinned
from turnkv.state.breaker import BreakerPolicy
from turnkv.state.guard import StoreGuard
from turnkv.state.memory import MemoryStore
from turnkv.state.record import ConversationRecord

D = "http://d1"


def record(i: int, tokens: int = 1000, *, stored_at: float = 0.0) -> ConversationRecord:
    now = time.time()
    return ConversationRecord(
        tenant="t",
        decode_url=D,
        prefill_url=None,
        handle={"pin": f"req-{i}", "tokens": tokens},
        engine_id="e",
        engine_epoch=None,
        num_tokens=tokens,
        chain=chain_of(list(range(tokens)), 16),
        block_size=16,
        prompt_tokens=tokens - 10,
        answer_digest="a",
        reasoning_digest=None,
        turn=2,
        created_at=stored_at or now,
        expires_at=now + 400,
        pin_id=f"req-{i}",
    )


@dataclasses.dataclass
class Rig:
    keeper: PinKeeper
    store: MemoryStore
    fleet: Fleet
    metrics: GatewayMetrics
    releaser: Releaser

    def released(self, why: str) -> float:
        return self.metrics.registry.get_sample_value("turnkv_handle_releases_total", {"why": why}) or 0.0


@pytest.fixture
def rig() -> Rig:
    settings = Settings(prefill=["http://p1"], decode=[D])
    fleet = Fleet(settings.prefill, settings.decode)
    fleet.apply_load(D, LoadSample(capacity_tokens=10_000))  # as cache_config_info says: a budget of 5,000
    metrics = GatewayMetrics()
    store = MemoryStore()
    guard = StoreGuard(store, policy=BreakerPolicy(open_s=1))
    router = Router(build_profile("affinity"), fleet.views)
    # only submit() runs here (the releases are queued, and counted)
    releaser = Releaser(MockEngine(lambda call: None), router, metrics, lambda: None)
    releaser.on_held = fleet.let_go  # as the gateway wires it
    keeper = PinKeeper(settings, fleet, guard.pins, releaser, metrics, make_logger("test", json=True))
    return Rig(keeper, store, fleet, metrics, releaser)


async def put(rig: Rig, i: int, tokens: int = 1000, stored_at: float = 0.0) -> None:
    await rig.keeper.make_room(D, tokens)
    await rig.store.records.put(f"k{i}", record(i, tokens, stored_at=stored_at), 400)


async def test_pins_within_budget_stay(rig: Rig) -> None:
    for i in range(5):
        await put(rig, i)
    assert (await rig.store.pins.pinned([D]))[D].tokens == 5000
    assert rig.released("budget") == 0


async def test_crossing_the_budget_releases_the_pins_idle_longest(rig: Rig) -> None:
    for i in range(5):
        await put(rig, i, stored_at=100.0 + i)
    await put(rig, 5, tokens=1500, stored_at=200.0)
    # 6,500 tokens would be pinned: the two oldest go, the newest stays
    assert rig.released("budget") == 2
    assert (await rig.store.pins.pinned([D]))[D].tokens <= 5000
    for i, kept in [(0, False), (1, False), (2, True), (5, True)]:
        claim = await rig.store.records.claim(f"k{i}", owner="t")
        assert claim.status is ClaimStatus.FOUND and claim.record is not None
        assert (claim.record.handle is not None) is kept
        if not kept:  # everything but the handle: the next turn can still go decode-local, and says why
            assert claim.record.unpinned == "budget" and claim.record.chain == record(i).chain


async def test_a_claimed_handle_is_never_released_by_the_budget(rig: Rig) -> None:
    for i in range(5):
        await put(rig, i, stored_at=100.0 + i)
    claim = await rig.store.records.claim("k0", owner="turn")  # a turn owns it now: it pulls or releases it itself
    await put(rig, 5, tokens=2000, stored_at=200.0)
    assert claim.record is not None and claim.record.handle is not None
    assert rig.released("budget") == 1  # k1: the claimed handle is out of the index, its owner settles it
    assert (await rig.store.records.claim("k1", owner="t")).record.handle is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("usage", "waiting", "left"), [(0.95, 0, 1000), (0.5, 3, 1000), (0.5, 0, 4000)])
async def test_pressure_releases_down_to_the_low_watermark(rig: Rig, usage: float, waiting: int, left: int) -> None:
    for i in range(4):
        await put(rig, i, stored_at=100.0 + i)
    rig.fleet.apply_load(D, LoadSample(kv_usage=usage, waiting=waiting, capacity_tokens=10_000))
    await rig.keeper.check()
    assert (await rig.store.pins.pinned([D]))[D].tokens == left  # keep share 0.1 of 10,000 tokens


async def test_the_janitor_forgets_pins_of_a_restarted_engine(rig: Rig) -> None:
    rec = dataclasses.replace(record(1), engine_epoch=1.0)
    await rig.store.records.put("k1", rec, 400)
    rig.fleet.apply_load(D, LoadSample(epoch=2.0, capacity_tokens=10_000))  # it restarted: its pins are gone
    await rig.keeper.check()
    assert await rig.store.pins.pinned([D]) == {}
    assert rig.released("budget") == rig.released("pressure") == 0  # nothing to give back


@pytest.mark.parametrize(
    ("waiting", "usage", "pinned", "tokens", "crowded"),
    [
        (0, 0.95, 0, 5000, False),
        (2, 0.95, 0, 500, False),
        (2, 0.95, 0, 1001, True),
        (2, 0.95, 1000, 1, True),
        (2, 0.5, 1000, 1, False),  # they wait for a batch slot, not for memory
        (0, 0.95, 3000, 1000, False),
    ],
)
async def test_a_new_pin_is_refused_while_requests_wait_for_memory_past_the_low_watermark(
    rig: Rig, waiting: int, usage: float, pinned: int, tokens: int, crowded: bool
) -> None:
    if pinned:
        await put(rig, 1, pinned)
    rig.fleet.apply_load(D, LoadSample(waiting=waiting, kv_usage=usage, capacity_tokens=10_000))
    view = rig.fleet.view(D)
    assert view is not None
    assert rig.keeper.crowded(view, tokens) is crowded  # keep share 0.1 of 10,000 tokens


class _IndexDown:
    """An engine's pin index on a store node that counts as down (its breaker open): every call refused."""

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        raise StoreError("store node down", kind="open")

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        raise StoreError("store node down", kind="open")

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        raise StoreError("store node down", kind="open")


async def test_a_pin_index_that_cannot_be_asked_lets_the_pin_in_over_the_budget(rig: Rig) -> None:
    # the conversation's record may live on a node that is up (a Cluster): the turn's put goes on
    keeper = PinKeeper(
        Settings(prefill=["http://p1"], decode=[D]),
        rig.fleet,
        _IndexDown(),
        Releaser(
            MockEngine(lambda call: None), Router(build_profile("affinity"), rig.fleet.views), rig.metrics, lambda: None
        ),
        rig.metrics,
        make_logger("test", json=True),
    )
    for _ in range(5):
        await keeper.make_room(D, 1000)  # within the budget of 5,000: the index is not asked
    await keeper.make_room(D, 1000)
    await keeper.make_room(D, 1000)
    assert keeper.pinned(D) == 7000
    assert rig.metrics.registry.get_sample_value("turnkv_pins_over_budget_total") == 2
    assert rig.released("budget") == 0


async def test_handles_nobody_will_pull_are_d_kv_in_use_until_their_release_is_sent(rig: Rig) -> None:
    # unused handles may pin a tenth of D's 10,000 tokens: a second of 600 releases the first. Both still pin
    # D's blocks (one left for its TTL, one waiting for its release), until the release has been sent
    def held() -> int:
        v = rig.fleet.view(D)
        assert v is not None
        return v.let_go_tokens

    rig.keeper.unused(D, {"pin": "req-1"}, 600, "not_needed")
    assert held() == 600
    rig.keeper.unused(D, {"pin": "req-2"}, 600, "not_needed")
    assert rig.released("not_needed") == 1 and held() == 1_200
    task = asyncio.create_task(rig.releaser.run())
    try:
        assert await rig.releaser.drain(5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert held() == 600 and rig.keeper.unused_tokens(D) == 600
