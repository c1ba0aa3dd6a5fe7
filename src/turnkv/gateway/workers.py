"""``turnkv serve --workers N``: N gateway processes on one port, and the supervisor that keeps them.

One Python event loop relays a few hundred streamed requests per second and, with hundreds of streams,
adds its queueing to every token; more cores need more processes. Each worker is a whole gateway
(``create_app``: its own aiohttp session, Redis pool, engine registry and background loops). They share
conversation records through Redis, which is why more than one worker needs ``redis_url``: a
conversation's next turn may reach any worker. Each worker listens on a socket of its own with
SO_REUSEPORT, so the kernel spreads connections over workers by address, rather than handing most of
them to whichever worker happened to wake first on a shared socket. Metrics from all workers are merged
through prometheus_client's multiprocess directory (see ``metrics.py``). The client-facing caps
(connections, requests arriving and in flight, per address and per tenant) are the whole gateway's: each
worker admits by what all workers hold, read from a table they share in that directory (``tally``), so a
worker the kernel hands more connections than others does not refuse while the gateway has room.

The supervisor first makes sure nothing listens on the port (with SO_REUSEPORT a second gateway could
otherwise join this one's group and take half its connections), and that no other supervisor is starting
on it (a lock until its workers listen), then holds the port (bound with SO_REUSEPORT and SO_REUSEADDR,
never listening) so that port 0 resolves once and every worker binds the same one. It prints the
listening URL once all workers listen, forwards SIGTERM/SIGINT, and restarts a worker that dies, up to
``MAX_RESTARTS`` within ``RESTART_WINDOW_S``; past that it stops them all and exits 1. Linux only:
elsewhere SO_REUSEPORT does not spread connections, or does not exist.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from types import FrameType
from typing import Any

from prometheus_client import multiprocess

from turnkv.config import Settings
from turnkv.gateway.tally import SharedCounts, Tally
from turnkv.launch import LISTEN_BACKLOG, READY_TIMEOUT_S, announce, bind

STOP_TIMEOUT_S = 10.0
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
METRICS_PREFIX = "turnkv-metrics-"
LIMITS_FILE = "edge-limits.tally"  # in the metrics directory, beside prometheus_client's *.db files
SUPERVISE_TICK_S = 1.0  # how long a wait for a worker's exit or a signal lasts before looking again


def _exit_with_supervisor(lifeline: Connection) -> None:
    """Stop this worker (as SIGTERM would) once the supervisor is gone, even if it was killed outright:
    its end of the lifeline closes with it."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class SharedLimits:
    """Where the workers count what clients hold (``tally.SharedCounts``): the caps are the whole gateway's,
    and each worker admits by what all of them actually hold."""

    path: str
    rows: int
    salt: bytes

    @classmethod
    def create(cls, directory: str, workers: int) -> SharedLimits:
        path = os.path.join(directory, LIMITS_FILE)
        return cls(path, workers, SharedCounts.create(path, workers))

    def tally(self, row: int) -> Tally:
        return Tally(SharedCounts(self.path, self.rows, row, self.salt))


def _worker(
    settings: Settings, ready: Any, lifeline: Connection, metrics_dir: str, limits: SharedLimits, row: int
) -> None:
    """One worker process: listen on the shared port, tell the supervisor, serve until SIGTERM. Its caps are
    the gateway's, counted with the other workers' in row ``row`` of the shared table."""
    from turnkv.gateway.app import create_app
    from turnkv.gateway.connections import edge_limits
    from turnkv.gateway.server import run
    from turnkv.logging import configure_stdlib

    threading.Thread(target=_exit_with_supervisor, args=(lifeline,), daemon=True).start()
    configure_stdlib(settings.log_level, json=settings.log_json)
    sock = bind(settings.host, settings.port, reuse_port=True)
    sock.listen(LISTEN_BACKLOG)
    ready.put(os.getpid())
    tally = limits.tally(row)
    app = create_app(settings, multiprocess_dir=metrics_dir, tally=tally)
    run(app, sock, edge=edge_limits(settings), tally=tally)


