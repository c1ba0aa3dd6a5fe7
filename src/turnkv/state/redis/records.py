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

# put a record in key k: (record JSON, handle JSON, pin id ('' = no handle), index id, ttl ms, answer digest).
# Returns {pin id, index id} of a record it replaced that held another pin, else {} (a marker holds none).
_PUT_IN = """
local function put(k, rec, handle, pin, idx, ttl, answer)
  local old = {}
  if redis.call('TYPE', k)['ok'] == 'hash' then
    local v = redis.call('HMGET', k, 'p', 'i')
    if v[1] and v[2] and v[1] ~= pin then old = {v[1], v[2]} end
  end
  redis.call('DEL', k)
  if pin ~= '' then
    redis.call('HSET', k, 'r', rec, 'h', handle, 'p', pin, 'i', idx, 'a', answer)
  else
    redis.call('HSET', k, 'r', rec, 'a', answer)
  end
  redis.call('PEXPIRE', k, ttl)
  return old
end
"""
_PUT = _PUT_IN + "return put(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])\n"

# --- scripts on a pool (KEYS = ns:c:{base}, ns:c:{base}#1, ...: one slot) ---

# ARGV: owner, in-flight ms, the answer digest preferred ('' = any). The first slot whose record answers
# as preferred, else the first holding one, claimed; {'found', record, handle, unpinned, pin id, slot}.
_CLAIM_ANY = """
local pick, busy = 0, false
for i, k in ipairs(KEYS) do
  if redis.call('TYPE', k)['ok'] == 'hash' then
    local v = redis.call('HMGET', k, 'm', 'r', 'a')
    if v[1] then
      busy = true
    elseif v[2] then
      if ARGV[3] ~= '' and v[3] == ARGV[3] then pick = i break end
      if pick == 0 then pick = i end
    end
  end
end
if pick == 0 then
  if busy then return {'in_flight'} end
  return {'missing'}
end
local k = KEYS[pick]
local v = redis.call('HMGET', k, 'r', 'h', 'u', 'p')
redis.call('DEL', k)
redis.call('HSET', k, 'm', ARGV[1])
redis.call('PEXPIRE', k, ARGV[2])
return {'found', v[1], v[2] or '', v[3] or '', v[4] or '', pick}
"""

# ARGV: owner, then put's. The first slot holding nothing or the owner's marker, else the first holding an
# unclaimed record, else the first; {slot, replaced pin id, its index id ('' when none), and the unclaimed
# record replaced: its JSON, handle, unpinned, pin id ('' when none)}.
_PUT_ANY = (
    _PUT_IN
    + """
local pick = 0
for i, k in ipairs(KEYS) do
  local t = redis.call('TYPE', k)['ok']
  if t == 'none' or (t == 'hash' and redis.call('HGET', k, 'm') == ARGV[1]) then pick = i break end
end
if pick == 0 then
  for i, k in ipairs(KEYS) do
    if redis.call('TYPE', k)['ok'] == 'hash' and redis.call('HEXISTS', k, 'r') == 1 then pick = i break end
  end
end
if pick == 0 then pick = 1 end
local was = {}
if redis.call('TYPE', KEYS[pick])['ok'] == 'hash' and redis.call('HEXISTS', KEYS[pick], 'm') == 0 then
  was = redis.call('HMGET', KEYS[pick], 'r', 'h', 'u', 'p')
end
local old = put(KEYS[pick], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
return {pick, old[1] or '', old[2] or '', was[1] or '', was[2] or '', was[3] or '', was[4] or ''}
"""
)

