"""Connection limits for the gateway's uvicorn server: how long a client may take to send a request's headers,
how many connections may be open (in all and from one address), and the open-file limit that holds them.

uvicorn has no header timeout: a client that sends its headers a byte at a time keeps its connection, and a
file descriptor, as long as it likes. ``edge_protocol`` subclasses uvicorn's HTTP protocol (httptools, else
h11) with a timer that runs from a connection's start, and from the first byte of a kept-alive connection's
next request, until that request's headers are complete (uvicorn has started its request cycle). When it fires
the connection is closed, after a 408 where part of a request had arrived. (An idle kept-alive connection is
uvicorn's own keep-alive timeout's, set from ``limits.keep_alive_s``.) A client that stops reading its answer
is dropped once the send buffer has stayed full for ``send_timeout_s`` (the app then sees a disconnect, and a
streamed turn ends as for any client that left). A connection over a cap is answered 503 and closed as soon as
it is accepted, before it costs more than its descriptor for a moment. The body's deadline is the app's
(``requests.read_json``), which can answer it in OpenAI's shape. uvicorn's ``limit_concurrency`` is not used:
it answers in plain text, and only once a request's headers have arrived.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from turnkv.config import Settings

log = logging.getLogger("turnkv.connections")
FD_RESERVE = 256  # descriptors kept for Redis, logs, the metrics directory and the listening socket
FD_TARGET_UNLIMITED = 1 << 20  # where the hard limit is "unlimited"


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout_s: float
    max_connections: int
    max_per_ip: int | None
    retry_after_s: int
    send_timeout_s: float = 60.0
    keep_alive_s: float = 75.0  # an idle kept-alive connection's life (uvicorn's timeout_keep_alive)


def raise_fd_limit() -> int:
    """Raise the open-file soft limit to the hard limit (a default of 1024 lets one client's 1024 stalled
    connections take every descriptor); the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_TARGET_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. macOS refuses above its kernel's own maximum
            log.warning("fd_limit.not_raised soft=%s hard=%s", soft, hard)
    return FD_TARGET_UNLIMITED if soft == resource.RLIM_INFINITY else soft


def edge_limits(settings: Settings) -> EdgeLimits:
    """The settings' connection limits, the cap lowered to what the open-file limit can hold next to the
    engine connection pool (``max_connections``)."""
    lim = settings.limits
    nofile = raise_fd_limit() if lim.raise_fd_limit else int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    room = nofile - settings.max_connections - FD_RESERVE
    cap = min(lim.max_client_connections, room)
    if cap < lim.max_client_connections:
        cap = max(cap, nofile // 4, 1)
        log.warning(
            "connections.cap_lowered configured=%s cap=%s open_file_limit=%s", lim.max_client_connections, cap, nofile
        )
    return EdgeLimits(
        lim.header_timeout_s, cap, lim.max_connections_per_ip, lim.retry_after_s, lim.send_timeout_s, lim.keep_alive_s
    )


def raw_error(status: int, reason: str, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, for answers given below the app."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The open connections of one server, in all and per peer address."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self.open = 0
        self.by_ip: dict[str, int] = {}

    def admit(self, ip: str | None) -> str | None:
        """None when the connection may stay; else why not (a metric label)."""
        if self.open >= self.limits.max_connections:
            return "connection_cap"
        per_ip = self.limits.max_per_ip
        if per_ip is not None and ip is not None and self.by_ip.get(ip, 0) >= per_ip:
            return "connection_cap_per_ip"
        self.open += 1
        if ip is not None:
            self.by_ip[ip] = self.by_ip.get(ip, 0) + 1
        return None

    def release(self, ip: str | None) -> None:
        self.open -= 1
        if ip is not None:
            left = self.by_ip[ip] - 1
            if left:
                self.by_ip[ip] = left
            else:
                del self.by_ip[ip]


class _Edge(asyncio.Protocol):
    """Mixed in before uvicorn's HTTP protocol class (``edge_protocol``); its names are prefixed ``_edge``."""

    guard: ClassVar[ConnectionGuard]
    # uvicorn's protocol classes set these
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    app_state: dict[str, Any]

    _edge_ip: str | None = None
    _edge_admitted: bool = False
    _edge_timer: asyncio.TimerHandle | None = None
    _edge_partial: bool = False  # bytes of a request whose headers are not complete have arrived
    _edge_write_timer: asyncio.TimerHandle | None = None  # the send buffer is full: the client is not reading

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else None
        refused = self.guard.admit(ip)
        if refused is not None:
            self._edge_count(refused)
            t = cast(asyncio.Transport, transport)
            t.write(
                raw_error(
                    503,
                    "Service Unavailable",
                    "The gateway holds as many connections as it takes; retry shortly.",
                    "server_overloaded",
                    self.guard.limits.retry_after_s,
                )
            )
            t.close()
            return
        self._edge_ip, self._edge_admitted = ip, True
        super().connection_made(transport)
        self._edge_arm()

    def data_received(self, data: bytes) -> None:
        if not self._edge_admitted:
            return
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete: uvicorn started its cycle
            self._edge_disarm()
        elif self.cycle is None or self.cycle.response_complete:  # part of the next request's headers
            self._edge_partial = True
            if self._edge_timer is None:
                self._edge_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._edge_admitted:
            return
        self._edge_admitted = False
        self._edge_disarm()
        self._edge_reading()
        self.guard.release(self._edge_ip)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._edge_admitted and self._edge_write_timer is None:
            self._edge_write_timer = self.loop.call_later(self.guard.limits.send_timeout_s, self._edge_not_reading)

    def resume_writing(self) -> None:
        self._edge_reading()
        super().resume_writing()

    def _edge_reading(self) -> None:
        if self._edge_write_timer is not None:
            self._edge_write_timer.cancel()
            self._edge_write_timer = None

    def _edge_not_reading(self) -> None:
        self._edge_write_timer = None
        self._edge_count("slow_reader")
        self.transport.abort()  # what is buffered goes nowhere anyway; uvicorn tells the app the client left

    def _edge_arm(self) -> None:
        self._edge_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._edge_expired)

    def _edge_disarm(self) -> None:
        if self._edge_timer is not None:
            self._edge_timer.cancel()
            self._edge_timer = None
        self._edge_partial = False

    def _edge_expired(self) -> None:
        self._edge_timer = None
        if self.transport.is_closing():
            return
        self._edge_count("header_timeout")
        if self._edge_partial:
            self.transport.write(
                raw_error(408, "Request Timeout", "The request headers did not arrive in time.", "request_timeout")
            )
        self.transport.close()

    def _edge_count(self, reason: str) -> None:
        svc = self.app_state.get("services")  # the app's lifespan state, once it has started
        if svc is not None:
            svc.metrics.rejections.labels(reason).inc()


def edge_protocol(limits: EdgeLimits, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``; default: httptools where installed, else h11) with the limits above,
    for ``uvicorn.Config(http=...)``. Each call has its own guard: one per server."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return cast(type[asyncio.Protocol], type("EdgeHTTPProtocol", (_Edge, base), {"guard": ConnectionGuard(limits)}))
