"""The bare relays again, as a plain ASGI app on uvicorn: the server stack turnkv runs on, without turnkv.

The same relay as ``baseline_relay`` (every request forwarded by method, path, body and content type to one
upstream engine and streamed back per read, unparsed; with a prefill engine, vLLM's P/D handshake for chat
requests first, JSON through orjson), but served by uvicorn (httptools, uvloop, as ``turnkv serve`` picks
them) through a bare ASGI callable: no Starlette, no middleware, no checks. Set beside the aiohttp.web relay
in the overhead suite, it says what the server stack costs, and the gateway's own work is what turnkv costs
on top of it. Started by ``python -m turnkv.bench.baseline_relay --server uvicorn``.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from turnkv import launch
from turnkv.bench import client
from turnkv.bench.client import prefill_request, upstream_session

HOP_HEADERS = tuple(h.encode() for h in client.HOP_HEADERS)
Scope = dict[str, Any]
Message = dict[str, Any]


class AsgiRelay:
    """The ASGI app: the lifespan opens and closes the upstream session; every HTTP request is relayed."""

    def __init__(self, upstream: str, prefill: str | None = None) -> None:
        self.base = upstream.rstrip("/")
        self.p_base = prefill.rstrip("/") if prefill else None
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._relay(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = upstream_session()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _relay(self, scope: Scope, receive: Any, send: Any) -> None:
        assert self.session is not None, "the lifespan opened the session"
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in HOP_HEADERS}
        method, path = scope["method"], scope["path"]
        if self.p_base is not None and method == "POST" and path == "/v1/chat/completions":
            req = orjson.loads(body)
            p_body = orjson.dumps(prefill_request(req))
            async with self.session.post(self.p_base + path, data=p_body, headers=headers) as p:
                answer = await p.read()
                if p.status != 200:
                    await _answer(send, p.status, p.headers.get("content-type", ""), answer)
                    return
            req["kv_transfer_params"] = orjson.loads(answer).get("kv_transfer_params")
            body = orjson.dumps(req)
        query = scope.get("query_string", b"")
        url = self.base + path + ("?" + query.decode() if query else "")
        async with self.session.request(method, url, data=body or None, headers=headers) as up:
            ctype = up.headers.get("content-type", "").encode()
            await send({"type": "http.response.start", "status": up.status, "headers": [(b"content-type", ctype)]})
            async for data in up.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _answer(send: Any, status: int, ctype: str, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype.encode())]})
    await send({"type": "http.response.body", "body": body})


def serve(upstream: str, port: int, prefill: str | None) -> None:
    """Serve on 127.0.0.1:``port`` (0: any free port) as ``turnkv serve`` runs uvicorn, until SIGTERM or
    SIGINT; the URL is announced first."""
    launch.serve(AsgiRelay(upstream, prefill), "127.0.0.1", port)
