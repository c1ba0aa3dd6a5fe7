"""Store semantics: single-use claims, in-flight markers, put back, pinned report. Memory and Redis (fakeredis)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis.aioredis
import pytest

from turnkv.errors import StoreError
from turnkv.reuse.chain import chain_of
from turnkv.state.base import ClaimStatus, ConversationStore
from turnkv.state.guard import StoreGuard
from turnkv.state.memory import MemoryStore
from turnkv.state.record import ConversationRecord
from turnkv.state.redis import RedisStore

REC = ConversationRecord(
    tenant="t",
    decode_url="http://d1",
    prefill_url=None,
    handle={"remote_num_tokens": 20},
    engine_id="e",
    engine_epoch=None,
    num_tokens=20,
    chain=chain_of(list(range(20)), 16),
    block_size=16,
    prompt_tokens=10,
    answer_digest="a",
    reasoning_digest=None,
    turn=2,
    created_at=1.0,
    expires_at=1000.0,
)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ConversationStore]:
    if request.param == "memory":
        s: ConversationStore = MemoryStore()
    else:
        s = RedisStore(fakeredis.aioredis.FakeRedis(decode_responses=True))
    yield s
    await s.close()


def test_record_round_trip() -> None:
    assert ConversationRecord.from_json(REC.to_json()) == REC


def test_record_of_another_format_is_refused() -> None:
    with pytest.raises(ValueError):
        ConversationRecord.from_json(REC.to_json().replace('"v":2', '"v":1'))


async def test_claim_is_single_use(store: ConversationStore) -> None:
    assert (await store.claim("k")).status is ClaimStatus.MISSING
    await store.put("k", REC, 60)
    first = await store.claim("k")
    assert first.status is ClaimStatus.FOUND and first.record == REC
    assert (await store.claim("k")).status is ClaimStatus.IN_FLIGHT
    await store.release("k")
    assert (await store.claim("k")).status is ClaimStatus.MISSING


async def test_put_replaces_the_marker(store: ConversationStore) -> None:
    await store.put("k", REC, 60)
    await store.claim("k")
    await store.put("k", REC, 60)
    assert (await store.claim("k")).status is ClaimStatus.FOUND


async def test_release_does_not_drop_a_record(store: ConversationStore) -> None:
    await store.put("k", REC, 60)
    await store.release("k")
    assert (await store.claim("k")).status is ClaimStatus.FOUND


async def test_pinned_counts_live_handles_per_decode(store: ConversationStore) -> None:
    await store.put("a", REC, 60)
    await store.put("b", REC, 60)
    pinned = await store.pinned(now=10.0)
    assert (pinned["http://d1"].handles, pinned["http://d1"].tokens) == (2, 40)
    await store.claim("a")
    assert (await store.pinned(now=10.0))["http://d1"].handles == 1
    assert await store.pinned(now=2000.0) == {}


async def test_corrupt_records_are_reported() -> None:
    r = fakeredis.aioredis.FakeRedis(decode_responses=True)
    s = RedisStore(r)
    await r.set(s.key("k"), "{not json")
    assert (await s.claim("k")).status is ClaimStatus.CORRUPT


class _Broken:
    def __init__(self) -> None:
        self.calls = 0

    async def claim(self, key: str) -> object:
        self.calls += 1
        raise StoreError("down")


async def test_guard_skips_a_failing_store_until_retry() -> None:
    now = [0.0]
    broken = _Broken()
    states: list[bool] = []
    g = StoreGuard(broken, retry_s=5, clock=lambda: now[0], on_state=states.append)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(StoreError):
            await g.claim("k")
    assert broken.calls == 1 and states == [False] and not g.up
    now[0] = 6.0
    with pytest.raises(StoreError):
        await g.claim("k")
    assert broken.calls == 2
