"""The pin index on Redis (``state.base.PinIndex``): per decode engine a sorted set of conversation keys
by ``stored_at``, a hash of their entries and the running token total, each engine's keys in one slot
(``{<hash of the URL>}``); and the per-record compare-and-set steps (``STRIP``, ``HOLDS``) that keep an
evict or a prune from touching a pin a turn claimed meanwhile. The orders are in ``state.redis``.

In a Cluster the records an evict or a prune asks are on any master: those on a master that fails (or
counts as down) are left alone (an evicted entry's record keeps its handle, unindexed; a pruned entry whose
record could not be asked stays) and the operation goes on with the others.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Sequence
from typing import Any, cast

from turnkv import jsonwire
from turnkv.errors import StoreError
from turnkv.state.base import PinEntry, Pinned
from turnkv.state.record import ConversationRecord
from turnkv.state.redis.connection import Call, Index, RedisConnection, Script

EVICT_BATCH = 256  # entries per pick; a pick and its CAS pipeline are one round trip each
MAX_EVICT_ROUNDS = 64  # 16k entries per evict call at most
PRUNE_CHUNK = 512  # records asked per pipeline

# --- scripts on a conversation's slot (KEYS[1] = ns:c:{key}) ---

# the evict CAS: strip the handle only from a record that still holds pin ARGV[1] (a marker holds none)
_STRIP = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' or redis.call('HGET', KEYS[1], 'p') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'h', 'p', 'i')
redis.call('HSET', KEYS[1], 'u', ARGV[2])
return 1
"""

_HOLDS = """
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' and redis.call('HGET', KEYS[1], 'p') == ARGV[1] then return 1 end
return 0
"""

# --- scripts on an engine's index slot (KEYS = z, e, t, n) ---

# n: tokens pinned per tenant (``state.fair``'s shares without reading every entry); an entry written
# before entries named their tenant counts in none
_INDEX_LIB = """
local function tenant_of(d)
  if type(d.tenant) == 'string' and d.tenant ~= '' then return d.tenant end
  return nil
end
local function count(d, sign)
  local t = tenant_of(d)
  if t and redis.call('HINCRBY', KEYS[4], t, sign * d.tokens) <= 0 then redis.call('HDEL', KEYS[4], t) end
end
local function drop(member, value)
  local d = cjson.decode(value)
  redis.call('ZREM', KEYS[1], member)
  redis.call('HDEL', KEYS[2], member)
  redis.call('DECRBY', KEYS[3], d.tokens)
  count(d, -1)
end
local function settle()
  if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[3], KEYS[4]) end
end
"""

# ARGV: conversation key, stored_at, entry JSON, tokens
_PIN_ADD = (
    _INDEX_LIB
    + """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then drop(ARGV[1], old) end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('INCRBY', KEYS[3], ARGV[4])
count(cjson.decode(ARGV[3]), 1)
return 1
"""
)

# ARGV: conversation key, pin id: drop the entry only if it is still that pin's
_UNPIN = (
    _INDEX_LIB
    + """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old or cjson.decode(old).pin ~= ARGV[2] then return 0 end
drop(ARGV[1], old)
settle()
return 1
"""
)

# ARGV: tokens to keep, most entries to take. Returns {more, {key, entry, key, entry, ...}}. The order of
# ``state.fair.fair_evictions`` in one pass, idle longest first, over the entries of tenants holding more
# than keep / (tenants holding any), from the per-tenant totals: a tenant passed over stays within its share
# (what it holds only goes down, the share only up). An entry of no known tenant is always taken
_EVICT_PICK = (
    _INDEX_LIB
    + """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local keep = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local out = {}
local held, tenants = {}, 0
local per = redis.call('HGETALL', KEYS[4])
for i = 1, #per, 2 do
  held[per[i]] = tonumber(per[i + 1])
  tenants = tenants + 1
end
local n, at = 0, 0
while total > keep and n < limit do
  local chunk = redis.call('ZRANGE', KEYS[1], at, at + 63)
  if #chunk == 0 then break end
  at = at + #chunk
  for _, m in ipairs(chunk) do
    if total <= keep or n >= limit then break end
    local v = redis.call('HGET', KEYS[2], m)
    if not v then
      redis.call('ZREM', KEYS[1], m)
      at = at - 1
      n = n + 1
    else
      local d = cjson.decode(v)
      local t = tenant_of(d)
      if t == nil or (held[t] or 0) > keep / math.max(tenants, 1) then
        drop(m, v)
        at = at - 1
        total = total - d.tokens
        if t then
          held[t] = held[t] - d.tokens
          if held[t] <= 0 then tenants = tenants - 1 end
        end
        out[#out + 1] = m
        out[#out + 1] = v
        n = n + 1
      end
    end
  end
end
settle()
local more = 0
if total > keep and n >= limit and redis.call('ZCARD', KEYS[1]) > 0 then more = 1 end
return {more, out}
"""
)

# ARGV: key, entry JSON, key, entry JSON...: drop each entry still stored with exactly that value
_DROP = (
    _INDEX_LIB
    + """
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    drop(ARGV[i], ARGV[i + 1])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
settle()
return out
"""
)


STRIP, HOLDS = Script(_STRIP), Script(_HOLDS)
PIN_ADD, UNPIN, EVICT_PICK, DROP = (Script(s) for s in (_PIN_ADD, _UNPIN, _EVICT_PICK, _DROP))


