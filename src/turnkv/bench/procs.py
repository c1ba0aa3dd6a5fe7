"""Process-level measurements and helpers: CPU time from /proc, CPU pinning, and a relay that counts
Redis round trips without MONITOR (the redis-server itself: ``bench.redis_server``).

The relay sits between the gateway and Redis and counts request bursts per connection: client
bytes that arrive while no reply is pending start a new round trip (a MULTI/EXEC pipeline written
at once is one; a script call that falls back from EVALSHA to EVAL is two). It runs on its own
event loop in a thread, so it is used only in the counting pass, never where latency is measured.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from turnkv.bench.relay import LoopbackRelay

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, in seconds (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime: fields 14 and 15 of stat


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children...), as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and of its live descendants (a gateway with --workers is several)."""
    total = cpu_seconds(pid)
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def pin(pid: int, cpus: set[int]) -> bool:
    """Restricts a process to ``cpus`` where the machine has them; False when it could not."""
    have = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    want = cpus & have
    if not want:
        return False
    try:
        os.sched_setaffinity(pid, want)
    except OSError:
        return False
    return True


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def _first_command(data: bytes) -> str:
    """The command name of a RESP array (``*N\\r\\n$len\\r\\nNAME``), lower case, with the script's sha
    prefix for EVALSHA; '?' if not one."""
    parts = data.split(b"\r\n", 5)
    if len(parts) < 3 or data[:1] != b"*":
        return "?"
    name = parts[2].decode("ascii", "replace").lower()
    if name == "evalsha" and len(parts) >= 5:
        return f"evalsha {parts[4][:8].decode('ascii', 'replace')}"
    return name


class RoundTripRelay(LoopbackRelay):
    """Forwards a loopback port to Redis and counts round trips (see the module docstring)."""

    def __init__(self, redis_port: int) -> None:
        super().__init__(redis_port)
        self.round_trips = 0
        self.by_command: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def to_server(self, data: bytes, conn: dict[str, Any]) -> None:
        if not conn.get("pending"):
            conn["pending"] = True
            self.round_trips += 1
            self.by_command[_first_command(data)] += 1

    async def to_client(self, data: bytes, conn: dict[str, Any]) -> None:
        conn["pending"] = False


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """Yields a one-item list that holds the elapsed seconds once the block is left."""
    box = [0.0]
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - t0