_RELEASE = """
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' and redis.call('HGET', KEYS[1], 'm') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

CLAIM, PUT, RELEASE, CLAIM_ANY, PUT_ANY = (Script(s) for s in (_CLAIM, _PUT, _RELEASE, _CLAIM_ANY, _PUT_ANY))


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
        await self._unindex(key, claim, here)
        return claim

    async def claim_any(self, keys: Sequence[str], *, owner: str, prefer: str | None = None) -> tuple[str, Claim]:
        conn = self._conn

        async def run() -> Any:
            args: list[str | int | float] = [owner, self._in_flight_ms, prefer or ""]
            return await conn.eval(CLAIM_ANY, [conn.conversation_key(k) for k in keys], args)

        res = await conn.twice_on_timeout("claim", run, idempotent=False)
        key = keys[int(res[5]) - 1] if str(res[0]) == "found" else keys[0]
        claim = _claim_of(res[:5])
        await self._unindex(key, claim, conn.node_of(conn.conversation_key(key)))
        return key, claim

    async def _unindex(self, key: str, claim: Claim, here: str) -> None:
        """A claimed record's pin leaves its engine's index (the claiming turn owns the handle now); ``here``:
        the node of the record's key."""
        record, conn = claim.record, self._conn
        if record is None or record.pin_id is None:
            return
        # the claim stands whatever happens here (the turn owns the handle); an entry left behind
        # is an orphan that evict's CAS refuses and prune drops
        unpin = pins.unpin(conn.index(record.decode_url), key, record.pin_id)
        try:
            async with conn.op("claim"):
                await conn.aside(here, "unpin", unpin, leaves="orphan_entry")
        except StoreError as exc:  # no connection free for it
            log.warning("store.claim_unindex_failed reason=orphan_entry kind=%s error=%s", exc.kind, exc)

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
        args = self._put_args(record, ttl_s)
        if record.handle is None or record.pin_id is None:
            return [(PUT, [k], args)]
        return [(PUT, [k], args), pins.index_entry(self._conn.index(record.decode_url), key, record)]

    def _put_args(self, record: ConversationRecord, ttl_s: float) -> list[str | int | float]:
        """The record's fields as the put scripts take them."""
        ttl_ms = max(1, int(ttl_s * 1000))
        body = dataclasses.replace(record, handle=None, pin_id=None).to_json()
        if record.handle is None or record.pin_id is None:
            return [body, "", "", "", ttl_ms, record.answer_digest]
        handle = jsonwire.dumps(record.handle).decode()
        return [body, handle, record.pin_id, self._conn.index(record.decode_url).id, ttl_ms, record.answer_digest]

    async def put_any(
        self, keys: Sequence[str], record: ConversationRecord, ttl_s: float, *, owner: str
    ) -> tuple[str, ConversationRecord | None]:
        """The record in the pool's slot first (the slot is known only then), then its index entry: as put's,
        a step whose failure leaves the pin unindexed (and one on another node of a Cluster, through its
        breaker)."""
        conn = self._conn
        slots = [conn.conversation_key(k) for k in keys]
        here = conn.node_of(slots[0])
        async with conn.op("put"):
            res = await conn.eval(PUT_ANY, slots, [owner, *self._put_args(record, ttl_s)])
            key = keys[int(res[0]) - 1]
            if record.handle is not None and record.pin_id is not None:
                entry = pins.index_entry(conn.index(record.decode_url), key, record)
                await conn.aside(here, "index", entry, leaves="unindexed_pin")
            if res[1]:  # a record holding another pin was overwritten: that pin's entry goes too
                unpin = pins.unpin(conn.index_by_id(str(res[2])), key, str(res[1]))
                await conn.aside(here, "unpin", unpin, leaves="orphan_entry")
        return key, _replaced(res[3:7])

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


def _replaced(res: Sequence[Any]) -> ConversationRecord | None:
    """The unclaimed record a pool's put replaced, as ``_PUT_ANY`` returns it (None: none, or unreadable)."""
    if not res or not res[0]:
        return None
    try:
        return _decode(str(res[0]), str(res[1]), str(res[2]), str(res[3]))
    except (ValueError, TypeError, KeyError):
        return None


def _decode(body: str, handle: str, unpinned: str, pin_id: str) -> ConversationRecord:
    """A claimed record: its JSON, with the handle and its pin id stored beside it (a handle without a
    pin id is corrupt: ``ValueError``)."""
    record = ConversationRecord.from_json(body)
    if handle:
        return dataclasses.replace(record, handle=jsonwire.loads_lenient(handle), pin_id=pin_id or None)
    if unpinned:
        return dataclasses.replace(record, unpinned=unpinned)
    return record
