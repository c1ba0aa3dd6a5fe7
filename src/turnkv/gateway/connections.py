"""Connection limits for the gateway's uvicorn server: how long a client may take to send a request's headers
and how much it may send there, how many connections may be open (in all and from one address), and the
open-file limit that holds them.

uvicorn has no header timeout, and with httptools no limit on a request's headers: a client that sends its
headers a byte at a time keeps its connection, and a file descriptor, as long as it likes, and one that
sends megabytes of unfinished headers has them buffered. ``edge_protocol`` subclasses uvicorn's HTTP protocol
(httptools, else h11) with a timer that runs from a connection's start, and from the first byte of a
kept-alive connection's next request, until that request's headers are complete (uvicorn has started its
request cycle). When it fires the connection is closed, after a 408 where part of a request had arrived. The
bytes and lines of a request's head are counted as they come; past ``max_header_bytes`` or
``max_header_count`` the connection is answered 431 and closed before uvicorn sees the rest. (An idle
kept-alive connection is uvicorn's own keep-alive timeout's, set from ``limits.keep_alive_s``.) A client that
stops reading its answer is dropped once the send buffer has stayed full for ``send_timeout_s`` (the app then
sees a disconnect, and a streamed turn ends as for any client that left).

Connections are a ``tally.Gate``: the gateway's cap (all workers together), an address's own cap where set,
and the reserve that an address holding many connections does not get. A connection over a cap is answered
503 and closed as soon as it is accepted, before it costs more than its descriptor for a moment; except that
up to ``HEALTH_OVERFLOW`` of them at once (``HEALTH_OVERFLOW_PER_IP`` from one address) get ``HEALTH_WAIT_S``
to send a request line, and a GET of
``/health`` or ``/ready`` is then served (and the connection closed): a load balancer's probe is answered
however many connections clients hold. The body's deadline is the edge's (``edge.Edge``), which can answer it
in OpenAI's shape. uvicorn's ``limit_concurrency`` is not used: it answers in plain text, and only once a
request's headers have arrived.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from turnkv.gateway.tally import Caps, Gate, Tally

if TYPE_CHECKING:
    from turnkv.config import Settings

log = logging.getLogger("turnkv.connections")
FD_RESERVE = 256  # descriptors kept for Redis, logs, the metrics directory and the listening socket
FD_TARGET_UNLIMITED = 1 << 20  # where the hard limit is "unlimited"
HEALTH_OVERFLOW = 64  # connections over the caps at once that may still ask for /health or /ready
HEALTH_OVERFLOW_PER_IP = 4  # of them from one address: one that keeps connecting cannot take them all
HEALTH_WAIT_S = 1.0  # how long such a connection has to send its request line
_HEALTH_LINE = re.compile(rb"(GET|HEAD) /(health|ready)(\?[^ ]*)? HTTP/1\.[01]\r?\n")
_REQUEST_LINE_MAX = 1024


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout_s: float
    max_connections: int  # in this process (its open-file limit)
    max_per_ip: int | None
    retry_after_s: int
    send_timeout_s: float = 60.0
    keep_alive_s: float = 75.0  # an idle kept-alive connection's life (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 128
    reserve_share: float = 0.0
    total_connections: int | None = None  # the whole gateway's, all workers together (None: max_connections)

    @property
    def caps(self) -> Caps:
        total = self.total_connections or self.max_connections
        return Caps.of(total, self.reserve_share, ip=self.max_per_ip)


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
    """The settings' connection limits, this process's cap lowered to what the open-file limit can hold next
    to the engine connection pool (``max_connections``)."""
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
        lim.header_timeout_s,
        cap,
        lim.max_connections_per_ip,
        lim.retry_after_s,
        lim.send_timeout_s,
        lim.keep_alive_s,
        lim.max_header_bytes,
        lim.max_header_count,
        lim.reserve_share,
        lim.max_client_connections if settings.workers > 1 else cap,
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
    """The open connections of one server (a ``Gate``, counted in ``tally``), and those over the caps that may
    still ask for /health or /ready."""

    def __init__(self, limits: EdgeLimits, tally: Tally | None = None) -> None:
        self.limits = limits
        self.gate = Gate("connection", limits.caps, tally or Tally())
        self.overflow = 0
        self.overflow_by_ip: dict[str | None, int] = {}

    @property
    def open(self) -> int:
        """Connections this process holds, health overflow included."""
        return self.gate.held + self.overflow

    def held_by(self, ip: str) -> int:
        return self.gate.tally.held(f"connection:ip:{ip}")

    def admit(self, ip: str | None) -> str | None:
        """None when the connection may stay; else why not (a metric label)."""
        keys = {"ip": ip}
        if self.gate.held >= self.limits.max_connections:
            return "connection_cap"
        refusal = self.gate.refusal(keys)
        if refusal is not None:
            return refusal.reason
        self.gate.take(keys)
        return None

    def release(self, ip: str | None) -> None:
        self.gate.give({"ip": ip})

    def overflow_admit(self, ip: str | None) -> bool:
        """Whether a connection over the caps may still ask for /health or /ready."""
        held = self.overflow_by_ip.get(ip, 0)
        if self.overflow >= HEALTH_OVERFLOW or held >= HEALTH_OVERFLOW_PER_IP:
            return False
        self.overflow += 1
        self.overflow_by_ip[ip] = held + 1
        return True

    def overflow_release(self, ip: str | None) -> None:
        self.overflow -= 1
        left = self.overflow_by_ip[ip] - 1
        if left:
            self.overflow_by_ip[ip] = left
        else:
            del self.overflow_by_ip[ip]


def _head_end(buf: bytes) -> int:
    """Where the request head in ``buf`` ends (past its blank line), or -1 when it does not end there."""
    ends = [i + n for i, n in ((buf.find(b"\r\n\r\n"), 4), (buf.find(b"\n\n"), 2)) if i >= 0]
    return min(ends) if ends else -1


class _Edge(asyncio.Protocol):
    """Mixed in before uvicorn's HTTP protocol class (``edge_protocol``); its names are prefixed ``_edge``."""

    guard: ClassVar[ConnectionGuard]
    # uvicorn's protocol classes set these
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    app_state: dict[str, Any]

    _edge_ip: str | None = None
    _edge_admitted: bool = False  # holds its place (until it closes)
    _edge_made: bool = False  # uvicorn's protocol has the connection
    _edge_overflow: bool = False  # over the caps: may only ask for /health or /ready, then goes
    _edge_first: bytes = b""  # an overflow connection's first bytes, until its request line is whole
    _edge_timer: asyncio.TimerHandle | None = None
    _edge_partial: bool = False  # bytes of a request whose headers are not complete have arrived
    _edge_head_bytes: int = 0  # of the request head arriving now
    _edge_head_lines: int = 0
    _edge_tail: bytes = b""  # the last bytes of it, where a blank line may have begun
    _edge_write_timer: asyncio.TimerHandle | None = None  # the send buffer is full: the client is not reading

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else None
        refused = self.guard.admit(ip)
        if refused is not None:
            self._edge_count(refused)
            if not self.guard.overflow_admit(ip):
                self._edge_refuse(cast(asyncio.Transport, transport))
                return
            self._edge_overflow = True
        self._edge_ip, self._edge_admitted, self._edge_made = ip, True, True
        super().connection_made(transport)
        self._edge_arm(HEALTH_WAIT_S if self._edge_overflow else None)

    def _edge_refuse(self, transport: asyncio.Transport) -> None:
        transport.write(
            raw_error(
                503,
                "Service Unavailable",
                "The gateway holds as many connections as it takes; retry shortly.",
                "server_overloaded",
                self.guard.limits.retry_after_s,
            )
        )
        transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._edge_admitted:
            return
        if self._edge_overflow:
            data = self._edge_health(data)
            if not data:
                return
        if (self.cycle is None or not self.cycle.more_body) and not self._edge_head_fits(data):
            self._edge_count("header_too_large")
            self.transport.write(
                raw_error(
                    431,
                    "Request Header Fields Too Large",
                    f"The request's headers exceed {self.guard.limits.max_header_bytes} bytes or "
                    f"{self.guard.limits.max_header_count} lines.",
                    "request_header_fields_too_large",
                )
            )
            self.transport.close()
            self._edge_admitted_off()
            return
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete: uvicorn started its cycle
            self._edge_disarm()
            if self._edge_overflow:
                self.cycle.keep_alive = False  # /health or /ready, answered, then the connection goes
        elif self.cycle is None or self.cycle.response_complete:  # part of the next request's headers
            self._edge_partial = True
            if self._edge_timer is None:
                self._edge_arm()

    def _edge_health(self, data: bytes) -> bytes:
        """An overflow connection's bytes once its request line asks for /health or /ready (all of them so
        far); nothing while the line is incomplete; a 503 and the end otherwise."""
        if self.cycle is not None:  # its one request is being served: nothing more is read
            return b""
        first = self._edge_first + data
        line_end = first.find(b"\n")
        if line_end < 0 and len(first) < _REQUEST_LINE_MAX:
            self._edge_first = first
            return b""
        if line_end >= 0 and _HEALTH_LINE.match(first, 0, line_end + 1):
            self._edge_first = b""
            return first
        self._edge_refuse(self.transport)
        self._edge_admitted_off()
        return b""

    def _edge_head_fits(self, data: bytes) -> bool:
        """Count what ``data`` adds to the request head arriving now (up to the head's end); False once it is
        past the limits."""
        lim = self.guard.limits
        tail = self._edge_tail
        end = _head_end(tail + data)
        part = data if end < 0 else data[: max(end - len(tail), 0)]
        self._edge_head_bytes += len(part)
        self._edge_head_lines += part.count(b"\n")
        # the request line and the blank line are lines too
        fits = self._edge_head_bytes <= lim.max_header_bytes and self._edge_head_lines <= lim.max_header_count + 2
        if end >= 0:
            self._edge_head_bytes = self._edge_head_lines = 0
            self._edge_tail = b""
        else:
            self._edge_tail = (tail + data)[-3:]
        return fits

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._edge_made:
            return  # refused at once: uvicorn never saw it
        self._edge_admitted_off()
        super().connection_lost(exc)

    def _edge_admitted_off(self) -> None:
        """Give the connection's place back (once): it is closing."""
        if not self._edge_admitted:
            return
        self._edge_admitted = False
        self._edge_disarm()
        self._edge_reading()
        if self._edge_overflow:
            self.guard.overflow_release(self._edge_ip)
        else:
            self.guard.release(self._edge_ip)

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

    def _edge_arm(self, after_s: float | None = None) -> None:
        wait = self.guard.limits.header_timeout_s if after_s is None else after_s
        self._edge_timer = self.loop.call_later(wait, self._edge_expired)

    def _edge_disarm(self) -> None:
        if self._edge_timer is not None:
            self._edge_timer.cancel()
            self._edge_timer = None
        self._edge_partial = False

    def _edge_expired(self) -> None:
        self._edge_timer = None
        if self.transport.is_closing():
            return
        if not self._edge_overflow:  # (an overflow connection was counted when it was refused its place)
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


def edge_protocol(
    limits: EdgeLimits, base: type[asyncio.Protocol] | None = None, tally: Tally | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``; default: httptools where installed, else h11) with the limits above,
    for ``uvicorn.Config(http=...)``. Each call has its own guard: one per server, counting in ``tally``
    (shared with the app's edge and, with ``--workers``, with the other workers)."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    guard = ConnectionGuard(limits, tally)
    return cast(type[asyncio.Protocol], type("EdgeHTTPProtocol", (_Edge, base), {"guard": guard}))
