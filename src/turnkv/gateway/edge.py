"""The gateway's front door, as ASGI middleware: who a request comes from, and whether it may start now.

Before any route runs, every request is authenticated (``auth.Authenticator``; ``/health`` and ``/ready``
are open to all, a valid admin key only adds ``/ready``'s details), and a POST (a turn, a tokenize call:
engine work) is admitted or refused by ``inflight.InFlightLimits``. A refusal is an OpenAI-shaped error, counted
in ``turnkv_rejected_requests_total{reason}``. The request's ``Principal`` is left in its state for the
routes. Pure ASGI, so a streamed answer holds its admission until its last byte is sent. One ``Edge`` serves
both ways in: the middleware in front of Starlette's router, and the turn routes served directly
(``gateway.hot``), so that they share one admission count.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from turnkv.config import Settings
from turnkv.errors import GatewayError
from turnkv.gateway.auth import Authenticator
from turnkv.gateway.error_responses import ANTHROPIC_PATH, error_response
from turnkv.gateway.inflight import InFlightLimits

OPEN_PATHS = frozenset({"/health", "/ready"})


class Edge:
    """Authentication and admission, in front of whichever ASGI app serves the request."""

    def __init__(self, settings: Settings) -> None:
        self.auth = Authenticator(settings)
        lim = settings.limits
        self.limits = InFlightLimits(
            lim.max_inflight, lim.max_inflight_per_tenant if self.auth.required else None, lim.retry_after_s
        )

    async def serve(self, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
        """Serve an HTTP request with ``app`` once it is authenticated and admitted; answer the refusal if not."""
        state: dict[str, Any] = scope.setdefault("state", {})
        headers = Headers(scope=scope)
        engine_work = scope["method"] == "POST"
        try:
            if scope["path"] in OPEN_PATHS:
                try:
                    principal = self.auth.authenticate(headers)
                except GatewayError:
                    principal = self.auth.anonymous()
            else:
                principal = self.auth.authenticate(headers, x_api_key=scope["path"].startswith(ANTHROPIC_PATH))
            if engine_work:
                self.limits.check(principal.tenant)
        except GatewayError as exc:
            svc = state.get("services")
            if svc is not None:
                svc.metrics.rejections.labels(exc.code or exc.type).inc()
            await error_response(exc, path=scope["path"])(scope, receive, send)
            return
        state["principal"] = principal
        if not engine_work:
            await app(scope, receive, send)
            return
        with self.limits.hold(principal.tenant):
            await app(scope, receive, send)


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.edge.serve(scope, receive, send, self.app)
