"""One GPU shared by several simulated engines (separate processes): its compute, divided among those busy.

Two vLLM instances on one GPU (P and D at ``gpu_memory_utilization`` 0.42 each, as on the project's H200)
each run their steps on the same device: while both compute, each gets about half of it, so P's prefills
lengthen D's decode steps (its streams' ITL) as D's own would. Modelled as processor sharing: a step of
``w`` seconds of the GPU's work runs in slices of ``QUANTUM_S``; each slice advances it by the slice over
the number of engines computing at that moment. The engines find each other through a small file they
all map (``--gpu-share-file``): a byte per engine, set while it computes; each holds its slot with a lock
on that byte, so a slot of an engine that died is taken again by the next to start.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

SLOTS = 16  # engines one GPU may be shared by
QUANTUM_S = 0.002  # simulated seconds between looks at who else computes


class GpuFull(RuntimeError):
    """Every slot of the shared GPU is held by a running engine."""


class SharedGpu:
    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < SLOTS:
            os.ftruncate(self._fd, SLOTS)
        self._map = mmap.mmap(self._fd, SLOTS)
        self.slot = self._claim()
        self._map[self.slot] = 0

    def _claim(self) -> int:
        for i in range(SLOTS):
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i)
            except OSError:
                continue
            return i
        raise GpuFull(f"{SLOTS} engines share this GPU already")

    def computing(self) -> int:
        """Engines computing on the GPU now (this one counted when it is)."""
        return sum(1 for b in self._map[:SLOTS] if b)

    async def run(self, seconds: float, sleep: Callable[[float], Awaitable[None]]) -> None:
        """Compute ``seconds`` of the GPU's work, sharing it with the other engines computing meanwhile
        (``sleep`` waits out a simulated duration)."""
        self._map[self.slot] = 1
        try:
            left = seconds
            while left > 0:
                share = max(1, self.computing())
                wall = min(QUANTUM_S, left * share)
                await sleep(wall)
                left -= wall / share
        finally:
            self._map[self.slot] = 0

    def close(self) -> None:
        self._map[self.slot] = 0
        self._map.close()
        os.close(self._fd)  # the slot's lock goes with it
