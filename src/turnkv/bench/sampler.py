"""Resident memory and open file descriptors of a deployment's processes, sampled over a load.

Decides what a sample is (per named group of processes: the summed VmRSS from /proc/<pid>/status and
the summed count of /proc/<pid>/fd entries, over the group's root and its live descendants, so a gateway
with workers counts as one) and when samples are taken: every ``interval_s`` on a thread of its own,
from ``start()`` until ``stop()``, which joins it within a deadline. Times are seconds from ``t0`` (the
load's start), so samples before the load are negative. A process that exits between two reads is
skipped in that sample.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from turnkv.bench import procs

MAX_SAMPLES = 100_000  # a sampler left running still stops growing (a day at one per second)


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (VmRSS), in bytes; 0 for a process without one (a zombie)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    """File descriptors open in one process now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def tree_usage(pid: int, *, children: bool = True) -> tuple[int, int]:
    """(RSS bytes, open fds) of a process and, with ``children``, of its live descendants."""
    rss = fds = 0
    for p in [pid, *(procs.descendants(pid) if children else ())]:
        with contextlib.suppress(OSError):  # exited while we looked
            r, n = rss_bytes(p), open_fds(p)
            rss, fds = rss + r, fds + n
    return rss, fds


@dataclass
class Series:
    """One group's samples: times (s from t0), RSS in MiB, open fds."""

    t: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[Any]]:
        return {"t": [round(x, 2) for x in self.t], "rss_mib": [round(x, 2) for x in self.rss_mib], "fds": self.fds}

    @classmethod
    def from_dict(cls, d: dict[str, list[Any]]) -> Series:
        return cls(t=list(d["t"]), rss_mib=list(d["rss_mib"]), fds=list(d["fds"]))


class ResourceSampler:
    """Samples named process groups (``name -> (root pid, count descendants)``) on a thread."""

    def __init__(self, groups: dict[str, tuple[int, bool]], *, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.groups = dict(groups)
        self.interval_s = interval_s
        self.series: dict[str, Series] = {name: Series() for name in groups}
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One sample of every group, now."""
        now = time.perf_counter() - self.t0
        for name, (pid, children) in self.groups.items():
            try:
                rss, fds = tree_usage(pid, children=children)
            except OSError:
                continue
            s = self.series[name]
            if len(s.t) >= MAX_SAMPLES:
                continue
            s.t.append(now)
            s.rss_mib.append(rss / 2**20)
            s.fds.append(fds)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.sample()
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="resource-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the thread and takes one last sample; raises if the thread did not end in time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the resource sampler did not stop within {timeout_s} s")
        self.sample()

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        return {
            "interval_s": self.interval_s,
            **extra,
            "series": {name: s.to_dict() for name, s in self.series.items()},
        }
