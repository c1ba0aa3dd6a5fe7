"""The one place errors become responses: OpenAI-shaped JSON, or a final SSE event mid-stream.

Client-facing messages never name an engine; an engine failure's instance is logged here instead.
A client that left mid-request gets one debug line and no answer.
"""

from __future__ import annotations

import json
import logging
import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turnkv.errors import ClientGone, GatewayError, RequestTimeout, UpstreamError

log = logging.getLogger("turnkv.errors")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # as routes accept one: nothing else is echoed


def error_response(exc: GatewayError, request_id: str | None = None) -> JSONResponse:
    headers = exc.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def sse_error_event(exc: GatewayError) -> bytes:
    """Once the stream has started its status cannot change: the error is the last event."""
    return b"data: " + json.dumps(exc.body(), separators=(",", ":")).encode() + b"\n\n"


async def on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    if isinstance(exc, (ClientGone, RequestTimeout)):
        svc = getattr(request.state, "services", None)
        if svc is not None:
            svc.metrics.rejections.labels(exc.code).inc()
    if isinstance(exc, ClientGone):
        log.debug("client.gone path=%s", request.url.path)
        return Response(status_code=exc.status)  # nobody reads it
    if isinstance(exc, UpstreamError):
        log.warning(
            "upstream.error leg=%s instance=%s status=%s message=%s", exc.leg, exc.instance, exc.status, exc.message
        )
    given = request.headers.get("x-request-id", "")
    return error_response(exc, given if _REQUEST_ID.fullmatch(given) else None)


async def on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    body = {"error": {"message": "internal error in turnkv", "type": "internal_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=500)
