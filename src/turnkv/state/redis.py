"""The Redis conversation store, shared by every gateway replica: one server, Sentinel or Cluster.

Keys (``ns`` the namespace; ``{...}`` is the Redis Cluster hash tag: each group lives in one slot):

* ``ns:c:{key}``: a conversation, a hash. A stored record: ``r`` (the record's JSON, handle left
  out), and while it pins ``h`` (the handle's JSON), ``p`` (its pin id) and ``i`` (its engine's
  index id); ``u`` says why it no longer does once evicted. A claimed one holds only ``m``, the
  claiming turn (the in-flight marker), with the in-flight TTL. A marker is never handed out, not
  even to its owner: a claim retried after a dropped reply sees ``in_flight`` (a recompute, never
  a handle used twice).
* ``ns:pins:{<hash of the decode URL>}:z|e|t``: one decode engine's pin index: a sorted set of
  conversation keys scored by ``stored_at`` (idle since), a hash of their entries (tokens, handle,
  expiry, epoch, pin id, and a nonce that tells this put from an identical later one), and the
  running token total.
* ``ns:d:{key}``: a document (a string with a TTL).

Every script touches one slot. Operations that span a conversation and an index are separate
single-slot steps, in an order where a race costs at most a stale or missing index entry, never a
handle released under a turn that holds it nor a handle used after its release:

* claim: take the record (marker in), then drop its index entry if that entry still names the
  claimed pin id. In between, an evict may pick the entry; its compare-and-set sees the marker and
  leaves the record alone, and the entry is not returned: the claiming turn owns the handle. The
  entry is dropped only when it names that pin id, so a newer pin stored meanwhile stays indexed.
  If the second step fails the entry is an orphan, which prune drops.
* put: the record (replacing whatever is there, a marker included), then its index entry, in one
  pipeline (one server runs them in that order; in a Cluster two nodes may run them in either
  order). A claim between the two leaves an orphan entry (the evict CAS refuses it, prune drops
  it). Should the entry land first, an evict in between finds no record holding that pin and
  drops the entry unreturned: the handle stays pinned, unindexed, until its next turn claims it or
  D's TTL frees it. A put that replaces a record holding another pin drops that pin's entry in one
  more round trip (rare: concurrent turns of one conversation).
* evict: pick entries off the index (removed atomically there), then per record a CAS that strips
  the handle only if the record still holds that pin id (a marker holds none); only those are
  returned for release. A claim before the CAS keeps the handle (it owns it); one after gets the
  record without it. If the CAS step fails, the picked records keep their handles, unindexed: a
  lost budget entry, never a release of a handle in use.
* prune: read the index, ask the records whether they still hold each pin, then drop entries by
  their exact stored value (the nonce), so an entry stored again meanwhile is kept.

Round trips: claim 1 (2 when the record holds a handle), put 1, release 1, pinned 1 for any number
of engines, evict 2 per 256 entries, prune 1-3, docs 1; plus one per script on the first use after
Redis lost its script cache (NOSCRIPT: load, run again).

The in-flight TTL bounds what a crashed gateway leaves behind: its markers go after
``in_flight_ttl_s``. A marker that times out while its turn still runs costs nothing but a reason
code: a concurrent turn then finds nothing instead of ``in_flight`` and recomputes either way, and
the last put wins; claims stay single-use, so no handle is used twice.

Connections: at most ``max_connections`` operations run at once per store (an asyncio semaphore in
front of redis-py's pools, the same for the three topologies, whose pools are sized to match). A
call that waits longer than ``pool_timeout_s`` for its turn raises ``StoreBusy``: load, not an
outage, which the guard does not count as Redis being down. ``warm`` opens the pool's connections
before traffic comes (a burst of first turns then opens none), and at most ``connect_concurrency``
connections are being opened at once (one server and Sentinel): after Redis restarts, a burst of
calls each reconnecting would otherwise all wait on each other's handshakes; a call that cannot
start opening one in time (as many rounds of the connect timeout as there are rounds of openings ahead
of it: bounded, and only reached when connections fail to open) is ``StoreBusy`` too. Opening a
connection has its own deadline (``connect_timeout_s``), not the command's.

Retries: a command is retried once, at once, on a connection error (a pooled connection Redis
dropped while it was away); a claim, read or release whose new connection did not open in time
(nothing was sent) once more. A timeout is retried once only where running the operation twice is
harmless (``pinned``, ``release``, ``get_doc``, ``put_doc``, ``ping``); never ``claim`` (a second
try would find the first one's marker) nor ``put`` (a second write could land after another turn
claimed the first, storing a handle that turn holds). A Cluster client also retries a timeout
once, on a fresh view of the slots. Every redis-py error is translated here, once, into
``StoreError`` with its kind: ``timeout``, ``connect_timeout``, ``unreachable``, ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnkv import jsonwire
from turnkv.errors import StoreBusy, StoreError
from turnkv.state.base import Claim, ClaimStatus, PinEntry, Pinned
from turnkv.state.record import ConversationRecord
from turnkv.state.redis_url import RedisTarget, Topology, parse_redis_url

T = TypeVar("T")
log = logging.getLogger("turnkv.store")

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_POOL_TIMEOUT_S = 0.5
DEFAULT_CONNECT_CONCURRENCY = 16
DEFAULT_IN_FLIGHT_TTL_S = 60.0
EVICT_BATCH = 256  # entries per pick; a pick and its CAS pipeline are one round trip each
MAX_EVICT_ROUNDS = 64  # 16k entries per evict call at most
PRUNE_CHUNK = 512  # records asked per pipeline
_REDIS_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)


@dataclasses.dataclass(frozen=True)
class TLSOptions:
    """Passed to every TLS connection (``rediss``); ``None`` fields keep Python's defaults."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"  # required | optional | none
    check_hostname: bool = True

    def kwargs(self) -> dict[str, Any]:
        return {
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_check_hostname": self.check_hostname,
        }


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

