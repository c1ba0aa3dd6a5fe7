"""The one place errors become responses: JSON in the shape of the API the client speaks, or a final SSE
event mid-stream.

Every error the gateway answers, its own or an engine's, has one shape per API: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` everywhere, and Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on the Anthropic Messages API (``/v1/messages``), so
each SDK raises its own typed exception. The shape follows the request's path (``shape_of``): the edge's
refusals (authentication, admission) and unknown routes take it too.

Client-facing messages never name an engine; an engine failure's instance is logged here instead.
A client that left mid-request gets one debug line and no answer.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from turnkv.errors import ClientError, ClientGone, GatewayError, RequestTimeout, UpstreamError

log = logging.getLogger("turnkv.errors")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # as routes accept one: nothing else is echoed
ANTHROPIC_PATH = "/v1/messages"  # and everything below it (count_tokens)

# Anthropic's error types by status (its documented set), and from an OpenAI-shaped error's type (mid-stream)
_ANTHROPIC_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_ANTHROPIC_BY_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "permission_error": "permission_error",
    "rate_limit_error": "rate_limit_error",
}
_OVERLOADED_CODES = ("server_overloaded", "shutting_down", "upstream_unavailable")

Shape = Callable[[GatewayError, "str | None"], dict[str, Any]]


class UnknownRoute(ClientError):
    """A path (or a method on it) the gateway does not serve."""

    status = 404
    code = "unknown_url"


def openai_body(exc: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    return exc.body()


def anthropic_type(status: int, openai_type: str | None = None, code: str | None = None) -> str:
    """Anthropic's error type for an error of this status (or, mid-stream, of this OpenAI type and code)."""
    if code in _OVERLOADED_CODES:
        return "overloaded_error"
    if status in _ANTHROPIC_BY_STATUS:
        return _ANTHROPIC_BY_STATUS[status]
    if openai_type in _ANTHROPIC_BY_TYPE:
        return _ANTHROPIC_BY_TYPE[openai_type]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(kind: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def anthropic_body(exc: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    """The error as Anthropic's API gives it; an engine's refusal keeps the engine's words (``message``)."""
    return anthropic_error(anthropic_type(exc.status, exc.type, exc.code), exc.message, request_id)


def anthropic_from_openai(error: Mapping[str, Any], request_id: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error object (a relayed stream's last event) in Anthropic's shape."""
    kind = anthropic_type(500, str(error.get("type") or ""), str(error.get("code") or ""))
    return anthropic_error(kind, str(error.get("message") or "the answer failed"), request_id)


def shape_of(path: str) -> Shape:
    """The error shape of the API at ``path``."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_body
    return openai_body


def error_response(exc: GatewayError, request_id: str | None = None, path: str = "") -> JSONResponse:
    headers = exc.headers()
    if request_id:
        headers["x-request-id"] = request_id
        if path.startswith(ANTHROPIC_PATH):
            headers["request-id"] = request_id  # the header Anthropic's SDKs read
    return JSONResponse(shape_of(path)(exc, request_id), status_code=exc.status, headers=headers)


def sse_error_event(exc: GatewayError) -> bytes:
    """Once the stream has started its status cannot change: the error is the last event (OpenAI's shape:
    a front end of another API translates it with the rest of the stream)."""
    return b"data: " + json.dumps(exc.body(), separators=(",", ":")).encode() + b"\n\n"


def _request_id(request: Request) -> str | None:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else None


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
    return error_response(exc, _request_id(request), request.url.path)


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in the API's shape."""
    assert isinstance(exc, HTTPException)
    err: GatewayError = UnknownRoute(f"Invalid URL ({request.method} {request.url.path})")
    if exc.status_code == 405:
        err = UnknownRoute(f"Method {request.method} is not allowed on {request.url.path}")
        err.status, err.code = 405, "method_not_allowed"
    elif exc.status_code != 404:
        err = ClientError(str(exc.detail))
        err.status = exc.status_code
    response = error_response(err, _request_id(request), request.url.path)
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    err = GatewayError("internal error in turnkv")
    return error_response(err, _request_id(request), request.url.path)
