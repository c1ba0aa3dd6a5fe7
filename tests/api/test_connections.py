"""Connection limits below the app (gateway/connections.py): a real uvicorn server on a loopback port, in
process, with each of uvicorn's HTTP protocol classes; clients are raw sockets that stall, trickle or
flood, and an httpx client that must still be served. Deadlines are short here; the tests wait, bounded, for
the server to close a connection, never for a time to pass."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from turnkv import launch
from turnkv.config import Settings
from turnkv.gateway.connections import FD_RESERVE, EdgeLimits, edge_limits, edge_protocol, raise_fd_limit

CLOSE_WAIT_S = 10.0
POLL_S = 0.01
PARTIAL = b"POST / HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"  # no blank line: never complete
REQUEST = b"GET / HTTP/1.1\r\nHost: gateway\r\n\r\n"
BASES = pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])


CHUNK = b"x" * (1 << 20)
CHUNKS = 256  # far more than socket buffers hold


async def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


class Big:
    """A long streamed answer that says when it has ended."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            for _ in range(CHUNKS):
                yield CHUNK
        finally:
            self.ended.set()

    async def endpoint(self, request: Request) -> StreamingResponse:
        return StreamingResponse(self.chunks(), media_type="application/octet-stream")


class Server:
    def __init__(self, limits: EdgeLimits, base: type[asyncio.Protocol]) -> None:
        self.protocol: Any = edge_protocol(limits, base)
        self.big = Big()
        app = Starlette(
            routes=[
                Route("/", ok, methods=["GET", "POST"]),
                Route("/health", ok),
                Route("/big", self.big.endpoint),
            ]
        )
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(app, http=self.protocol, ws="none", lifespan="off", log_level="warning")
        )
        self.sock = launch.bind("127.0.0.1", 0)
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.clients: list[asyncio.StreamWriter] = []  # raw clients, closed when serving ends, failed or not

    async def connect(self, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
        self.clients.append(w)
        return r, w

    async def served(self) -> None:
        async with httpx.AsyncClient(timeout=CLOSE_WAIT_S) as c:
            r = await c.get(self.url)
            assert r.status_code == 200 and r.text == "ok"


@contextlib.asynccontextmanager
async def serving(base: type[asyncio.Protocol], **over: Any) -> AsyncIterator[Server]:
    limits = EdgeLimits(
        **{
            "header_timeout_s": 0.3,
            "max_connections": 1000,
            "max_per_ip": None,
            "retry_after_s": 2,
            "send_timeout_s": 0.3,
            **over,
        }
    )
    s = Server(limits, base)
    task = asyncio.create_task(s.uvicorn.serve(sockets=[s.sock]))
    await until(lambda: s.uvicorn.started, "the server to start")
    try:
        yield s
    finally:
        for w in s.clients:  # a test that failed midway leaves no socket for a later test's unraisable hook
            w.close()
        s.uvicorn.should_exit = True
        await asyncio.wait_for(task, CLOSE_WAIT_S)
        s.sock.close()


async def closed_with(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent before it closed the connection (bounded wait); nothing where the server's
    close reached the client as a reset. Linux reports a reset as ECONNRESET, or as EPIPE to a socket that had
    already seen the server's FIN: the trickler writes on after the FIN, the server's kernel answers with a
    reset, the trickler's next write fails with BrokenPipeError and asyncio hands that error to the reader."""
    try:
        return await asyncio.wait_for(reader.read(), CLOSE_WAIT_S)
    except (ConnectionResetError, BrokenPipeError):
        return b""


async def until(predicate: Callable[[], Any], what: str) -> None:
    """Wait for an effect with no event to wait on (bounded)."""
    for _ in range(int(CLOSE_WAIT_S / POLL_S)):
        if predicate():
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_released(server: Server) -> None:
    await until(lambda: server.protocol.guard.open == 0, "every connection to be let go")


@BASES
async def test_stalled_and_trickling_clients_are_closed_while_others_are_served(base: type[asyncio.Protocol]) -> None:
    async with serving(base) as s:
        stalled = [await s.connect() for _ in range(50)]  # not a byte sent
        partial = [await s.connect() for _ in range(20)]  # headers begun, never finished
        for _, w in partial:
            w.write(PARTIAL)
        trickler = await s.connect()

        async def trickle() -> None:
            # one header byte after another, far past the deadline were the timer reset by each byte
            _, w = trickler
            for _ in range(2000):
                try:
                    w.write(b"x")
                    await w.drain()
                except ConnectionError:
                    return
                if w.transport.is_closing():
                    return
                await asyncio.sleep(0.005)  # the attacker's pace

        trickling = asyncio.create_task(trickle())
        trickler[1].write(b"GET / HTTP/1.1\r\nX-Slow: ")
        await asyncio.gather(*(s.served() for _ in range(10)))  # normal clients, meanwhile
        for r, _ in stalled:
            assert await closed_with(r) == b""  # no request began: closed without a word
        for r, _ in partial:
            assert (await closed_with(r)).startswith(b"HTTP/1.1 408 ")
        # closed too; its 408 may be lost: closing on bytes still unread sends a reset, and a byte written after
        # the server's FIN draws one, and the reader then reports the reset (ECONNRESET or EPIPE), not the 408
        answer = await closed_with(trickler[0])
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
        await asyncio.wait_for(trickling, CLOSE_WAIT_S)  # it ended: the server closed on it
        for _, w in [*stalled, *partial, trickler]:
            w.close()
        await wait_released(s)
        await s.served()


@BASES
async def test_a_kept_alive_connection_has_the_same_deadline_for_its_next_request(base: type[asyncio.Protocol]) -> None:
    async with serving(base) as s:
        r, w = await s.connect()
        w.write(REQUEST)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await asyncio.wait_for(r.readexactly(2), CLOSE_WAIT_S) == b"ok"
        w.write(PARTIAL)  # the next request's headers, begun and left
        assert (await closed_with(r)).startswith(b"HTTP/1.1 408 ")
        w.close()


@BASES
async def test_connections_over_the_cap_are_answered_503_and_closed(base: type[asyncio.Protocol]) -> None:
    async with serving(base, max_connections=5, header_timeout_s=60) as s:
        held = [await s.connect() for _ in range(5)]
        r, w = await s.connect()
        refused = await closed_with(r)
        assert refused == b"" or refused.startswith(b"HTTP/1.1 503 ")  # a reset may beat the answer
        assert b'"code": "server_overloaded"' in refused or not refused
        w.close()
        for _, hw in held:
            hw.close()
        await wait_released(s)
        await s.served()  # room again


@BASES
async def test_one_address_over_its_cap_does_not_shut_out_others(base: type[asyncio.Protocol]) -> None:
    async with serving(base, max_per_ip=3, header_timeout_s=60) as s:
        held = [await s.connect("127.0.0.2") for _ in range(3)]
        refused = [await s.connect("127.0.0.2") for _ in range(20)]
        for r, _ in refused:
            answer = await closed_with(r)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 ")
        await s.served()  # from 127.0.0.1
        assert s.protocol.guard.held_by("127.0.0.2") == 3
        for _, w in [*held, *refused]:
            w.close()
        await wait_released(s)


@BASES
async def test_a_client_that_stops_reading_is_dropped(base: type[asyncio.Protocol]) -> None:
    async with serving(base, header_timeout_s=60) as s:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", s.port))
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"GET /big HTTP/1.1\r\nHost: gateway\r\n\r\n")  # and never read the answer
        await asyncio.wait_for(s.big.ended.wait(), CLOSE_WAIT_S)  # without the drop, it waits for us for ever
        await wait_released(s)
        assert len(await closed_with(r)) < CHUNKS * len(CHUNK)  # dropped, not buffered whole
        await s.served()
        w.close()


@BASES
async def test_headers_past_their_limits_are_refused_before_they_are_buffered(base: type[asyncio.Protocol]) -> None:
    async with serving(base, header_timeout_s=60, max_header_bytes=8192, max_header_count=20) as s:
        r, w = await s.connect()
        w.write(b"GET / HTTP/1.1\r\nHost: gateway\r\nX-Big: ")
        sent = 0
        for _ in range(64):  # 4 MiB of one header's value, never finished, unless the server closes first
            try:
                w.write(b"a" * 65536)
                await w.drain()
            except ConnectionError:
                break
            sent += 65536
            if w.transport.is_closing():
                break
        answer = await closed_with(r)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")  # a reset may beat the answer
        assert sent < 4 << 20  # the server closed well before the 4 MiB were taken
        r, w = await s.connect()
        w.write(b"GET / HTTP/1.1\r\nHost: gateway\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(40)) + b"\r\n")
        assert (await closed_with(r)).startswith(b"HTTP/1.1 431 ")
        await wait_released(s)
        # a head within the limits, sent in one write with a body far larger than them: served
        r, w = await s.connect()
        body = b"x" * (1 << 20)
        w.write(b"POST / HTTP/1.1\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), CLOSE_WAIT_S)
        assert head.startswith(b"HTTP/1.1 200 ")
        w.close()
        await s.served()


@BASES
async def test_health_is_answered_over_the_connection_cap(base: type[asyncio.Protocol]) -> None:
    async with serving(base, max_connections=5, header_timeout_s=60) as s:
        held = [await s.connect() for _ in range(5)]
        r, w = await s.connect()
        w.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = await closed_with(r)  # answered, then closed
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok"), answer
        r, w = await s.connect()
        w.write(b"GET / HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = await closed_with(r)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 503 ")
        r, w = await s.connect()  # says nothing: let go once its short wait is over
        assert await closed_with(r) == b""
        for _, hw in held:
            hw.close()
        await wait_released(s)
        assert s.protocol.guard.overflow == 0


@BASES
async def test_the_reserve_keeps_room_for_another_address(base: type[asyncio.Protocol]) -> None:
    # 64 connections, 16 of them kept for addresses holding fewer than 2: one address holds 48 at most
    async with serving(base, max_connections=64, reserve_share=0.25, header_timeout_s=60) as s:
        heavy = [await s.connect("127.0.0.2") for _ in range(70)]  # more than the cap
        assert s.protocol.guard.held_by("127.0.0.2") == 48
        await s.served()  # from 127.0.0.1, holding none
        for _, w in heavy:
            w.close()
        await wait_released(s)


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("a hard limit too low to lower the soft one under it")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised > 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


def test_the_connection_cap_fits_the_open_file_limit() -> None:
    s = Settings(
        prefill=["http://127.0.0.1:9"],
        decode=["http://127.0.0.1:9"],
        limits={"max_client_connections": 10**7, "raise_fd_limit": False},
    )
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = edge_limits(s).max_connections
    assert cap < 10**7 and (cap + s.max_connections + FD_RESERVE <= nofile or cap == max(nofile // 4, 1))
    small = Settings(
        prefill=["http://127.0.0.1:9"],
        decode=["http://127.0.0.1:9"],
        limits={"max_client_connections": 10, "raise_fd_limit": False},
    )
    assert edge_limits(small).max_connections == 10
