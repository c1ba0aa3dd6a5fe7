"""The Redis conversation store, shared by every gateway replica.

One round trip to claim (a Lua script: read, leave an in-flight marker, drop the pin entry) and
one to put (a MULTI: the record with its TTL, plus the pin index). Every redis-py error or timeout
is translated here, once, into ``StoreError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from turnkv.errors import StoreError
from turnkv.state.base import IN_FLIGHT_TTL_S, Claim, ClaimStatus, Pinned
from turnkv.state.record import ConversationRecord

MARKER = "~in-flight"

_CLAIM = """
local v = redis.call('GET', KEYS[1])
if not v then return false end
if v == ARGV[1] then return v end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('HDEL', KEYS[3], KEYS[1])
return v
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_PINNED = """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1000)
if #old > 0 then
  redis.call('ZREM', KEYS[1], unpack(old))
  redis.call('HDEL', KEYS[2], unpack(old))
end
return redis.call('HGETALL', KEYS[2])
"""


@contextlib.contextmanager
def map_redis_errors(op: str) -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc


class RedisStore:
    def __init__(self, client: Redis, *, namespace: str = "turnkv") -> None:
        """``client`` must decode responses to str."""
        self._redis = client
        self._ns = namespace
        self._pins = f"{namespace}:pins"
        self._pininfo = f"{namespace}:pininfo"
        self._claim = self._redis.register_script(_CLAIM)
        self._release = self._redis.register_script(_RELEASE)
        self._pinned = self._redis.register_script(_PINNED)

    @classmethod
    def from_url(
        cls, url: str, *, namespace: str = "turnkv", timeout_s: float = 0.25, max_connections: int = 64
    ) -> RedisStore:
        """One blocking pool with explicit timeouts: a slow Redis must not hold a turn; the guard in
        front of the store decides when to try again."""
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )
        # one immediate retry on a refused or reset connection, so the first command after Redis
        # comes back does not fail on a pooled connection from before; none on timeouts
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        return cls(Redis(connection_pool=pool, retry=retry), namespace=namespace)

    def key(self, conversation: str) -> str:
        return f"{self._ns}:conv:{conversation}"

    async def claim(self, key: str) -> Claim:
        k = self.key(key)
        with map_redis_errors("claim"):
            raw = await self._claim(keys=[k, self._pins, self._pininfo], args=[MARKER, int(IN_FLIGHT_TTL_S)])
        if raw is None:
            return Claim(ClaimStatus.MISSING)
        if raw == MARKER:
            return Claim(ClaimStatus.IN_FLIGHT)
        try:
            return Claim(ClaimStatus.FOUND, ConversationRecord.from_json(raw))
        except (ValueError, TypeError, KeyError):
            return Claim(ClaimStatus.CORRUPT)

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        k = self.key(key)
        with map_redis_errors("put"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(k, record.to_json(), px=max(1, int(ttl_s * 1000)))
                pipe.zadd(self._pins, {k: record.expires_at})
                pipe.hset(self._pininfo, k, f"{record.decode_url}\t{record.num_tokens}")
                await pipe.execute()

    async def release(self, key: str) -> None:
        with map_redis_errors("release"):
            await self._release(keys=[self.key(key)], args=[MARKER])

    async def pinned(self, now: float) -> dict[str, Pinned]:
        with map_redis_errors("pinned"):
            flat = await self._pinned(keys=[self._pins, self._pininfo], args=[now])
        out: dict[str, Pinned] = {}
        for i in range(1, len(flat), 2):
            url, _, tokens = str(flat[i]).rpartition("\t")
            p = out.get(url, Pinned(0, 0))
            out[url] = Pinned(p.handles + 1, p.tokens + int(tokens or 0))
        return out

    async def ping(self) -> None:
        with map_redis_errors("ping"):
            await self._redis.ping()

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()
