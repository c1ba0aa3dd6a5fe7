"""The gateway's exceptions. Every error a client can see is one of these, rendered in one place.

* GatewayError                       status, OpenAI ``type`` and ``code``
  x ClientError                      400 invalid_request_error: the request is wrong
    - BodyTooLarge                   413
    - ModelNotFound                  404 model_not_found
    - Unauthorized                   401 invalid_api_key
    - Forbidden                      403 insufficient_permissions
    - RequestTimeout                 408 request_timeout: the body did not arrive in time
    - ClientGone                     the client left mid-request; nobody reads the answer
    - NotServed                      501 unsupported_endpoint: an endpoint of the API the gateway does not serve
  x Overloaded                       503 server_overloaded, with Retry-After
    - TenantLimit                    429 rate_limit_exceeded, with Retry-After
    - ShuttingDown                   503 shutting_down: the gateway is shutting down
  x UpstreamError                    an engine failed; carries ``leg`` and ``instance``
    - UpstreamUnavailable            503: no instance could be reached
    - UpstreamTimeout                504
      · FirstTokenDeadline           the engine did not start its answer in time
    - UpstreamStatus                 the engine answered an error status (its body is kept)
    - UpstreamProtocolError          502: the engine answered something we cannot read
* ConfigError (a ValueError)         a setting is missing or inconsistent: refused at start, never
                                     raised at request time
* StoreError                         the conversation store failed; never rendered: the turn
                                     degrades to plain P/D and the error is counted
  - StoreBusy                        no connection came free in time: this call fails, but the
                                     store is not down (the guard stays closed)

Foreign exceptions are translated once, at the edge: aiohttp by ``aiohttp_errors`` (the engines' and the
render services' calls), redis in ``state.redis``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import aiohttp

from turnkv import jsonwire


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Response headers the error needs (Retry-After, WWW-Authenticate, Connection)."""
        return {}


class ClientError(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(ClientError):
    status = 413
    code = "request_too_large"


class ModelNotFound(ClientError):
    status = 404
    code = "model_not_found"


class Unauthorized(ClientError):
    status = 401
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class Forbidden(ClientError):
    status = 403
    type = "permission_error"
    code = "insufficient_permissions"


class RequestTimeout(ClientError):
    status = 408
    code = "request_timeout"

    def headers(self) -> dict[str, str]:
        return {"connection": "close"}  # the rest of the body may still come: do not read it


class ClientGone(ClientError):
    """The client disconnected before its request was read; the answer goes nowhere."""

    status = 499
    code = "client_closed_request"


class NotServed(ClientError):
    """An endpoint of the API (OpenAI's, Anthropic's) that neither the gateway nor its engines serve."""

    status = 501
    code = "unsupported_endpoint"


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class TenantLimit(Overloaded):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ShuttingDown(Overloaded):
    code = "shutting_down"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1)


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    kind = "error"

    def __init__(self, message: str, *, leg: str, instance: str | None = None) -> None:
        super().__init__(message)
        self.leg = leg
        self.instance = instance


class UpstreamUnavailable(UpstreamError):
    status = 503
    code = "upstream_unavailable"
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"
    kind = "timeout"


class FirstTokenDeadline(UpstreamTimeout):
    code = "first_token_deadline"
    kind = "first_token_deadline"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"
    kind = "protocol"


class UpstreamStatus(UpstreamError):
    """The engine answered with an error status; 4xx bodies are passed to the client as they are."""

    kind = "status"

    def __init__(self, status: int, body: Any, *, leg: str, instance: str | None = None) -> None:
        message = _message_of(body) or f"{leg} engine answered HTTP {status}"
        super().__init__(message, leg=leg, instance=instance)
        self.upstream_status = status
        self.upstream_body = body
        self.status = status if 400 <= status < 500 else 502
        self.code = "upstream_status"

    def body(self) -> dict[str, Any]:
        if 400 <= self.upstream_status < 500 and isinstance(self.upstream_body, dict) and "error" in self.upstream_body:
            return self.upstream_body
        return super().body()


@contextlib.contextmanager
def aiohttp_errors(leg: str, instance: str, *, peer: str = "engine") -> Iterator[None]:
    """aiohttp's failures of a call to ``instance`` as the ``UpstreamError`` tree; the messages, which clients
    may read, name the leg and the kind of ``peer`` (an engine, a render service), not the instance."""
    try:
        yield
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"{leg} {peer} timed out", leg=leg, instance=instance) from exc
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise UpstreamUnavailable(
            f"{leg} {peer} unreachable: {type(exc).__name__}", leg=leg, instance=instance
        ) from exc
    except aiohttp.ClientError as exc:
        # aiohttp's own text names the URL: the type is enough for a client
        raise UpstreamProtocolError(
            f"{leg} {peer} answered unreadably: {type(exc).__name__}", leg=leg, instance=instance
        ) from exc


def upstream_answer(status: int, raw: bytes, *, leg: str, instance: str) -> Any:
    """An upstream's answer body read leniently (``None`` where empty or not JSON); a status >= 400 raises
    ``UpstreamStatus`` carrying it."""
    try:
        data = jsonwire.loads_lenient(raw) if raw else None
    except ValueError:
        data = None
    if status >= 400:
        raise UpstreamStatus(status, data, leg=leg, instance=instance)
    return data


def retryable(exc: UpstreamError) -> bool:
    """Whether another instance (or the same one, without a KV handle) may succeed."""
    if isinstance(exc, UpstreamStatus):
        return exc.upstream_status >= 500
    return isinstance(exc, (UpstreamUnavailable, UpstreamTimeout, UpstreamProtocolError))


def _message_of(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
        return str(msg) if msg is not None else None
    return None


class StoreError(Exception):
    """The conversation store failed or timed out. ``kind`` says how, for the breaker (``state.breaker``),
    metrics and logs: ``timeout`` (a command's answer did not come in time), ``connect_timeout`` (a new
    connection did not open in time), ``unreachable`` (refused or reset: nothing answers), ``error`` (an
    error answer, or one we cannot read), ``busy`` (StoreBusy), ``open`` (skipped: the store counts as
    down)."""

    kind: str = "error"

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class StoreBusy(StoreError):
    """Every connection to the store stayed busy past the pool wait: load, not an outage."""

    kind = "busy"


class ConfigError(ValueError):
    """A setting is missing or inconsistent; raised at start, never at request time."""