class Supervisor:
    def __init__(self, settings: Settings, metrics_dir: str) -> None:
        self.settings = settings
        self.metrics_dir = metrics_dir
        self.limits = SharedLimits.create(metrics_dir, settings.workers)
        self._ctx = multiprocessing.get_context("spawn")
        self._ready = self._ctx.Queue()
        # the supervisor keeps the sending end and never sends: the workers see EOF when it exits
        self._lifeline, self._keep = self._ctx.Pipe(duplex=False)
        self.workers: list[SpawnProcess] = []
        self._restarts: list[float] = []

    def start(self, index: int | None = None) -> None:
        row = len(self.workers) if index is None else index
        SharedCounts.clear_row(self.limits.path, self.limits.rows, row)  # what a worker there held died with it
        p = self._ctx.Process(
            target=_worker,
            args=(self.settings, self._ready, self._lifeline, self.metrics_dir, self.limits, row),
            name="turnkv-worker",
        )
        p.start()
        if index is None:
            self.workers.append(p)
        else:
            self.workers[index] = p

    def wait_ready(self, n: int, stopping: Callable[[], bool]) -> bool:
        """True once n workers listen; False if one exits first, a stop is asked for, or READY_TIMEOUT_S
        passes."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for _ in range(n):
            while True:
                if stopping() or any(p.exitcode is not None for p in self.workers):
                    return False
                if time.monotonic() > deadline:
                    return False
                try:
                    self._ready.get(timeout=0.2)
                    break
                except queue.Empty:
                    continue
        return True

    def replace_exited(self) -> bool:
        """Restart workers that exited; False once they die too often to keep going."""
        now = time.monotonic()
        for i, p in enumerate(self.workers):
            if p.exitcode is None:
                continue
            print(f"turnkv: worker {p.pid} exited with {p.exitcode}; starting another", file=sys.stderr, flush=True)
            if p.pid is not None:
                multiprocess.mark_process_dead(p.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self._restarts) > MAX_RESTARTS:
                return False
            self.start(i)
        return True

    def stop(self) -> None:
        for p in self.workers:
            if p.exitcode is None:
                p.terminate()  # SIGTERM: uvicorn finishes open requests (timeout_graceful_shutdown)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.workers:
            p.join(max(deadline - time.monotonic(), 0))
            if p.exitcode is None:
                p.kill()
                p.join(STOP_TIMEOUT_S)
        self._ready.close()
        self._keep.close()
        self._lifeline.close()


def _starting_lock(port: int) -> socket.socket | None:
    """Held from the port check until the workers listen. In that window the holder does not listen, so
    a second supervisor's check would pass and its workers could join ours: it is refused here instead.
    An abstract Unix socket: scoped to the network namespace, as the port is, and gone with the process
    however it ends. None for port 0 (a port of our own)."""
    if not port:
        return None
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0turnkv-workers-starting-{port}")
    except OSError:
        lock.close()
        raise OSError(errno.EADDRINUSE, "another turnkv gateway is starting on this port") from None
    return lock


def _hold_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket on the port; OSError when something already listens there.

    SO_REUSEPORT lets the workers join it. SO_REUSEADDR lets it bind past the connections a previous
    gateway left on the port in TIME_WAIT: without it the kernel refuses the port for about a minute
    after a gateway whose sockets lacked SO_REUSEPORT (a single-process one). It also lets a plain
    SO_REUSEADDR server bind the port while the holder does not listen; if that one listens first, the
    workers cannot bind and the supervisor stops ("a worker did not start") rather than share."""
    if port:
        bind(host, port).close()  # SO_REUSEADDR alone: refused while anything listens on the port
    return bind(host, port, reuse_port=True)


def _remove_stale_metrics() -> None:
    """Metric directories of supervisors that were killed outright (nothing else removes them)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{METRICS_PREFIX}*-")):
        pid = path.rsplit("-", 2)[-2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)


def serve_workers(settings: Settings) -> int:
    """Run ``settings.workers`` gateway processes until SIGTERM or SIGINT; the exit status."""
    if not sys.platform.startswith("linux"):
        print(
            "turnkv serve: --workers needs Linux (SO_REUSEPORT); run replicas behind a load balancer instead",
            file=sys.stderr,
        )
        return 2
    lock: socket.socket | None = None
    try:
        lock = _starting_lock(settings.port)
        holder = _hold_port(settings.host, settings.port)
    except OSError as exc:
        if lock is not None:
            lock.close()
        print(f"turnkv serve: cannot take {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    settings = settings.model_copy(update={"port": holder.getsockname()[1]})
    _remove_stale_metrics()
    metrics_dir = tempfile.mkdtemp(prefix=METRICS_PREFIX, suffix=f"-{os.getpid()}-")
    # read by prometheus_client when a worker imports it (the workers are spawned, not forked): it
    # makes their metrics write to files there
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    wake_r, wake_w = os.pipe()
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        os.write(wake_w, b"x")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    sup = Supervisor(settings, metrics_dir)
    status = 0
    try:
        for _ in range(settings.workers):
            sup.start()
        ready = sup.wait_ready(settings.workers, lambda: stopping)
        if lock is not None:
            lock.close()  # the workers listen (or failed): the port check refuses a second gateway now
        if not ready:
            if stopping:
                return 0
            print("turnkv serve: a worker did not start", file=sys.stderr, flush=True)
            return 1
        announce(holder)
        while not stopping:
            multiprocessing.connection.wait([*(p.sentinel for p in sup.workers), wake_r], SUPERVISE_TICK_S)
            if not stopping and not sup.replace_exited():
                print("turnkv serve: workers keep exiting; stopping", file=sys.stderr, flush=True)
                status = 1
                break
    finally:
        sup.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)
        holder.close()
        if lock is not None:
            lock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status