def index_entry(index: Index, key: str, record: ConversationRecord) -> Call:
    """The step that indexes the pin ``record`` holds (a put's second step)."""
    entry = jsonwire.dumps(
        {
            "pin": record.pin_id,
            "tokens": record.num_tokens,
            "handle": record.handle,
            "stored_at": record.created_at,
            "expires_at": record.expires_at,
            "epoch": record.engine_epoch,
            "tenant": record.tenant,
            "n": secrets.token_hex(4),
        }
    ).decode()
    return (PIN_ADD, index.keys, [key, repr(record.created_at), entry, record.num_tokens])


def unpin(index: Index, key: str, pin_id: str) -> Call:
    """The step that drops ``key``'s entry from ``index`` if it is still pin ``pin_id``'s."""
    return (UNPIN, index.keys, [key, pin_id])


class RedisPins:
    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        urls = list(dict.fromkeys(decode_urls))
        if not urls:
            return {}

        async def run() -> list[Any]:
            client: Any = self._conn.client
            if self._conn.cluster:  # single commands: no Cluster pipeline (``state.redis.connection``)
                reads = [r for url in urls for r in _totals(client, self._conn.index(url))]
                return list(await asyncio.gather(*reads))
            async with client.pipeline(transaction=False) as pipe:
                for url in urls:
                    z, _, t, _ = self._conn.index(url).keys
                    pipe.zcard(z)
                    pipe.get(t)
                return list(await pipe.execute())

        res = await self._conn.twice_on_timeout("pinned", run)
        out: dict[str, Pinned] = {}
        for i, url in enumerate(urls):
            handles, tokens = int(res[2 * i] or 0), int(res[2 * i + 1] or 0)
            if handles:
                out[url] = Pinned(handles, tokens)
        return out

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        out: list[PinEntry] = []
        for _ in range(MAX_EVICT_ROUNDS):
            async with self._conn.op("evict"):
                more, picked = await self._pick(decode_url, keep_tokens)
                out += await self._strip(picked, why)
            if not more:
                break
        return out

    async def _pick(self, decode_url: str, keep_tokens: int) -> tuple[bool, list[PinEntry]]:
        """Evict's first step: entries off the index in ``state.fair``'s order (at most ``EVICT_BATCH``);
        whether more must go."""
        more, flat = await self._conn.eval(EVICT_PICK, self._conn.index(decode_url).keys, [keep_tokens, EVICT_BATCH])
        return bool(int(more)), [_entry(decode_url, str(flat[i]), str(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def _strip(self, picked: Sequence[PinEntry], why: str) -> list[PinEntry]:
        """Evict's second step: the CAS on each record; the entries whose record gave up its handle (a record
        on another node than the index's that could not be asked keeps it)."""
        if not picked:
            return []
        here = self._conn.node_of(self._conn.index(picked[0].decode_url).keys[0])
        stripped = await self._conn.spread(
            here, "strip", [(STRIP, [self._conn.conversation_key(e.key)], [e.pin_id, why]) for e in picked]
        )
        return [e for e, ok in zip(picked, stripped, strict=True) if ok is not None and int(ok) == 1]

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        index = self._conn.index(decode_url)
        here = self._conn.node_of(index.keys[0])
        async with self._conn.op("prune"):
            raw: dict[str, str] = await cast(Any, self._conn.client).hgetall(index.keys[1])
            entries = {k: _entry(decode_url, k, v) for k, v in raw.items()}
            doomed = {
                k
                for k, e in entries.items()
                if e.expires_at <= now or (epoch is not None and e.engine_epoch is not None and e.engine_epoch != epoch)
            }
            ask = [k for k in entries if k not in doomed]
            for i in range(0, len(ask), PRUNE_CHUNK):
                chunk = ask[i : i + PRUNE_CHUNK]
                holds = await self._conn.spread(
                    here, "holds", [(HOLDS, [self._conn.conversation_key(k)], [entries[k].pin_id]) for k in chunk]
                )
                # a record that could not be asked (None) keeps its entry
                doomed.update(k for k, h in zip(chunk, holds, strict=True) if h is not None and int(h) != 1)
            out: list[PinEntry] = []
            todo = [k for k in entries if k in doomed]
            for i in range(0, len(todo), PRUNE_CHUNK):
                chunk = todo[i : i + PRUNE_CHUNK]
                args: list[str | int | float] = []
                for k in chunk:
                    args += [k, raw[k]]
                dropped = await self._conn.eval(DROP, index.keys, args)
                out.extend(entries[k] for k, d in zip(chunk, dropped, strict=True) if int(d) == 1)
        return out


def _totals(client: Any, index: Index) -> tuple[Awaitable[Any], Awaitable[Any]]:
    """One engine's pinned handles and tokens, as two reads."""
    z, _, t, _ = index.keys
    return client.zcard(z), client.get(t)


def _entry(decode_url: str, key: str, raw: str) -> PinEntry:
    """An index entry."""
    try:
        d = jsonwire.loads_lenient(raw)
        return PinEntry(
            key=key,
            decode_url=decode_url,
            tokens=int(d["tokens"]),
            handle=dict(d["handle"]),
            pin_id=str(d["pin"]),
            stored_at=float(d["stored_at"]),
            expires_at=float(d["expires_at"]),
            engine_epoch=None if d["epoch"] is None else float(d["epoch"]),
            tenant=str(d.get("tenant") or ""),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"redis: unreadable pin index entry for {key!r}: {exc}") from exc
