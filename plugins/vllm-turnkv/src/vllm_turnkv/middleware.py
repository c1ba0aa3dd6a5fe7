"""An ASGI middleware that advertises the plugin on every HTTP response of the API server.

The header lets a router learn at start, with one cheap ``GET /version`` (or ``/health``), that this
server's streaming chat and completions responses end with D's ``kv_transfer_params``, and which GPUs it
computes on:

    x-turnkv-plugin: 0.1.0; streams=chat,completions; gpus=GPU-5f2c...,GPU-9a01...

``streams`` lists the stream generators that were actually patched in this process; ``gpus`` the
devices' NVML UUIDs (``gpus``), absent where they could not be read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, NamedTuple

HEADER = "x-turnkv-plugin"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Advert(NamedTuple):
    version: str
    streams: frozenset[str]  # stream kinds whose chunks end with the handle
    gpus: frozenset[str]  # the NVML UUIDs of the devices the server computes on (empty: not known)


def header_value(version: str, streams: list[str], gpus: list[str] | None = None) -> str:
    value = f"{version}; streams={','.join(streams)}"
    return f"{value}; gpus={','.join(gpus)}" if gpus else value


def parse_header_value(value: str | None) -> Advert | None:
    """What a header value says, or None when absent or malformed (for routers)."""
    if not value:
        return None
    version, _, rest = value.partition(";")
    lists: dict[str, frozenset[str]] = {}
    for part in rest.split(";"):
        key, _, val = part.strip().partition("=")
        lists[key] = frozenset(s.strip() for s in val.split(",") if s.strip())
    empty: frozenset[str] = frozenset()
    return Advert(version.strip(), lists.get("streams", empty), lists.get("gpus", empty)) if version.strip() else None


class AdvertiseMiddleware:
    """Adds ``x-turnkv-plugin`` to the start of every HTTP response; everything else passes through.

    ``value`` is the header's value, or a function that gives it (None: no header yet), for a server that
    learns it after the middleware is in place (vLLM 0.33's endpoint plugins: ``endpoint``)."""

    def __init__(self, app: ASGIApp, value: str | Callable[[], str | None]) -> None:
        self.app = app
        self.value = value
        self._raw: tuple[str, tuple[bytes, bytes]] | None = None

    def header(self) -> tuple[bytes, bytes] | None:
        value = self.value() if callable(self.value) else self.value
        if value is None:
            return None
        if self._raw is None or self._raw[0] != value:
            self._raw = (value, (HEADER.encode("latin-1"), value.encode("latin-1")))
        return self._raw[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = self.header() if scope.get("type") == "http" else None
        if raw is None:
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message.get("type") == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append(raw)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_header)
