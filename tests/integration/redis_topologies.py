"""Real Redis deployments on loopback for the store's tests: a 3-master Cluster, a Sentinel-managed
master with a replica, a TLS server (certificates made with ``openssl``), and a relay that holds
commands until the test lets them through. Every wait is bounded; a fixture is skipped only when a
binary it needs is missing."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from turnkv.bench.redis_server import RedisNotInstalled, RedisServer, free_port, plain_args
from turnkv.bench.relay import LoopbackRelay

READY_TIMEOUT_S = 30.0
POLL_S = 0.05  # between two looks at a server's state while waiting for it (bounded by the timeouts)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        time.sleep(POLL_S)
    raise TimeoutError(f"not within {timeout_s} s: {what}")


def _server(args: list[str], workdir: Path, port: int) -> RedisServer:
    """One redis-server (or Sentinel) process, started with ``args`` (skipped where none is installed)."""
    try:
        return RedisServer(workdir, port=port, args=args, ready_timeout_s=READY_TIMEOUT_S)
    except RedisNotInstalled:
        pytest.skip("redis-server is not installed")


@contextlib.contextmanager
def running(servers: list[RedisServer]) -> Iterator[list[RedisServer]]:
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


@dataclass
class ClusterSetup:
    """A Redis Cluster on loopback: its masters (each with ``replicas`` replicas) and its URL."""

    servers: list[RedisServer]
    node_timeout_ms: int

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc is not None]

    def slots(self) -> dict[int, tuple[int, int]]:
        """Each master's port with the first and last slot of its range(s), as a live node sees them."""
        c = self.live()[0].client()
        try:
            raw = cast(Any, c).execute_command("CLUSTER", "SLOTS")
        finally:
            c.close()
        return {int(r[2][1]): (int(r[0]), int(r[1])) for r in raw}

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        c = self.live()[0].client()
        try:
            slot = int(cast(Any, c).execute_command("CLUSTER", "KEYSLOT", key))
        finally:
            c.close()
        return next(port for port, (lo, hi) in self.slots().items() if lo <= slot <= hi)

    def masters(self) -> list[RedisServer]:
        ports = set(self.slots())
        return [s for s in self.live() if s.port in ports]

    def kill(self, server: RedisServer) -> None:
        """SIGKILL ``server``: a crash, nothing said to its replicas or clients."""
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(READY_TIMEOUT_S)
        server.proc = None

    def wait_failed_over(self, port: int, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Until a replica of the master that was on ``port`` serves its slots and every live node
        says the cluster is ok; the new master's port."""
        lo, _ = next(r for p, r in self.slots().items() if p == port)

        def moved() -> bool:
            return all(_cluster_ok(s) for s in self.live()) and _owner(self.live()[0], lo) != port

        wait_until(moved, f"a replica serving the slots of {port}", timeout_s)
        return _owner(self.live()[0], lo)


def _cluster_ok(server: RedisServer) -> bool:
    c = server.client()
    try:
        return bool(c.cluster("INFO").get("cluster_state") == "ok")
    finally:
        c.close()


def _owner(server: RedisServer, slot: int) -> int:
    c = server.client()
    try:
        raw = cast(Any, c).execute_command("CLUSTER", "SLOTS")
    finally:
        c.close()
    return next(int(r[2][1]) for r in raw if int(r[0]) <= slot <= int(r[1]))


@contextlib.contextmanager
def redis_cluster_setup(
    workdir: Path,
    masters: int = 3,
    *,
    replicas: int = 0,
    node_timeout_ms: int = 5000,
    full_coverage: bool = True,
) -> Iterator[ClusterSetup]:
    """``masters`` cluster-enabled servers, each with ``replicas`` replicas, joined into one Cluster.
    ``full_coverage`` is Redis's ``cluster-require-full-coverage`` (its default, yes: every node refuses
    every query while some slot has no master that answers)."""
    cli = _binary("redis-cli")
    ports = [free_port() for _ in range(masters * (1 + replicas))]
    # the bus port is named: the default (port + 10000) may be taken or past 65535
    servers = [
        _server(
            [
                *plain_args(p, workdir),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{p}.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-port",
                str(free_port()),
                "--cluster-require-full-coverage",
                "yes" if full_coverage else "no",
                # a replica takes over however long its link was down (the default refuses after
                # 10 node timeouts without one: a loaded test machine must not decide the test)
                "--cluster-replica-validity-factor",
                "0",
            ],
            workdir,
            p,
        )
        for p in ports
    ]
    setup = ClusterSetup(servers, node_timeout_ms)
    with running(servers):
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=READY_TIMEOUT_S,
        )
        for s in servers:
            wait_until(lambda s=s: _cluster_ok(s), f"cluster_state:ok on {s.port}")  # type: ignore[misc]
        wait_until(lambda: len(setup.slots()) == masters, f"{masters} masters serving slots")
        for s in servers:
            if s.port not in setup.slots():
                c = s.client()
                wait_until(
                    lambda c=c: c.info("replication").get("master_link_status") == "up",  # type: ignore[misc]
                    f"replica {s.port} in sync",
                )
                c.close()
        yield setup


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[str]:
    """``masters`` cluster-enabled servers joined into one Cluster; yields its redis+cluster:// URL."""
    with redis_cluster_setup(workdir, masters) as setup:
        yield setup.url


