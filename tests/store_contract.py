"""The conversation store contract (``state.base``) as tests, run against every implementation.

A test module subclasses ``StoreContract`` (the three parts: ``RecordsContract``, ``PinsContract``,
``DocumentsContract``; and ``RedisContract`` for what only the Redis store can
show) and provides a ``backend`` fixture: two stores on the same data (two gateway replicas; the
same object in process), and a way to let time pass for the stores' TTLs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from turnkv.reuse.chain import chain_of, sequence_digest
from turnkv.state.base import Claim, ClaimStatus, ConversationStore, PinEntry, Pinned, pool
from turnkv.state.record import ConversationRecord
from turnkv.state.redis import RedisStore

D1, D2, D3 = "http://d1:8200", "http://d2:8200", "http://d3:8200"
LONG_TTL_S = 600.0
SHORT_TTL_S = 0.05
SHORT_MARKER_TTL_S = 0.05
CONCURRENT = 200


def rec(
    pin: str | None = "p1",
    *,
    url: str = D1,
    tokens: int = 20,
    stored_at: float = 1.0,
    expires_at: float = 1e12,
    epoch: float | None = None,
    turn: int = 2,
    unpinned: str | None = None,
    tenant: str = "t",
) -> ConversationRecord:
    # opaque to the store, and the same for every pin: the store tells pins apart by their pin id alone
    handle = None if pin is None else {"engine": "e", "blocks": [1, 2], "tokens": tokens}
    return ConversationRecord(
        tenant=tenant,
        decode_url=url,
        prefill_url=None,
        handle=handle,
        engine_id="e",
        engine_epoch=epoch,
        num_tokens=tokens,
        chain=chain_of(list(range(tokens)), 16),
        block_size=16,
        prompt_tokens=10,
        answer_digest="a",
        reasoning_digest=None,
        turn=turn,
        created_at=stored_at,
        expires_at=expires_at,
        history_digest="h",
        bytes_per_token=3.5,
        unpinned=unpinned if pin is None else None,
        tokens_digest=sequence_digest(list(range(tokens))),
        pin_id=pin,
    )


@dataclass
class Backend:
    store: ConversationStore
    other: ConversationStore  # a second replica on the same data (the same store in process)
    elapse: Callable[[float], Awaitable[None]]  # let this much time pass for the stores' TTLs
    short_markers: ConversationStore  # a store on the same data whose in-flight markers time out soon
    short_marker_ttl_s: float


def keys(entries: list[PinEntry]) -> list[str]:
    return [e.key for e in entries]


class RecordsContract:
    """``state.base.Records``: a record claimed once, put, its marker released."""

    async def test_claim_is_single_use(self, backend: Backend) -> None:
        s = backend.store
        assert (await s.records.claim("k", owner="a")).status is ClaimStatus.MISSING
        r = rec()
        await s.records.put("k", r, LONG_TTL_S)
        first = await s.records.claim("k", owner="a")
        assert first.status is ClaimStatus.FOUND and first.record == r
        assert (await backend.other.records.claim("k", owner="b")).status is ClaimStatus.IN_FLIGHT
        # not even to its owner: a claim repeated after a lost reply must not hand the handle out twice
        assert (await s.records.claim("k", owner="a")).status is ClaimStatus.IN_FLIGHT

    async def test_only_the_owner_releases_its_marker(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec(), LONG_TTL_S)
        await s.records.claim("k", owner="a")
        await backend.other.records.release("k", owner="b")
        assert (await s.records.claim("k", owner="c")).status is ClaimStatus.IN_FLIGHT
        await backend.other.records.release("k", owner="a")
        assert (await s.records.claim("k", owner="c")).status is ClaimStatus.MISSING

    async def test_release_leaves_a_record_alone(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec(), LONG_TTL_S)
        await s.records.release("k", owner="a")
        await s.records.release("never-stored", owner="a")
        assert (await s.records.claim("k", owner="a")).status is ClaimStatus.FOUND

    async def test_put_replaces_any_marker(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec("p1"), LONG_TTL_S)
        await s.records.claim("k", owner="a")
        await backend.other.records.put("k", rec("p2", turn=3), LONG_TTL_S)  # a concurrent turn stores first
        await s.records.release("k", owner="a")  # the first turn's release no longer finds its marker
        got = await s.records.claim("k", owner="c")
        assert got.status is ClaimStatus.FOUND and got.record == rec("p2", turn=3)

    async def test_a_marker_times_out(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec(), LONG_TTL_S)
        await s.records.put("j", rec(), LONG_TTL_S)
        assert (await backend.short_markers.records.claim("k", owner="crashed")).status is ClaimStatus.FOUND
        await backend.elapse(backend.short_marker_ttl_s * 4)
        assert (await s.records.claim("k", owner="b")).status is ClaimStatus.MISSING
        # a put after its marker timed out still stores (last put wins)
        await backend.short_markers.records.put("k", rec("p9"), LONG_TTL_S)
        assert (await s.records.claim("k", owner="c")).record == rec("p9")

    async def test_a_record_times_out(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec(pin=None), SHORT_TTL_S)
        await s.records.put("kept", rec(pin=None), LONG_TTL_S)
        await backend.elapse(SHORT_TTL_S * 4)
        assert (await s.records.claim("k", owner="a")).status is ClaimStatus.MISSING
        assert (await s.records.claim("kept", owner="a")).status is ClaimStatus.FOUND

    async def test_concurrent_turns_on_distinct_conversations(self, backend: Backend) -> None:
        stores = (backend.store, backend.other)
        for i in range(CONCURRENT):
            await backend.store.records.put(f"c{i}", rec(f"p{i}-0", tokens=1, turn=0), LONG_TTL_S)

        async def turn(i: int) -> ClaimStatus:
            s = stores[i % 2]
            c = await s.records.claim(f"c{i}", owner=f"o{i}")
            await s.records.put(f"c{i}", rec(f"p{i}-1", tokens=1, turn=1), LONG_TTL_S)
            return c.status

        assert await asyncio.gather(*(turn(i) for i in range(CONCURRENT))) == [ClaimStatus.FOUND] * CONCURRENT
        assert await backend.store.pins.pinned([D1]) == {D1: Pinned(CONCURRENT, CONCURRENT)}
        got = await asyncio.gather(*(stores[i % 2].records.claim(f"c{i}", owner="n") for i in range(CONCURRENT)))
        assert [c.record.turn if c.record else None for c in got] == [1] * CONCURRENT

    async def test_concurrent_turns_on_one_conversation(self, backend: Backend) -> None:
        stores = (backend.store, backend.other)
        await backend.store.records.put("shared", rec("p-0", tokens=1, turn=0), LONG_TTL_S)
        claimed: list[int] = []

        async def turn(i: int) -> None:
            s = stores[i % 2]
            c = await s.records.claim("shared", owner=f"o{i}")
            if c.status is ClaimStatus.FOUND:
                assert c.record is not None
                claimed.append(c.record.turn)
                await s.records.put(
                    "shared", rec(f"p-{c.record.turn + 1}", tokens=1, turn=c.record.turn + 1), LONG_TTL_S
                )
            else:
                assert c.status is ClaimStatus.IN_FLIGHT

        await asyncio.gather(*(turn(i) for i in range(CONCURRENT)))
        # each record claimed once, none lost: the claims form the chain 0, 1, 2, ...
        assert sorted(claimed) == list(range(len(claimed))) and claimed
        last = await backend.store.records.claim("shared", owner="last")
        assert last.record is not None and last.record.turn == len(claimed)
        assert await backend.store.pins.pinned([D1]) == {}


class PoolsContract:
    """``claim_any`` and ``put_any``: interchangeable records under one name (``state.base.pool``)."""

    async def test_a_pool_holds_one_record_per_conversation_that_stores_into_it(self, backend: Backend) -> None:
        s, slots = backend.store, pool("k", 4)
        stored = [await s.records.put_any(slots, rec(f"p{i}", turn=i), LONG_TTL_S, owner=f"t{i}") for i in range(3)]
        assert stored == [(k, None) for k in slots[:3]]  # three at once: three slots, none overwritten
        got = [await backend.other.records.claim_any(slots, owner=f"n{i}") for i in range(3)]
        assert sorted(c.record.turn for _, c in got if c.record is not None) == [0, 1, 2]
        assert (await s.records.claim_any(slots, owner="n3"))[1].status is ClaimStatus.IN_FLIGHT
        for i, (key, _) in enumerate(got):
            await s.records.release(key, owner=f"n{i}")
        assert await s.records.claim_any(slots, owner="n4") == (slots[0], Claim(ClaimStatus.MISSING))

    async def test_claim_any_takes_the_record_whose_answer_the_client_echoes(self, backend: Backend) -> None:
        s, slots = backend.store, pool("k", 4)
        for i, answer in enumerate(("x", "y", "z")):
            r = dataclasses.replace(rec(f"p{i}"), answer_digest=answer)
            await s.records.put_any(slots, r, LONG_TTL_S, owner=f"o{i}")
        key, got = await s.records.claim_any(slots, owner="a", prefer="z")
        assert got.record is not None and got.record.answer_digest == "z" and key == slots[2]
        key, other = await s.records.claim_any(slots, owner="b", prefer="none of them")
        assert other.record is not None and key == slots[0]  # no such answer: the first there is

    async def test_put_any_uses_its_own_marker_and_never_a_claimed_slot_while_one_is_free(
        self, backend: Backend
    ) -> None:
        s, slots = backend.store, pool("k", 3)
        await s.records.put_any(slots, rec("p1"), LONG_TTL_S, owner="x")
        await s.records.put_any(slots, rec("p2"), LONG_TTL_S, owner="y")
        key, _ = await s.records.claim_any(slots, owner="turn")  # claims slot 0
        assert await s.records.put_any(slots, rec("p3"), LONG_TTL_S, owner="other") == (slots[2], None)
        # the claiming turn stores its next record where its marker is
        assert await s.records.put_any(slots, rec("p4"), LONG_TTL_S, owner="turn") == (slots[0], None)
        assert key == slots[0]
        # full: over an unclaimed record, never a marker; the record replaced comes back, handle and all, for
        # its handle to be released (nobody can claim it now)
        await s.records.claim_any(slots, owner="late")  # claims slot 0 again
        assert await s.records.put_any(slots, rec("p5"), LONG_TTL_S, owner="new") == (slots[1], rec("p2"))
        assert (await s.pins.pinned([D1]))[D1].handles == 2  # p3 and p5: p2's entry went with it

    async def test_a_pools_first_key_is_the_plain_key(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec("old"), LONG_TTL_S)  # stored before pools
        key, got = await s.records.claim_any(pool("k", 2), owner="a")
        assert key == "k" and got.record == rec("old")


class PinsContract:
    """``state.base.PinIndex``: pins indexed per engine as records are put and claimed, evicted and pruned."""

    async def test_a_record_without_handle_pins_nothing(self, backend: Backend) -> None:
        s = backend.store
        r = rec(pin=None, unpinned="no_handle_in_stream")
        await s.records.put("k", r, LONG_TTL_S)
        assert await s.pins.pinned([D1]) == {}
        got = await s.records.claim("k", owner="a")
        assert got.status is ClaimStatus.FOUND and got.record == r

    async def test_pins_are_indexed_per_engine(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("a", rec("pa", tokens=10), LONG_TTL_S)
        await s.records.put("b", rec("pb", tokens=20), LONG_TTL_S)
        await s.records.put("c", rec("pc", url=D2, tokens=5), LONG_TTL_S)
        await s.records.put("d", rec(None, url=D2), LONG_TTL_S)
        assert await backend.other.pins.pinned([D1, D2, D3]) == {D1: Pinned(2, 30), D2: Pinned(1, 5)}
        await s.records.claim("a", owner="x")  # the claiming turn owns the handle now
        assert await s.pins.pinned([D1, D2]) == {D1: Pinned(1, 20), D2: Pinned(1, 5)}
        await s.records.put("a", rec("pa2", tokens=12), LONG_TTL_S)  # its turn stores the next one
        assert await s.pins.pinned([D1]) == {D1: Pinned(2, 32)}
        assert await s.pins.pinned([]) == {}

    async def test_a_put_over_a_pinned_record_moves_its_pin(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec("p1", tokens=10), LONG_TTL_S)
        await s.records.put("k", rec("p2", tokens=7), LONG_TTL_S)  # same engine, next handle, no claim between
        assert await s.pins.pinned([D1]) == {D1: Pinned(1, 7)}
        await s.records.put("k", rec("p3", url=D2, tokens=9), LONG_TTL_S)  # another engine
        assert await s.pins.pinned([D1, D2]) == {D2: Pinned(1, 9)}
        await s.records.put("k", rec(None), LONG_TTL_S)
        assert await s.pins.pinned([D1, D2]) == {}

    async def test_evict_takes_the_idle_longest_first_and_strips_only_the_handle(self, backend: Backend) -> None:
        s = backend.store
        records = {
            "new": rec("p-new", tokens=10, stored_at=3.0),
            "old": rec("p-old", tokens=10, stored_at=1.0),
            "mid": rec("p-mid", tokens=10, stored_at=2.0),
        }
        for k, r in records.items():
            await s.records.put(k, r, LONG_TTL_S)
        out = await s.pins.evict(D1, keep_tokens=15, why="budget")
        assert keys(out) == ["old", "mid"]
        assert [(e.decode_url, e.tokens, e.handle, e.stored_at, e.expires_at, e.engine_epoch) for e in out] == [
            (D1, 10, records[k].handle, records[k].created_at, records[k].expires_at, None) for k in ("old", "mid")
        ]
        assert await s.pins.pinned([D1]) == {D1: Pinned(1, 10)}
        for k in ("old", "mid"):
            got = await backend.other.records.claim(k, owner="t")
            assert got.record == records[k].unpin("budget")
        assert (await s.records.claim("new", owner="t")).record == records["new"]

    async def test_evict_leaves_a_tenant_within_its_share_its_pins(self, backend: Backend) -> None:
        # b's one pin is the idle longest; a's three newer ones push the engine over: a's own go, idle longest
        # first, while b holds no more than its share of what stays (25 / 2 tenants)
        s = backend.store
        await s.records.put("b1", rec("pb1", tokens=10, stored_at=1.0, tenant="b"), LONG_TTL_S)
        for i in (2, 3, 4):
            await s.records.put(f"a{i}", rec(f"pa{i}", tokens=10, stored_at=float(i), tenant="a"), LONG_TTL_S)
        out = await s.pins.evict(D1, keep_tokens=25, why="budget")
        assert keys(out) == ["a2", "a3"] and {e.tenant for e in out} == {"a"}
        assert await s.pins.pinned([D1]) == {D1: Pinned(2, 20)}
        assert (await s.records.claim("b1", owner="t")).record == rec("pb1", tokens=10, stored_at=1.0, tenant="b")

    async def test_evict_takes_from_the_tenant_over_its_share_idle_longest_first(self, backend: Backend) -> None:
        s = backend.store
        for i in (1, 2, 3):
            await s.records.put(f"b{i}", rec(f"pb{i}", tokens=10, stored_at=float(i), tenant="b"), LONG_TTL_S)
        await s.records.put("a", rec("pa", tokens=10, stored_at=0.5, tenant="a"), LONG_TTL_S)
        out = await s.pins.evict(D1, keep_tokens=20, why="pressure")
        assert keys(out) == ["b1", "b2"]  # a's pin, idle longest of all, is within its share (10)
        # down to nothing: everyone's go, idle longest first
        assert keys(await s.pins.evict(D1, keep_tokens=0, why="shutdown")) == ["a", "b3"]

    async def test_a_tenants_share_counts_only_what_it_still_pins(self, backend: Backend) -> None:
        # b's claimed and replaced pins no longer count for b: b is within its share, a over it
        s = backend.store
        for i in (1, 2, 3):
            await s.records.put(f"b{i}", rec(f"pb{i}", tokens=10, stored_at=float(i), tenant="b"), LONG_TTL_S)
        await s.records.claim("b2", owner="turn")
        await s.records.put("b3", rec("pb3-next", tokens=5, stored_at=3.0, tenant="b"), LONG_TTL_S)
        for i in (4, 5):
            await s.records.put(f"a{i}", rec(f"pa{i}", tokens=10, stored_at=float(i), tenant="a"), LONG_TTL_S)
        assert await s.pins.pinned([D1]) == {D1: Pinned(4, 35)}
        assert keys(await s.pins.evict(D1, keep_tokens=30, why="budget")) == ["a4"]

    async def test_evict_within_budget_takes_nothing(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("a", rec("pa", tokens=10), LONG_TTL_S)
        assert await s.pins.evict(D1, keep_tokens=10, why="budget") == []
        assert await s.pins.evict(D2, keep_tokens=0, why="budget") == []
        assert await s.pins.pinned([D1]) == {D1: Pinned(1, 10)}

    async def test_evict_never_returns_a_claimed_record(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("claimed", rec("p1", stored_at=1.0), LONG_TTL_S)
        await s.records.put("idle", rec("p2", stored_at=2.0), LONG_TTL_S)
        claimed = await backend.other.records.claim("claimed", owner="turn")
        out = await s.pins.evict(D1, keep_tokens=0, why="pressure")
        assert keys(out) == ["idle"]
        assert claimed.record is not None and claimed.record.handle is not None  # the turn's to pull or release
        assert await s.pins.pinned([D1]) == {}

    async def test_prune_drops_expired_restarted_and_orphaned_entries(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("expired", rec("p1", expires_at=50.0), LONG_TTL_S)
        await s.records.put("old-epoch", rec("p2", epoch=1.0), LONG_TTL_S)
        await s.records.put("this-epoch", rec("p3", epoch=2.0), LONG_TTL_S)
        await s.records.put("no-epoch", rec("p4"), LONG_TTL_S)
        await s.records.put("orphan", rec("p5"), SHORT_TTL_S)  # its record goes; the entry stays behind
        await s.records.put("other-engine", rec("p6", url=D2, expires_at=50.0), LONG_TTL_S)
        await backend.elapse(SHORT_TTL_S * 4)
        out = await backend.other.pins.prune(D1, now=100.0, epoch=2.0)
        assert sorted(keys(out)) == ["expired", "old-epoch", "orphan"]
        assert await s.pins.pinned([D1, D2]) == {D1: Pinned(2, 40), D2: Pinned(1, 20)}
        assert await s.pins.prune(D1, now=100.0, epoch=None) == []
        # a record that still holds its handle keeps it: prune touches the index only
        assert (await s.records.claim("old-epoch", owner="t")).record == rec("p2", epoch=1.0)

    async def test_prune_keeps_a_replaced_pin(self, backend: Backend) -> None:
        s = backend.store
        await s.records.put("k", rec("p1"), LONG_TTL_S)
        await s.records.claim("k", owner="turn")
        await s.records.put("k", rec("p2", epoch=2.0), LONG_TTL_S)
        assert await s.pins.prune(D1, now=100.0, epoch=2.0) == []
        assert await s.pins.pinned([D1]) == {D1: Pinned(1, 20)}


class DocumentsContract:
    """``state.base.Documents``: documents with a TTL."""

    async def test_documents(self, backend: Backend) -> None:
        s = backend.store
        assert await s.documents.get("resp_1") is None
        await s.documents.put("resp_1", '{"id": "resp_1"}', LONG_TTL_S)
        await s.documents.put("resp_2", "short", SHORT_TTL_S)
        assert await backend.other.documents.get("resp_1") == '{"id": "resp_1"}'
        await backend.elapse(SHORT_TTL_S * 4)
        assert await s.documents.get("resp_2") is None
        assert await s.documents.get("resp_1") == '{"id": "resp_1"}'

    async def test_a_deleted_document_is_gone(self, backend: Backend) -> None:
        s = backend.store
        await s.documents.put("resp_1", "one", LONG_TTL_S)
        await s.documents.put("resp_2", "two", SHORT_TTL_S)
        assert await backend.other.documents.delete("resp_1") is True
        assert await s.documents.get("resp_1") is None
        assert await s.documents.delete("resp_1") is False  # once
        await backend.elapse(SHORT_TTL_S * 4)
        assert await s.documents.delete("resp_2") is False  # expired: there was none


class StoreContract(RecordsContract, PoolsContract, PinsContract, DocumentsContract):
    """The whole contract: the three parts on one backing store."""


class RedisContract:
    """What only a store of separate steps can show: the orders in ``state.redis`` hold under races."""

    async def test_a_record_is_stored_as_gateways_of_its_format_version_read_and_write_it(
        self, backend: Backend
    ) -> None:
        """A rolling upgrade shares Redis between gateway versions: a record's hash holds the record's JSON
        (no member for the pin id), the handle and, beside them, the pin id (``p``) and its index (``i``),
        as earlier gateways wrote them (they took the pin id out of the handle themselves); such a hash is
        read with that pin id. A handle without a pin id is corrupt, never used. The answer's digest (``a``,
        which a pool's claim looks at) is new: a hash without it is read as before."""
        s = backend.store
        assert isinstance(s, RedisStore)
        redis: Any = s.conn.client  # decodes to str
        await s.records.put("new", rec("p1"), LONG_TTL_S)
        stored: dict[str, str] = await redis.hgetall(s.conn.conversation_key("new"))
        assert set(stored) == {"r", "h", "p", "i", "a"} and stored["p"] == "p1" and stored["a"] == "a"
        assert "pin_id" not in json.loads(stored["r"]) and json.loads(stored["h"]) == rec("p1").handle
        await redis.hset(s.conn.conversation_key("earlier"), mapping={k: v for k, v in stored.items() if k != "a"})
        assert (await s.records.claim("earlier", owner="t")).record == rec("p1")
        await redis.hset(s.conn.conversation_key("broken"), mapping={k: v for k, v in stored.items() if k != "p"})
        assert (await s.records.claim("broken", owner="t")).status is ClaimStatus.CORRUPT

    async def test_evict_skips_a_record_claimed_between_pick_and_cas(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        await s.records.put("claimed", rec("p1", stored_at=1.0), LONG_TTL_S)
        await s.records.put("replaced", rec("p2", stored_at=2.0), LONG_TTL_S)
        await s.records.put("idle", rec("p3", stored_at=3.0), LONG_TTL_S)
        more, picked = await s.pins._pick(D1, 0)
        assert not more and [e.key for e in picked] == ["claimed", "replaced", "idle"]
        claim = await backend.other.records.claim("claimed", owner="turn")  # a turn claims between the two steps
        await backend.other.records.put("replaced", rec("p4", stored_at=4.0), LONG_TTL_S)  # another stores the next pin
        assert keys(await s.pins._strip(picked, "budget")) == ["idle"]
        assert claim.record == rec("p1", stored_at=1.0)  # kept its handle: the turn owns it
        assert (await s.records.claim("replaced", owner="t")).record == rec("p4", stored_at=4.0)
        assert (await s.records.claim("idle", owner="t")).record == rec(None, stored_at=3.0, unpinned="budget")

    async def test_a_claim_between_the_put_steps_leaves_an_orphan_that_prune_drops(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        record_step, index_step = s.records._put_calls("k", rec("p1"), LONG_TTL_S)
        await s.conn.batch([record_step])
        claim = await backend.other.records.claim("k", owner="turn")  # before the index step lands
        await s.conn.batch([index_step])
        assert await s.pins.pinned([D1]) == {D1: Pinned(1, 20)}  # an orphan: no record holds p1
        assert keys(await s.pins.prune(D1, now=100.0, epoch=None)) == ["k"]
        assert await s.pins.pinned([D1]) == {}
        assert claim.record == rec("p1")  # the turn still owns the handle

    async def test_an_index_step_landing_first_never_releases_the_handle(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        record_step, index_step = s.records._put_calls("k", rec("p1"), LONG_TTL_S)
        await s.conn.batch([index_step])  # in a Cluster the two nodes may run them in this order
        assert await s.pins.evict(D1, keep_tokens=0, why="budget") == []  # no record holds p1 yet: not released
        await s.conn.batch([record_step])
        assert (await s.records.claim("k", owner="turn")).record == rec("p1")  # usable by the next turn

    async def test_corrupt_records_are_reported_and_overwritten(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        raw = s.conn.client
        await raw.set(s.conn.conversation_key("string"), "{not a record")
        await raw.hset(s.conn.conversation_key("no-body"), "x", "1")
        await raw.hset(s.conn.conversation_key("bad-json"), "r", "{not json")
        for k in ("string", "no-body", "bad-json"):
            assert (await s.records.claim(k, owner="a")).status is ClaimStatus.CORRUPT
            await s.records.put(k, rec(f"p-{k}"), LONG_TTL_S)
            assert (await s.records.claim(k, owner="b")).record == rec(f"p-{k}")

    async def test_scripts_come_back_after_redis_lost_them(self, backend: Backend) -> None:
        s = backend.store
        assert isinstance(s, RedisStore)
        await s.records.put("k", rec("p1"), LONG_TTL_S)
        await s.records.put("j", rec("p2", stored_at=2.0), LONG_TTL_S)
        await s.conn.client.script_flush()  # as after a restart or a failover
        assert (await s.records.claim("k", owner="a")).status is ClaimStatus.FOUND  # one script
        await s.conn.client.script_flush()
        await s.records.put("k", rec("p3", stored_at=3.0), LONG_TTL_S)  # a pipeline of two
        await s.conn.client.script_flush()
        assert keys(await s.pins.evict(D1, keep_tokens=0, why="budget")) == ["j", "k"]

    async def test_a_conversation_and_an_index_each_live_in_one_slot(self, backend: Backend) -> None:
        from redis.crc import key_slot

        s = backend.store
        assert isinstance(s, RedisStore)
        conv = s.conn.conversation_key("tenant:{odd}key")
        assert key_slot(conv.encode()) == key_slot(b"{tenant:{odd}")
        slots = {key_slot(s.conn.conversation_key(k).encode()) for k in pool("tenant:k")}
        assert slots == {key_slot(s.conn.conversation_key("tenant:k").encode())}  # a pool is one slot
        slots = {key_slot(k.encode()) for k in s.conn.index(D1).keys}
        assert len(slots) == 1
