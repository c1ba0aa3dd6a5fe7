"""The simulator's prefix cache is keyed by ``cache_salt``, as vLLM's: a salted prompt matches only blocks
cached under the same salt (the gateway salts per tenant so one tenant cannot probe another's cache)."""

from __future__ import annotations

from tests.sim.helpers import asgi_client, chat_body

MESSAGES = [
    {"role": "system", "content": "A long shared system prompt, " * 8},
    {"role": "user", "content": "Plan a trip to the sea"},
]


async def test_only_the_same_salt_hits_the_cache() -> None:
    async with asgi_client(details=True) as c:

        async def cached(salt: str | None) -> int:
            body = chat_body(MESSAGES, **({"cache_salt": salt} if salt is not None else {}))
            r = (await c.post("/v1/chat/completions", json=body)).json()
            n: int = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            return n

        assert await cached(None) == 0
        assert await cached("tenant-a") == 0
        assert await cached("tenant-b") == 0
        hits = {await cached(s) for s in (None, "tenant-a", "tenant-b")}
        assert len(hits) == 1 and hits.pop() > 0
