"""``turnkv serve --workers 2``: two gateway processes on one port share conversations and metrics."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, Dialogue, Turn, metric, start_cluster, wait_for
from turnkv import launch

pytestmark = pytest.mark.integration

TURNS = 8


def workers_of(pid: int) -> set[int]:
    """The gateway's worker processes (spawned children; not multiprocessing's resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        if ppid == pid and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def step_on_new_connection(d: Dialogue, c: Cluster) -> Turn:
    # a new connection per turn: the kernel spreads connections over the workers by address
    with c.client() as client:
        return d.step(client=client)


def test_workers_share_conversations_and_metrics(procs: list[launch.Running], tmp_path: Path,
                                                 redis_url: str) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", redis_url=redis_url, gateway_args=("--workers", "2"))
    gateway_pid = c.gateway.proc.pid
    first = workers_of(gateway_pid)
    assert len(first) == 2
    with Dialogue(c) as d:
        turns = [step_on_new_connection(d, c) for _ in range(TURNS)]
        assert all(t.correct for t in turns)
        assert [t.outcome for t in turns[1:]] == ["full"] * (TURNS - 1)
        # whichever worker answers /metrics reports every worker's turns
        assert metric(c.gateway.url, "turnkv_reuse_decisions_total") == TURNS
        assert metric(c.gateway.url, "turnkv_store_up") == 1
        assert metric(c.gateway.url, "turnkv_template_class", **{"class": "preserves"}) == 1

        # a worker that dies is replaced; its counts stay in the totals
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(workers_of(gateway_pid) - {victim}) == 2, what="a replacement worker")
        more = [step_on_new_connection(d, c) for _ in range(2)]
    assert all(t.correct and t.outcome == "full" for t in more)
    assert metric(c.gateway.url, "turnkv_reuse_decisions_total") == TURNS + 2
    assert c.gateway.stop() == 0
    assert workers_of(gateway_pid) == set()


def test_workers_exit_with_their_supervisor(procs: list[launch.Running], tmp_path: Path, redis_url: str) -> None:
    c = start_cluster(procs, tmp_path, compat="0.33", redis_url=redis_url, gateway_args=("--workers", "2"))
    pids = workers_of(c.gateway.proc.pid)
    assert len(pids) == 2
    c.gateway.kill()  # SIGKILL: the supervisor cannot pass anything on
    try:
        wait_for(lambda: not any(alive(p) for p in pids), what="the workers to stop")
    finally:
        for p in filter(alive, pids):
            os.kill(p, signal.SIGKILL)  # leave no orphan serving a port
