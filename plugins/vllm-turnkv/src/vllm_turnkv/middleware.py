"""An ASGI middleware that advertises the plugin on every HTTP response of the API server.

The header lets a router learn at start, with one cheap ``GET /version`` (or ``/health``), that this
server's streaming chat and completions responses end with D's ``kv_transfer_params``:

    x-turnkv-plugin: 0.1.0; streams=chat,completions

``streams`` lists the stream generators that were actually patched in this process.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

HEADER = "x-turnkv-plugin"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header_value(version: str, streams: list[str]) -> str:
    return f"{version}; streams={','.join(streams)}"


def parse_header_value(value: str | None) -> tuple[str, frozenset[str]] | None:
    """``(version, streams)`` from a header value, or None when absent or malformed (for routers)."""
    if not value:
        return None
    version, _, rest = value.partition(";")
    streams: frozenset[str] = frozenset()
    for part in rest.split(";"):
        key, _, val = part.strip().partition("=")
        if key == "streams":
            streams = frozenset(s for s in val.split(",") if s)
    return (version.strip(), streams) if version.strip() else None


class AdvertiseMiddleware:
    """Adds ``x-turnkv-plugin`` to the start of every HTTP response; everything else passes through."""

    def __init__(self, app: ASGIApp, value: str) -> None:
        self.app = app
        self.raw = (HEADER.encode("latin-1"), value.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message.get("type") == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append(self.raw)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_header)