# --- scripts on an engine's index slot (KEYS = z, e, t) ---

_INDEX_LIB = """
local function drop(member, value)
  redis.call('ZREM', KEYS[1], member)
  redis.call('HDEL', KEYS[2], member)
  redis.call('DECRBY', KEYS[3], cjson.decode(value).tokens)
end
local function settle()
  if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[3]) end
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

# ARGV: tokens to keep, most entries to take. Returns {more, {key, entry, key, entry, ...}}.
_EVICT_PICK = (
    _INDEX_LIB
    + """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local keep = tonumber(ARGV[1])
local out = {}
local n = 0
while total > keep and n < tonumber(ARGV[2]) do
  local first = redis.call('ZPOPMIN', KEYS[1])
  if #first == 0 then break end
  local v = redis.call('HGET', KEYS[2], first[1])
  if v then
    redis.call('HDEL', KEYS[2], first[1])
    local tokens = cjson.decode(v).tokens
    redis.call('DECRBY', KEYS[3], tokens)
    total = total - tokens
    out[#out + 1] = first[1]
    out[#out + 1] = v
  end
  n = n + 1
end
settle()
local more = 0
if total > keep and redis.call('ZCARD', KEYS[1]) > 0 then more = 1 end
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


@dataclasses.dataclass(frozen=True)
class _Script:
    source: str
    sha: str = dataclasses.field(init=False)  # computed once, not on every call

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


CLAIM, PUT, RELEASE, STRIP, HOLDS = (_Script(s) for s in (_CLAIM, _PUT, _RELEASE, _STRIP, _HOLDS))
PIN_ADD, UNPIN, EVICT_PICK, DROP = (_Script(s) for s in (_PIN_ADD, _UNPIN, _EVICT_PICK, _DROP))

_Call = tuple[_Script, Sequence[str], Sequence[str | int | float]]


@dataclasses.dataclass(frozen=True)
class _Index:
    id: str
    keys: tuple[str, str, str]  # sorted set, entries, token total


class RedisStore:
    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        namespace: str = "turnkv",
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
        in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
        closers: Sequence[Any] = (),
    ) -> None:
        """``client`` must decode responses to str; its pools should allow ``max_connections``.
        ``closers``: more objects with ``aclose()`` that the store owns (a Sentinel's clients)."""
        if "{" in namespace or "}" in namespace:
            raise ValueError("the Redis namespace may not contain { or }: they would change the hash slots")
        self._redis = client
        self._ns = namespace
        self._slots = asyncio.Semaphore(max_connections)
        self._max_connections = max_connections
        self._pool_timeout_s = pool_timeout_s
        self._in_flight_ms = max(1, int(in_flight_ttl_s * 1000))
        self._closers = list(closers)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "turnkv",
        command_timeout_s: float = 0.25,
        connect_timeout_s: float | None = None,
        connect_concurrency: int = DEFAULT_CONNECT_CONCURRENCY,
        pool_timeout_s: float = DEFAULT_POOL_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
        tls: TLSOptions | None = None,
    ) -> RedisStore:
        """A store on the deployment ``url`` names (see ``state.redis_url``). Nothing connects yet
        (``warm`` opens the pool). ``connect_timeout_s``: default ``command_timeout_s``."""
        target = parse_redis_url(url)
        connect_s = command_timeout_s if connect_timeout_s is None else connect_timeout_s
        client, closers = _client(
            target,
            command_timeout_s=command_timeout_s,
            connect_timeout_s=connect_s,
            # a wait for a turn is bounded by the rounds of openings ahead of it, each within connect_s
            gate=_ConnectGate(connect_concurrency, connect_s * -(-max_connections // connect_concurrency)),
            max_connections=max_connections,
            tls=tls or TLSOptions(),
        )
        log.info(
            "store.redis target=%s max_connections=%d pool_timeout_s=%s command_timeout_s=%s connect_timeout_s=%s",
            target.describe(),
            max_connections,
            pool_timeout_s,
            command_timeout_s,
            connect_s,
        )
        return cls(
            client,
            namespace=namespace,
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
            in_flight_ttl_s=in_flight_ttl_s,
            closers=closers,
        )

    # --- keys ---

    def conversation_key(self, key: str) -> str:
        return f"{self._ns}:c:{{{key}}}"

    def _doc_key(self, key: str) -> str:
        return f"{self._ns}:d:{{{key}}}"

    def _index(self, decode_url: str) -> _Index:
        return self._index_by_id(hashlib.blake2b(decode_url.encode(), digest_size=8).hexdigest())

    def _index_by_id(self, index_id: str) -> _Index:
        base = f"{self._ns}:pins:{{{index_id}}}"
        return _Index(index_id, (f"{base}:z", f"{base}:e", f"{base}:t"))

    # --- the contract ---

    async def claim(self, key: str, *, owner: str) -> Claim:
        async def run() -> Claim:
            return _claim_of(await self._eval(CLAIM, [self.conversation_key(key)], [owner, self._in_flight_ms]))

        claim = await self._twice_on_timeout("claim", run, idempotent=False)
        record = claim.record
        if record is not None and record.handle is not None:
            try:
                async with self._op("claim"):
                    await self._eval(UNPIN, self._index(record.decode_url).keys, [key, str(record.pin_id)])
            except StoreError as exc:
                # the claim stands (the turn owns the handle); the entry left behind is an
                # orphan that evict's CAS refuses and prune drops
                log.warning("store.claim_unindex_failed reason=orphan_entry kind=%s error=%s", exc.kind, exc)
        return claim

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        async with self._op("put"):
            replaced = (await self._batch(self._put_calls(key, record, ttl_s)))[0]
            if replaced:  # a record holding another pin was overwritten: that pin's entry goes too
                await self._eval(UNPIN, self._index_by_id(str(replaced[1])).keys, [key, str(replaced[0])])

    def _put_calls(self, key: str, record: ConversationRecord, ttl_s: float) -> list[_Call]:
        """Put's steps: the record, then (when it holds a handle) its index entry."""
        k = self.conversation_key(key)
        ttl_ms = max(1, int(ttl_s * 1000))
        body = dataclasses.replace(record, handle=None, pin_id=None).to_json()
        if record.handle is None or record.pin_id is None:
            return [(PUT, [k], [body, "", "", "", ttl_ms])]
        pin = record.pin_id
        index = self._index(record.decode_url)
        entry = jsonwire.dumps(
            {
                "pin": pin,
                "tokens": record.num_tokens,
                "handle": record.handle,
                "stored_at": record.created_at,
                "expires_at": record.expires_at,
                "epoch": record.engine_epoch,
                "n": secrets.token_hex(4),
            }
        ).decode()
        return [
            (PUT, [k], [body, jsonwire.dumps(record.handle).decode(), pin, index.id, ttl_ms]),
            (PIN_ADD, index.keys, [key, repr(record.created_at), entry, record.num_tokens]),
        ]

    async def release(self, key: str, *, owner: str) -> None:
        async def run() -> None:
            await self._eval(RELEASE, [self.conversation_key(key)], [owner])

        await self._twice_on_timeout("release", run)

    async def pinned(self, decode_urls: Sequence[str]) -> dict[str, Pinned]:
        urls = list(dict.fromkeys(decode_urls))
        if not urls:
            return {}

        async def run() -> list[Any]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for url in urls:
                    z, _, t = self._index(url).keys
                    pipe.zcard(z)
                    pipe.get(t)
                return list(await pipe.execute())

        res = await self._twice_on_timeout("pinned", run)
        out: dict[str, Pinned] = {}
        for i, url in enumerate(urls):
            handles, tokens = int(res[2 * i] or 0), int(res[2 * i + 1] or 0)
            if handles:
                out[url] = Pinned(handles, tokens)
        return out

    async def evict(self, decode_url: str, *, keep_tokens: int, why: str) -> list[PinEntry]:
        out: list[PinEntry] = []
        for _ in range(MAX_EVICT_ROUNDS):
            async with self._op("evict"):
                more, picked = await self._pick(decode_url, keep_tokens)
                out += await self._strip(picked, why)
            if not more:
                break
        return out

    async def _pick(self, decode_url: str, keep_tokens: int) -> tuple[bool, list[PinEntry]]:
        """Evict's first step: entries off the index, idle longest first (at most ``EVICT_BATCH``);
        whether more must go."""
        more, flat = await self._eval(EVICT_PICK, self._index(decode_url).keys, [keep_tokens, EVICT_BATCH])
        return bool(int(more)), [_entry(decode_url, str(flat[i]), str(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def _strip(self, picked: Sequence[PinEntry], why: str) -> list[PinEntry]:
        """Evict's second step: the CAS on each record; the entries whose record gave up its handle."""
        if not picked:
            return []
        stripped = await self._batch([(STRIP, [self.conversation_key(e.key)], [e.pin_id, why]) for e in picked])
        return [e for e, ok in zip(picked, stripped, strict=True) if int(ok) == 1]

    async def prune(self, decode_url: str, *, now: float, epoch: float | None) -> list[PinEntry]:
        index = self._index(decode_url)
        async with self._op("prune"):
            raw: dict[str, str] = await cast(Any, self._redis).hgetall(index.keys[1])
            entries = {k: _entry(decode_url, k, v) for k, v in raw.items()}
            doomed = {
                k
                for k, e in entries.items()
                if e.expires_at <= now or (epoch is not None and e.engine_epoch is not None and e.engine_epoch != epoch)
            }
            ask = [k for k in entries if k not in doomed]
            for i in range(0, len(ask), PRUNE_CHUNK):
                chunk = ask[i : i + PRUNE_CHUNK]
                holds = await self._batch([(HOLDS, [self.conversation_key(k)], [entries[k].pin_id]) for k in chunk])
                doomed.update(k for k, h in zip(chunk, holds, strict=True) if int(h) != 1)
            out: list[PinEntry] = []
            todo = [k for k in entries if k in doomed]
            for i in range(0, len(todo), PRUNE_CHUNK):
                chunk = todo[i : i + PRUNE_CHUNK]
                args: list[str | int | float] = []
                for k in chunk:
                    args += [k, raw[k]]
                dropped = await self._eval(DROP, index.keys, args)
                out.extend(entries[k] for k, d in zip(chunk, dropped, strict=True) if int(d) == 1)
        return out

    async def put_doc(self, key: str, value: str, ttl_s: float) -> None:
        async def run() -> None:
            await self._redis.set(self._doc_key(key), value, px=max(1, int(ttl_s * 1000)))

        await self._twice_on_timeout("put_doc", run)

    async def get_doc(self, key: str) -> str | None:
        async def run() -> Any:
            return await self._redis.get(self._doc_key(key))

        value = await self._twice_on_timeout("get_doc", run)
        return None if value is None else str(value)

    async def ping(self) -> None:
        async def run() -> None:
            await self._redis.ping()

        await self._twice_on_timeout("ping", run)

    async def warm(self, connections: int, *, within_s: float) -> int:
        """Open up to ``connections`` of the pool's connections now (at most ``max_connections``; at
        most ``connect_concurrency`` at a time), and give them back to the pool, within ``within_s``;
        how many opened. A Cluster client learns its slots instead. Raises nothing: a Redis that is
        not there yet is met by the first calls (and the guard)."""
        n = min(connections, self._max_connections)
        if n <= 0:
            return 0
        client: Any = self._redis
        try:
            async with asyncio.timeout(within_s):
                if isinstance(self._redis, RedisCluster):
                    await self._redis.initialize()
                    return 0
                return await _hold_open(client.connection_pool, n)
        except (*_REDIS_ERRORS, _NoConnectTurn) as exc:
            log.warning("store.warm_failed error=%s detail=%s", type(exc).__name__, exc)
            return 0

    async def close(self) -> None:
        for c in [self._redis, *self._closers]:
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                await c.aclose()

    # --- plumbing ---

    @contextlib.asynccontextmanager
    async def _op(self, op: str) -> AsyncIterator[None]:
        """One operation's turn at the connections, and the translation of every redis-py error."""
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise StoreBusy(f"redis {op}: no connection free within {self._pool_timeout_s} s") from None
        try:
            if isinstance(self._redis, RedisCluster):
                # a no-op once the client knows the slots; without it, commands that start while
                # it is still learning them (first use, or after a reset on MOVED or a failover)
                # go to an arbitrary node and come back MOVED: redis-py (8.1) picks their route
                # before it waits for the slots
                await self._redis.initialize()
            yield
        except (MaxConnectionsError, _NoConnectTurn) as exc:  # a pool below max_connections; not an outage either
            raise StoreBusy(f"redis {op}: {exc}") from exc
        except _REDIS_ERRORS as exc:
            raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}", kind=_kind(exc)) from exc
        finally:
            self._slots.release()

    async def _twice_on_timeout(self, op: str, fn: Callable[[], Awaitable[T]], *, idempotent: bool = True) -> T:
        """``fn`` as one operation, run again once where that cannot do harm: when no connection could
        be opened for it (``connect_timeout``: nothing was sent), and for an ``idempotent`` one when its
        answer timed out (on another connection: redis-py drops one whose answer it gave up on)."""
        try:
            async with self._op(op):
                return await fn()
        except StoreError as exc:
            if not (exc.kind == "connect_timeout" or (idempotent and exc.kind == "timeout")):
                raise
            log.info("store.retry op=%s reason=%s", op, exc.kind)
        async with self._op(op):
            return await fn()

    async def _eval(self, script: _Script, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        client = cast(Any, self._redis)
        try:
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted, failed over, or flushed its scripts
            await client.script_load(script.source)
            return await client.evalsha(script.sha, len(keys), *keys, *args)

    async def _batch(self, calls: Sequence[_Call]) -> list[Any]:
        """The scripts in one pipeline (not a transaction; in a Cluster spread over the nodes);
        those that met NOSCRIPT are loaded and run again, the others are not run twice. One script is
        sent as itself: the same round trip without building a pipeline (a put without a handle)."""
        if len(calls) == 1:
            return [await self._eval(*calls[0])]
        results = await self._pipeline(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            for source in dict.fromkeys(calls[i][0].source for i in missing):
                await cast(Any, self._redis).script_load(source)
            for i, r in zip(missing, await self._pipeline([calls[i] for i in missing]), strict=True):
                results[i] = r
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                # not pipe.evalsha: redis-py refuses it in Cluster pipelines, for scripts whose keys
                # may span slots; ours each touch one slot, which routes them like any keyed command
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))


def _kind(exc: BaseException) -> str:
    """The kind of a redis-py failure (``errors.StoreError``)."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "connect_timeout" if "connecting" in str(exc) else "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"


class _NoConnectTurn(RedisError):
    """No turn to open a connection came within the connect timeout: load (``StoreBusy``)."""


class _ConnectGate:
    """At most ``limit`` connections being opened at once; a wait past ``wait_s`` is ``_NoConnectTurn``.
    Not a ``ConnectionError``: redis-py would retry it."""

    def __init__(self, limit: int, wait_s: float) -> None:
        self._sem = asyncio.Semaphore(limit)
        self._limit = limit
        self._wait_s = wait_s

    @contextlib.asynccontextmanager
    async def opening(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._sem.acquire()
        except TimeoutError:
            raise _NoConnectTurn(f"{self._limit} connections were being opened for {self._wait_s} s") from None
        try:
            yield
        finally:
            self._sem.release()


async def _hold_open(pool: Any, n: int) -> int:
    """Take ``n`` connections from ``pool`` at once (each opened), then give them all back; how many
    opened. Each is given back whatever happens (a cancelled warm-up included)."""
    settled = 0
    opened = 0
    all_settled = asyncio.Event()

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == n:
            all_settled.set()

    async def hold() -> None:
        nonlocal opened
        try:
            conn = await pool.get_connection()
        except (*_REDIS_ERRORS, _NoConnectTurn):
            settle()
            raise
        try:
            opened += 1
            settle()
            await all_settled.wait()
        finally:
            await pool.release(conn)

    results = await asyncio.gather(*(hold() for _ in range(n)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        log.warning("store.warm_partial opened=%d failed=%d error=%s", opened, len(failed), failed[0])
    return opened


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
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"redis: unreadable pin index entry for {key!r}: {exc}") from exc


class _Gated(AbstractConnection):
    """A connection that opens only with a turn from its store's ``_ConnectGate`` (a pool's
    connection kwargs carry the gate)."""

    def __init__(self, *args: Any, connect_gate: _ConnectGate | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connect_gate = connect_gate

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self.is_connected or self._connect_gate is None:
            await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
            return
        async with self._connect_gate.opening():
            await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


class _GatedConnection(_Gated, Connection):
    pass


class _GatedSSLConnection(_Gated, SSLConnection):
    pass


class _GatedUnixConnection(_Gated, UnixDomainSocketConnection):
    pass


class _SentinelConnection(_Gated, SentinelManagedConnection):
    """Asks Sentinel where the master is on every connect. redis-py (8.1) does so only in
    ``connect()``, while a command on a dropped connection reconnects through
    ``connect_check_health()``, to the old address: after a failover the retry of the command that
    met READONLY went back to the demoted master and failed again."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


class _SentinelSSLConnection(_SentinelConnection, SSLConnection):
    pass


def _client(
    target: RedisTarget,
    *,
    command_timeout_s: float,
    connect_timeout_s: float,
    gate: _ConnectGate,
    max_connections: int,
    tls: TLSOptions,
) -> tuple[Redis | RedisCluster, list[Any]]:
    """The redis-py client for ``target``: pools of ``max_connections`` and explicit timeouts (a slow
    Redis must not hold a turn). Retry: once at once, on a connection error only (redis-py keeps
    the retry of the connections its pool makes: the pool's connection kwargs carry it; a Redis
    client's own ``retry=`` is ignored when it is handed a pool). New connections open through
    ``gate`` (not in a Cluster, whose client makes its own per-node connections)."""
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = {
        "socket_timeout": command_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": True,
        "username": target.username,
        "password": target.password,
    }
    ssl = tls.kwargs() if target.tls else {}
    if target.topology is Topology.CLUSTER:
        nodes = [ClusterNode(h, p) for h, p in target.nodes]
        # a Cluster client retries (once here) on connection errors and timeouts, with a fresh
        # view of the slots; its per-node pools are not shared with anything else
        return RedisCluster(
            startup_nodes=nodes,
            max_connections=max_connections,
            retry=Retry(NoBackoff(), 1),
            ssl=target.tls,
            **common,
            **ssl,
        ), []
    conn_kwargs: dict[str, Any] = {
        **common,
        "retry": retry,
        "retry_on_error": [RedisConnectionError],
        "connect_gate": gate,
    }
    if target.topology is Topology.SENTINEL:
        assert target.service is not None
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": command_timeout_s,
            "socket_connect_timeout": command_timeout_s,
            "decode_responses": True,
            "retry": retry,
            **({"ssl": True, **ssl} if target.tls else {}),
        }
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        master = sentinel.master_for(
            target.service,
            max_connections=max_connections,
            db=target.db,
            connection_class=_SentinelSSLConnection if target.tls else _SentinelConnection,
            **conn_kwargs,
            **ssl,
        )
        return master, [sentinel]
    if target.path is not None:
        pool = ConnectionPool(
            connection_class=_GatedUnixConnection,
            path=target.path,
            db=target.db,
            max_connections=max_connections,
            **conn_kwargs,
        )
    else:
        host, port = target.nodes[0]
        pool = ConnectionPool(
            connection_class=_GatedSSLConnection if target.tls else _GatedConnection,
            host=host,
            port=port,
            db=target.db,
            max_connections=max_connections,
            **conn_kwargs,
            **ssl,
        )
    return Redis.from_pool(pool), []
