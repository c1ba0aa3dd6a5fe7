"""One GPU shared by simulated engines (``sim.gpu``): each step's work runs at 1/k of the GPU while k engines
compute, and engines in other processes find their own slots. Simulated time only: the sleeps are recorded,
not waited."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from turnkv.sim.gpu import QUANTUM_S, SharedGpu


def _hold(path: str, conn: Connection) -> None:
    gpu = SharedGpu(Path(path))
    conn.send(gpu.slot)
    conn.recv()  # until told to go
    gpu.close()


@pytest.mark.parametrize(("others", "factor"), [(0, 1), (1, 2), (3, 4)])
async def test_a_step_takes_as_many_times_longer_as_engines_compute_beside_it(
    tmp_path: Path, others: int, factor: int
) -> None:
    gpu = SharedGpu(tmp_path / "gpu")
    raw = bytearray((tmp_path / "gpu").read_bytes())  # other engines computing: their bytes set, as they set them
    raw[gpu.slot + 1 : gpu.slot + 1 + others] = b"\x01" * others
    (tmp_path / "gpu").write_bytes(bytes(raw))
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    await gpu.run(0.1, sleep)
    assert sum(slept) == pytest.approx(0.1 * factor)
    assert max(slept) <= QUANTUM_S + 1e-12  # it looks again at who computes every quantum
    assert gpu.computing() == others  # its own byte is clear again
    gpu.close()


def test_engines_in_other_processes_take_other_slots_and_a_dead_ones_slot_is_taken_again(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    path = str(tmp_path / "gpu")
    parent, child = ctx.Pipe()
    other = ctx.Process(target=_hold, args=(path, child))
    other.start()
    try:
        assert parent.poll(30), "the other engine did not start"
        theirs = parent.recv()
        mine = SharedGpu(Path(path))
        assert mine.slot != theirs
        mine.close()
    finally:
        parent.send("go")
        other.join(30)
    again = SharedGpu(Path(path))
    assert again.slot == 0  # every slot is free again
    again.close()
