"""Documents on Redis (``state.base.Documents``): a string with a TTL each (``ns:d:{key}``); a put or a get
that timed out is run again once (both are harmless twice), and so is a delete (a second finds none: the
first one's answer is the one lost, so such a delete says it found none)."""

from __future__ import annotations

from typing import Any

from turnkv.state.redis.connection import RedisConnection


class RedisDocuments:
    def __init__(self, conn: RedisConnection) -> None:
        self._conn = conn

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        async def run() -> None:
            await self._conn.client.set(self._conn.doc_key(key), value, px=max(1, int(ttl_s * 1000)))

        await self._conn.twice_on_timeout("put_doc", run)

    async def get(self, key: str) -> str | None:
        async def run() -> Any:
            return await self._conn.client.get(self._conn.doc_key(key))

        value = await self._conn.twice_on_timeout("get_doc", run)
        return None if value is None else str(value)

    async def delete(self, key: str) -> bool:
        async def run() -> Any:
            return await self._conn.client.delete(self._conn.doc_key(key))

        return bool(await self._conn.twice_on_timeout("delete_doc", run))
