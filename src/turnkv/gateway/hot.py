"""The turn routes served as plain ASGI, beside Starlette's router: which requests skip its stack.

The app has one route table (``app.ROUTES``); its ``TurnRoute`` rows are the turns. A POST to a turn
path (chat, completions, responses) goes from the server straight to the ``Edge``
(authentication, admission) and its endpoint, with the same exception handlers as every other route,
but without Starlette's middleware stack and route matching: its ServerErrorMiddleware, its
ExceptionMiddleware and the route's own exception wrapper each wrap ``send``, so each costs a Python
call per write of a streamed answer, and a turn is many writes. The answer is the endpoint's own
response (``turn.stream.RelayResponse`` for a stream). Everything else, and every request when a CORS
middleware must see it, goes through Starlette as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from turnkv.errors import GatewayError
from turnkv.gateway.edge import Edge
from turnkv.gateway.error_responses import on_gateway_error, on_http_exception, on_unexpected

Endpoint = Callable[[Request], Awaitable[Response]]
log = logging.getLogger("turnkv.hot")


class HotRoute:
    """One endpoint as an ASGI app: its response, or its error as the app's exception handlers make it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except GatewayError as exc:
            response = await on_gateway_error(request, exc)
        except HTTPException as exc:
            response = await on_http_exception(request, exc)
        except Exception as exc:  # as Starlette's ServerErrorMiddleware: an OpenAI-shaped 500, logged
            response = await on_unexpected(request, exc)
        await response(scope, receive, send)


class TurnRoute(Route):
    """A turn's endpoint (``POST path``): Starlette's route, and on the fast path the same endpoint."""

    def __init__(self, path: str, endpoint: Endpoint) -> None:
        super().__init__(path, endpoint, methods=["POST"])
        self.turn_endpoint = endpoint


class GatewayApp(Starlette):
    """Starlette over one route table, serving its ``TurnRoute`` POSTs itself (through ``edge``) unless
    ``fast`` is off (a CORS middleware must see every request), and all else as usual."""

    def __init__(self, *, routes: Sequence[BaseRoute], edge: Edge, fast: bool = True, **kwargs: Any) -> None:
        super().__init__(routes=routes, **kwargs)
        self._edge = edge
        turns = [r for r in routes if isinstance(r, TurnRoute)] if fast else []
        self._hot = {r.path: HotRoute(r.turn_endpoint) for r in turns}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self._hot.get(scope["path"])
            if route is not None:
                scope["app"] = self
                await self._edge.serve(scope, receive, send, route)
                return
        await super().__call__(scope, receive, send)
