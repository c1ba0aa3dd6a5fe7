"""The gateway's front door, as ASGI middleware: who a request comes from, and whether it may start now.

Before any route runs, every request is authenticated (``auth.Authenticator``; ``/health`` and ``/ready``
are open to all, a valid admin key only adds ``/ready``'s details). A POST (a turn, a tokenize call: engine
work) then has its body read here, as one of the requests still arriving (``inflight.RequestLimits``: a
small budget of its own, within ``limits.body_timeout_s`` and ``max_body_bytes``), and only once it is whole
takes a place in flight; the route reads the body as it came. A refusal is an OpenAI-shaped error, counted
in ``turnkv_rejected_requests_total{reason}``. The request's ``Principal`` is left in its state for the
routes. Pure ASGI, so a streamed answer holds its place until its last byte is sent. One ``Edge`` serves
both ways in: the middleware in front of Starlette's router, and the turn routes served directly
(``gateway.hot``), so that they share one count.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnkv.config import Settings
from turnkv.errors import BodyTooLarge, ClientGone, GatewayError, RequestTimeout
from turnkv.gateway.auth import Authenticator, Principal
from turnkv.gateway.error_responses import ANTHROPIC_PATH, error_response
from turnkv.gateway.inflight import Keys, RequestLimits
from turnkv.gateway.tally import Tally

OPEN_PATHS = frozenset({"/health", "/ready"})
log = logging.getLogger("turnkv.edge")


class Edge:
    """Authentication, the body's arrival and the place in flight, in front of whichever ASGI app serves the
    request. ``tally``: where the holdings are counted (``serve --workers``: shared with the other workers)."""

    def __init__(self, settings: Settings, tally: Tally | None = None) -> None:
        self.auth = Authenticator(settings)
        self.limits = RequestLimits(settings.limits, tally or Tally(), tenants=self.auth.required)
        self.max_body_bytes = settings.max_body_bytes
        self.body_timeout_s = settings.limits.body_timeout_s

    def _principal(self, scope: Scope, headers: Headers) -> Principal:
        if scope["path"] in OPEN_PATHS:
            try:
                return self.auth.authenticate(headers)
            except GatewayError:
                return self.auth.anonymous()
        return self.auth.authenticate(headers, x_api_key=scope["path"].startswith(ANTHROPIC_PATH))

    async def serve(self, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
        """Serve an HTTP request with ``app`` once it is authenticated, whole and admitted; answer the refusal
        if not."""
        state: dict[str, Any] = scope.setdefault("state", {})
        headers = Headers(scope=scope)
        engine_work = scope["method"] == "POST"
        body = b""
        try:
            principal = self._principal(scope, headers)
            client = scope.get("client")
            keys = self.limits.keys(client[0] if client else None, principal.tenant)
            if engine_work:
                self.limits.check(keys)  # refused now rather than after its body has come
                body = await self._arrive(keys, receive, headers)
                self.limits.check(keys)
        except GatewayError as exc:
            svc = state.get("services")
            if svc is not None:
                svc.metrics.rejections.labels(exc.code or exc.type).inc()
            if isinstance(exc, ClientGone):
                log.debug("client.gone path=%s", scope["path"])
                return  # nobody reads an answer
            response = error_response(exc, path=scope["path"])
            if engine_work:  # its body may not have been read: the connection cannot carry another request
                response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        state["principal"] = principal
        if not engine_work:
            await app(scope, receive, send)
            return
        with self.limits.hold(keys):
            await app(scope, _replay(body, receive), send)

    async def _arrive(self, keys: Keys, receive: Receive, headers: Headers) -> bytes:
        """The whole body: at once when it came with the headers (the usual case: no place is taken), else
        read as one of the requests still arriving."""
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"request body exceeds {self.max_body_bytes} bytes")
        first = await _ready(receive)
        if first is not None and first["type"] == "http.request" and not first.get("more_body", False):
            body: bytes = first.get("body", b"")
            if len(body) > self.max_body_bytes:
                raise BodyTooLarge(f"request body exceeds {self.max_body_bytes} bytes")
            return body
        with self.limits.arrive(keys):
            return await self._body(receive, first)

    async def _body(self, receive: Receive, first: Message | None) -> bytes:
        """The rest of the body after ``first`` (None: nothing read yet), within the size and time limits."""
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = first if first is not None else await receive()
                    first = None
                    if message["type"] == "http.disconnect":
                        raise ClientGone("the client disconnected before its request body arrived")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise BodyTooLarge(f"request body exceeds {self.max_body_bytes} bytes")
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s") from None


async def _ready(receive: Receive) -> Message | None:
    """The next message if the server has it now, without waiting for the client; None if it has not."""
    try:
        async with asyncio.timeout(0):  # a receive that would wait is cancelled there (before it takes anything)
            return await receive()
    except TimeoutError:
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body, already read, as its first message (then the client's leaving)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.edge.serve(scope, receive, send, self.app)
