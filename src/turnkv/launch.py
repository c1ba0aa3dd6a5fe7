"""Starting turnkv processes (engines, gateways) on loopback ports, for the demo, the benchmark and tests.

A child binds its port itself (``--port 0`` picks a free one) and prints one line to stdout,
``{"listening": URL}``, before it serves; connections made after that line wait in the listen
backlog until the app's startup is done. So no polling and no port races.
"""

from __future__ import annotations

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
from typing import IO, Any

import uvicorn

READY_TIMEOUT_S = 60.0
GRACE_S = 5.0  # once a shutdown began (for the gateway: after its drain), for the connections to settle
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


def listening(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (0: a free port), its URL announced on stdout (``announce``)."""
    sock = bind(host, port)
    sock.listen(LISTEN_BACKLOG)
    announce(sock)
    return sock


def uvicorn_config(app: Any, log_level: str, *, graceful_s: float = GRACE_S, **extra: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: no access log, the lifespan on, ``graceful_s`` for the
    connections to finish once a shutdown begins; uvicorn's own logging unless the process configured its
    own (``turnkv.logging.configure_stdlib``)."""
    if logging.getLogger().handlers:
        extra["log_config"] = None
    graceful = int(graceful_s + 1)
    return uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=graceful, lifespan="on", **extra
    )


def serve(app: Any, host: str, port: int, log_level: str = "warning") -> None:
    """Bind, announce the URL on stdout, then serve ``app`` with uvicorn until stopped (the simulated engines,
    the benchmark's relays; the gateway is served by ``gateway.server``)."""
    sock = listening(host, port)
    uvicorn.Server(uvicorn_config(app, log_level)).run(sockets=[sock])


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
        proc.stdout.close()  # else its pipe is left to the garbage collector, which warns in whatever runs then
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
