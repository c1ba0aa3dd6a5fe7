"""A private redis-server on loopback, for benchmarks, scripts and tests: the one way this project
starts one.

It decides how such a server runs: no persistence, bound to 127.0.0.1, its log in a file in its own
directory (never a pipe nobody reads, which fills and stops the server), a bounded wait until it
answers (or its log says it listens, where a plain client cannot talk to it: TLS only), and stop and
start again on the same port, so that clients reconnect to the same URL after a restart.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.02


class RedisNotInstalled(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plain_args(port: int, workdir: Path) -> list[str]:
    """A plain server's arguments: loopback only, nothing written to disk but its log."""
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]


class RedisServer:
    """One redis-server (or Sentinel, with ``args``) process; ``start`` and ``stop`` as often as needed."""

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        port: int | None = None,
        args: Sequence[str] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisNotInstalled("redis-server is not installed (scripts/test installs it)")
        self.exe = exe
        self.port = port if port is not None else free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="turnkv-redis-") if workdir is None else None
        self.workdir = Path(self._tmp.name) if self._tmp is not None else workdir
        assert self.workdir is not None
        self.args = list(args) if args is not None else plain_args(self.port, self.workdir)
        self.log = self.workdir / f"redis-{self.port}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([self.exe, *self.args], stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self._log_tail()}")
            if self._ready():
                return self
            time.sleep(_POLL_S)  # polling an observable effect, bounded by the deadline
        waited = f"redis-server on port {self.port} not ready in {self.ready_timeout_s} s: "
        raise RuntimeError(waited + self._log_tail())

    def _ready(self) -> bool:
        if "--tls-port" in self.args:  # a plain client cannot talk to it; the log says when it listens
            return "Ready to accept connections" in self.log.read_text(errors="replace")
        with contextlib.suppress(redis.RedisError, OSError):
            c = self.client(socket_timeout=1)
            try:
                return bool(c.ping())
            finally:
                c.close()
        return False

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client of this server (``socket_timeout`` 5 s unless given)."""
        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def stop(self) -> None:
        """Terminate it (killed if it does not exit in time); it can be started again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None

    def close(self) -> None:
        """Stop it and remove its directory when it made one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cpu_s(self) -> float:
        """CPU seconds the server has used (``INFO cpu``)."""
        c = self.client()
        try:
            info = c.info("cpu")
        finally:
            c.close()
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def commandstats(self) -> dict[str, int]:
        """Calls per command, from ``INFO commandstats``."""
        c = self.client()
        try:
            info = c.info("commandstats")
        finally:
            c.close()
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}
