"""Records on Redis (``state.base.Records``): a conversation's hash, claimed once (a Lua script on its
slot), put with its pin's index entry, its in-flight marker released by its owner.

A put holding a handle runs the record's script and the index entry's (``pins.index_entry``) in one
pipeline (in a Cluster: at once, the entry through its node's breaker); a claim of a record holding one
drops that entry in a second step (``pins.unpin``). The orders and what a race between the steps costs
are in ``state.redis``. A step on the index fails alone: the record stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from turnkv import jsonwire
from turnkv.errors import StoreError
from turnkv.state.base import Claim, ClaimStatus
from turnkv.state.record import ConversationRecord
from turnkv.state.redis import pins
from turnkv.state.redis.connection import Call, RedisConnection, Script

log = logging.getLogger("turnkv.store")

# --- scripts on a conversation's slot (KEYS[1] = ns:c:{key}) ---

_CLAIM = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return {'missing'} end
if t ~= 'hash' then return {'corrupt'} end
local v = redis.call('HMGET', KEYS[1], 'm', 'r', 'h', 'u', 'p')
if v[1] then return {'in_flight'} end
if not v[2] then return {'corrupt'} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'm', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'found', v[2], v[3] or '', v[4] or '', v[5] or ''}
"""

# ARGV: record JSON, handle JSON, pin id ('' = no handle), index id, ttl ms.
# Returns {pin id, index id} of a record it replaced that held another pin, else {} (a marker holds none).
_PUT = """
local old = {}
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' then
  local v = redis.call('HMGET', KEYS[1], 'p', 'i')
  if v[1] and v[2] and v[1] ~= ARGV[3] then old = {v[1], v[2]} end
end
redis.call('DEL', KEYS[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'r', ARGV[1], 'h', ARGV[2], 'p', ARGV[3], 'i', ARGV[4])
else
  redis.call('HSET', KEYS[1], 'r', ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return old
"""

_RELEASE = """
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' and redis.call('HGET', KEYS[1], 'm') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

CLAIM, PUT, RELEASE = (Script(s) for s in (_CLAIM, _PUT, _RELEASE))


class RedisRecords:
    def __init__(self, conn: RedisConnection, *, in_flight_ttl_s: float) -> None:
        self._conn = conn
        self._in_flight_ms = max(1, int(in_flight_ttl_s * 1000))

    async def claim(self, key: str, *, owner: str) -> Claim:
        conn = self._conn
        here = conn.node_of(conn.conversation_key(key))

        async def run() -> Claim:
            return _claim_of(await conn.eval(CLAIM, [conn.conversation_key(key)], [owner, self._in_flight_ms]))

        claim = await conn.twice_on_timeout("claim", run, idempotent=False)
        record = claim.record
        if record is not None and record.pin_id is not None:
            # the claim stands whatever happens here (the turn owns the handle); an entry left behind
            # is an orphan that evict's CAS refuses and prune drops
            unpin = pins.unpin(conn.index(record.decode_url), key, record.pin_id)
            try:
                async with conn.op("claim"):
                    await conn.aside(here, "unpin", unpin, leaves="orphan_entry")
            except StoreError as exc:  # no connection free for it
                log.warning("store.claim_unindex_failed reason=orphan_entry kind=%s error=%s", exc.kind, exc)
        return claim

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        conn = self._conn
        calls = self._put_calls(key, record, ttl_s)
        async with conn.op("put"):
            if len(calls) == 1 or not conn.cluster:
                replaced = (await conn.batch(calls))[0]
            else:  # in a Cluster the pin's entry may be on another node: its failure leaves the pin unindexed
                here = conn.node_of(calls[0][1][0])
                replaced, _ = await asyncio.gather(
                    conn.eval(*calls[0]),
                    conn.aside(here, "index", calls[1], leaves="unindexed_pin"),
                    return_exceptions=True,
                )
                if isinstance(replaced, BaseException):  # raised once the entry's step ended too
                    raise replaced
            if replaced:  # a record holding another pin was overwritten: that pin's entry goes too
                index = conn.index_by_id(str(replaced[1]))
                here = conn.node_of(calls[0][1][0])
                await conn.aside(here, "unpin", pins.unpin(index, key, str(replaced[0])), leaves="orphan_entry")

    def _put_calls(self, key: str, record: ConversationRecord, ttl_s: float) -> list[Call]:
        """Put's steps: the record, then (when it holds a handle) its index entry."""
        k = self._conn.conversation_key(key)
        ttl_ms = max(1, int(ttl_s * 1000))
        body = dataclasses.replace(record, handle=None, pin_id=None).to_json()
        if record.handle is None or record.pin_id is None:
            return [(PUT, [k], [body, "", "", "", ttl_ms])]
        index = self._conn.index(record.decode_url)
        handle = jsonwire.dumps(record.handle).decode()
        return [(PUT, [k], [body, handle, record.pin_id, index.id, ttl_ms]), pins.index_entry(index, key, record)]

    async def release(self, key: str, *, owner: str) -> None:
        conn = self._conn

        async def run() -> None:
            await conn.eval(RELEASE, [conn.conversation_key(key)], [owner])

        await conn.twice_on_timeout("release", run)


def _claim_of(res: Sequence[Any]) -> Claim:
    status = str(res[0])
    if status == "missing":
        return Claim(ClaimStatus.MISSING)
    if status == "in_flight":
        return Claim(ClaimStatus.IN_FLIGHT)
    if status == "found":
        try:
            return Claim(ClaimStatus.FOUND, _decode(str(res[1]), str(res[2]), str(res[3]), str(res[4])))
        except (ValueError, TypeError, KeyError):
            pass
    return Claim(ClaimStatus.CORRUPT)


def _decode(body: str, handle: str, unpinned: str, pin_id: str) -> ConversationRecord:
    """A claimed record: its JSON, with the handle and its pin id stored beside it (a handle without a
    pin id is corrupt: ``ValueError``)."""
    record = ConversationRecord.from_json(body)
    if handle:
        return dataclasses.replace(record, handle=jsonwire.loads_lenient(handle), pin_id=pin_id or None)
    if unpinned:
        return dataclasses.replace(record, unpinned=unpinned)
    return record
