"""Starting turnkv processes (engines, gateways) on loopback ports, for the demo, the benchmark and tests.

A child binds its port itself (``--port 0`` picks a free one) and prints one line to stdout,
``{"listening": URL}``, before it serves; connections made after that line wait in the listen
backlog until the app's startup is done. So no polling and no port races.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import uvicorn

from turnkv.gateway.lifecycle import Drain

if TYPE_CHECKING:
    from turnkv.gateway.connections import EdgeLimits
    from turnkv.gateway.tally import Tally

READY_TIMEOUT_S = 60.0
GRACE_S = 5.0  # after the drain: for the aborted turns to send their error events and settle
LISTEN_BACKLOG = 2048


def bind(host: str, port: int, *, reuse_port: bool = False, reuse_addr: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if reuse_addr:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def announce(sock: socket.socket) -> None:
    """The one line a parent (``spawn``) waits for: the URL, printed once connections can queue."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    print(json.dumps({"listening": f"http://{shown}:{port}"}), flush=True)


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the app's ``Drain`` (``gateway.lifecycle``) when a shutdown begins: the app says
    it is not ready at once, and the server stops listening only ``delay_s`` later."""

    def __init__(self, config: uvicorn.Config, drain: Drain, delay_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._delay_s = delay_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._drain.bind(self._loop)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining or self._delay_s <= 0 or self._loop is None:
            self._drain.begin(0.0)
            super().handle_exit(sig, frame)
            return
        self._drain.begin(self._delay_s)
        self._loop.call_soon_threadsafe(self._loop.call_later, self._delay_s, super().handle_exit, sig, frame)


def run_uvicorn(
    app: Any,
    sock: socket.socket,
    log_level: str = "warning",
    *,
    edge: EdgeLimits | None = None,
    tally: Tally | None = None,
) -> None:
    """Serve ``app`` on a listening socket until SIGTERM or SIGINT. With ``edge`` (the gateway), a client's
    headers have a deadline and connections a cap (gateway/connections.py); websockets are off. An app with
    a ``Drain`` in its state (the gateway) gets its drain time before the server gives up on its connections."""
    extra: dict[str, Any] = {}
    if edge is not None:
        from turnkv.gateway.connections import edge_protocol

        extra = {"http": edge_protocol(edge, tally=tally), "ws": "none", "timeout_keep_alive": edge.keep_alive_s}
    drain: Drain | None = getattr(getattr(app, "state", None), "drain", None)
    delay_s = float(getattr(app.state, "shutdown_delay_s", 0.0)) if drain is not None else 0.0
    graceful = delay_s + drain.drain_s + GRACE_S if drain is not None else GRACE_S
    if logging.getLogger().handlers:  # the process configured its logging (configure_stdlib): uvicorn's too
        extra["log_config"] = None
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=int(graceful + 1), lifespan="on", **extra
    )
    server = _DrainingServer(config, drain, delay_s) if drain is not None else uvicorn.Server(config)
    server.run(sockets=[sock])


def serve(
    app: Any,
    host: str,
    port: int,
    log_level: str = "warning",
    *,
    edge: EdgeLimits | None = None,
    tally: Tally | None = None,
) -> None:
    """Bind, announce the URL on stdout, then serve ``app`` with uvicorn until stopped."""
    sock = bind(host, port)
    sock.listen(LISTEN_BACKLOG)
    announce(sock)
    run_uvicorn(app, sock, log_level, edge=edge, tally=tally)


@dataclass
class Running:
    name: str
    proc: subprocess.Popen[str]
    url: str
    log: Path | None

    def stop(self, timeout_s: float = 10.0) -> int:
        """Graceful stop; the exit status is -SIGTERM after a clean shutdown (uvicorn re-raises it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """As a crash: no shutdown at all."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _first_line(stream: IO[str], proc: subprocess.Popen[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], min(0.5, max(deadline - time.monotonic(), 0)))
        if ready:
            return stream.readline()
        if proc.poll() is not None:
            break
    return ""


def spawn(
    name: str,
    args: Sequence[str],
    *,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    module: str = "turnkv",
) -> Running:
    """Run ``python -m MODULE ARGS --port 0`` and return once it announced its URL."""
    log = (log_dir / f"{name}.log") if log_dir else None
    err: Any = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it open
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    if log:
        err.close()
    assert proc.stdout is not None
    line = _first_line(proc.stdout, proc, timeout_s)
    try:
        url = json.loads(line)["listening"]
    except (ValueError, KeyError, TypeError):
        proc.kill()
        proc.wait(10)
        tail = log.read_text()[-2000:] if log and log.exists() else ""
        raise RuntimeError(f"{name} did not start (exit {proc.returncode}): {line!r}\n{tail}") from None
    return Running(name, proc, url, log)


def sim(name: str, role: str, *extra: str, log_dir: Path | None = None) -> Running:
    return spawn(name, ["sim", "--role", role, *extra], log_dir=log_dir)


def gateway(
    name: str,
    prefill: Sequence[str],
    decode: Sequence[str],
    *extra: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Running:
    return spawn(name, ["serve", "--prefill", *prefill, "--decode", *decode, *extra], log_dir=log_dir, env=env)


@contextlib.contextmanager
def running(*procs: Running) -> Iterator[tuple[Running, ...]]:
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()