@dataclass
class SentinelSetup:
    master: RedisServer
    replica: RedisServer
    sentinel: RedisServer
    service: str = "turnkv-test"

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.service}/0"

    def master_port(self) -> int:
        c = self.sentinel.client()
        try:
            addr = c.sentinel_get_master_addr_by_name(self.service)
        finally:
            c.close()
        assert isinstance(addr, tuple), f"Sentinel does not know {self.service}"
        return int(addr[1])

    def fail_over(self) -> None:
        """Promote the replica, and wait until the old master serves as its replica."""
        old, new = self.master, self.replica
        c = self.sentinel.client()
        try:
            c.sentinel_failover(self.service)
        finally:
            c.close()
        wait_until(lambda: self.master_port() == new.port, "Sentinel names the replica as master")
        wait_until(lambda: _role(new) == "master" and _role(old) == "slave", "old master demoted")
        self.master, self.replica = new, old

    def kill_master(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """SIGKILL the master (a crash, nothing said to anyone), and wait until Sentinel names the replica
        and the replica serves as master."""
        old, new = self.master, self.replica
        assert old.proc is not None
        old.proc.kill()
        old.proc.wait(READY_TIMEOUT_S)
        old.proc = None
        wait_until(lambda: self.master_port() == new.port, "Sentinel names the replica as master", timeout_s)
        wait_until(lambda: _role(new) == "master", "the replica serving as master", timeout_s)
        self.master, self.replica = new, old


def _role(server: RedisServer) -> str:
    c = server.client()
    try:
        return str(c.role()[0].decode())
    finally:
        c.close()


@contextlib.contextmanager
def redis_sentinel(workdir: Path, *, down_after_ms: int = 5000) -> Iterator[SentinelSetup]:
    """A master, a replica and one Sentinel (quorum 1) watching them; Sentinel counts the master down
    after ``down_after_ms`` without an answer."""
    mp, rp, sp = free_port(), free_port(), free_port()
    master = _server(plain_args(mp, workdir), workdir, mp)
    replica = _server([*plain_args(rp, workdir), "--replicaof", "127.0.0.1", str(mp)], workdir, rp)
    conf = workdir / f"sentinel-{sp}.conf"  # Sentinel rewrites its own file
    conf.write_text(
        f"port {sp}\nbind 127.0.0.1\ndir {workdir}\n"
        f"sentinel monitor turnkv-test 127.0.0.1 {mp} 1\n"
        f"sentinel down-after-milliseconds turnkv-test {down_after_ms}\n"
        "sentinel failover-timeout turnkv-test 10000\n"
    )
    sentinel = _server([str(conf), "--sentinel"], workdir, sp)
    setup = SentinelSetup(master, replica, sentinel)
    with running([master, replica, sentinel]):
        rc = replica.client()
        wait_until(lambda: rc.info("replication").get("master_link_status") == "up", "replica in sync")
        rc.close()
        sc = sentinel.client()
        wait_until(lambda: setup.master_port() == mp, "Sentinel knows the master", timeout_s=2 * READY_TIMEOUT_S)
        wait_until(lambda: len(sc.sentinel_slaves("turnkv-test")) == 1, "Sentinel knows the replica")
        sc.close()
        yield setup


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(workdir: Path) -> Certificates:
    """A throw-away CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    openssl = _binary("openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=workdir, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=turnkv test CA")
    (workdir / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        run("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=turnkv {name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            *ext,
        )
    return Certificates(
        workdir / "ca.crt",
        workdir / "server.crt",
        workdir / "server.key",
        workdir / "client.crt",
        workdir / "client.key",
    )


def redis_has_tls() -> bool:
    """Whether this redis-server was built with TLS: such a build gets as far as loading the (here
    missing) certificates; one without refuses the option itself."""
    exe = shutil.which("redis-server")
    if exe is None:
        return False
    out = subprocess.run(
        [exe, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent", "--tls-key-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return "Failed to configure TLS" in out.stdout + out.stderr


@contextlib.contextmanager
def redis_tls(workdir: Path) -> Iterator[tuple[int, Certificates]]:
    """A redis-server that speaks TLS only and wants a client certificate signed by the test CA."""
    certs = make_certificates(workdir)
    port = free_port()
    server = _server(
        [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--tls-cert-file",
            str(certs.server_cert),
            "--tls-key-file",
            str(certs.server_key),
            "--tls-ca-cert-file",
            str(certs.ca),
            "--tls-auth-clients",
            "yes",
        ],
        workdir,
        port,
    )
    with running([server]):
        yield port, certs


class GatedRelay(LoopbackRelay):
    """A TCP relay to a Redis port that holds what clients send until ``open()``: commands in flight
    for as long as a test wants, without a clock. ``senders`` counts connections that sent something
    (each a store operation holding its connection)."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.senders = 0
        self._gate: asyncio.Event | None = None

    async def to_server(self, data: bytes, conn: dict[str, Any]) -> None:
        if self._gate is None:
            self._gate = asyncio.Event()  # made on the relay's loop
        if not self._gate.is_set():
            if not conn.get("counted"):
                conn["counted"] = True
                self.senders += 1
            await self._gate.wait()

    def open(self) -> None:
        def release() -> None:
            if self._gate is None:
                self._gate = asyncio.Event()
            self._gate.set()

        self.call_soon(release)
