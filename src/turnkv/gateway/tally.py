"""What clients hold at the edge (connections, requests arriving, requests in flight), counted per key, and
the caps that keep any one of them from taking it all (``Gate``).

A ``Tally`` counts this process's holdings exactly. With ``serve --workers N`` the caps are the whole
gateway's, so each worker also reads what the others hold, by what each actually holds (not an equal share
of each cap: the kernel spreads connections over workers by address, not by load). The workers share a
table in a file (``SharedCounts``, memory-mapped): a row per worker, a cell per hashed key; each worker
writes only its own row, so no lock is needed, and reads the others' rows. Two workers admitting at the
same instant can overshoot a cap by at most one each; keys that hash to the same cell are counted
together, which can only refuse early (the hash is keyed by a secret of the gateway's start, so a client
cannot aim at another's cell). A worker that dies has its row cleared before its replacement starts.

A ``Gate`` holds one resource to its caps: at most ``total`` in all; at most ``per_key[kind]`` per key of
a kind (peer address, tenant), where configured; and once only ``reserve`` is left, a key already holding
``light`` or more gets no more: whoever holds little (another address, a load balancer's health check,
another tenant) still gets in however many connections or requests one client holds.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

BUCKETS = 4096  # cells per worker row: 32 KiB a worker
GATES = ("connection", "arriving", "inflight")  # the gates, whose totals have the first cells of each row
TOTALS = 16  # cells kept for totals, never a hashed key's
CELL = 8  # bytes: a signed 64-bit count


class SharedCounts:
    """The workers' table: ``rows`` rows of ``BUCKETS`` counts in a memory-mapped file; this process writes
    row ``row``."""

    def __init__(self, path: str, rows: int, row: int, salt: bytes) -> None:
        self.rows, self.row, self._salt = rows, row, salt
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, rows * BUCKETS * CELL)
        finally:
            os.close(fd)
        self._cells = memoryview(self._map).cast("q")
        self._mine = row * BUCKETS

    @staticmethod
    def create(path: str, rows: int) -> bytes:
        """A zeroed table for ``rows`` workers at ``path``; the salt its keys are hashed with."""
        with open(path, "wb") as f:
            f.truncate(rows * BUCKETS * CELL)
        return secrets.token_bytes(16)

    @staticmethod
    def clear_row(path: str, rows: int, row: int) -> None:
        """Forget what a worker that exited held (its connections and requests died with it)."""
        with open(path, "r+b") as f:
            f.seek(row * BUCKETS * CELL)
            f.write(bytes(BUCKETS * CELL))

    def cell(self, key: str) -> int:
        """The cell of ``key``: a gate's total (a name without ``:``) has one of its own."""
        if ":" not in key:
            return GATES.index(key)
        digest = hashlib.blake2b(key.encode(), digest_size=8, key=self._salt).digest()
        return TOTALS + int.from_bytes(digest, "little") % (BUCKETS - TOTALS)

    def others(self, cell: int) -> int:
        """What the other workers hold in ``cell``."""
        cells = self._cells
        return sum(cells[r * BUCKETS + cell] for r in range(self.rows) if r != self.row)

    def write(self, cell: int, value: int) -> None:
        self._cells[self._mine + cell] = value

    def close(self) -> None:
        self._cells.release()
        self._map.close()


@dataclass
class Tally:
    """Holdings by key: this process's exactly, and the other workers' where they share a table."""

    shared: SharedCounts | None = None
    _held: dict[str, int] = field(default_factory=dict)
    _cells: dict[int, int] = field(default_factory=dict)  # this process's sum per shared cell

    def held(self, key: str) -> int:
        mine = self._held.get(key, 0)
        return mine if self.shared is None else mine + self.shared.others(self.shared.cell(key))

    def mine(self, key: str) -> int:
        return self._held.get(key, 0)

    def add(self, key: str, n: int) -> None:
        left = self._held.get(key, 0) + n
        if left:
            self._held[key] = left
        else:
            del self._held[key]
        if self.shared is not None:
            cell = self.shared.cell(key)
            total = self._cells.get(cell, 0) + n
            self._cells[cell] = total
            self.shared.write(cell, total)


@dataclass(frozen=True)
class Caps:
    """One resource's caps (see the module docstring)."""

    total: int
    reserve: int = 0
    per_key: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def light(self) -> int:
        """A key holding less than this may still take from the reserve: an eighth of it (at least one)."""
        return max(1, self.reserve // 8)

    @classmethod
    def of(cls, total: int, reserve_share: float, **per_key: int | None) -> Caps:
        return cls(total, int(total * reserve_share), per_key)


@dataclass(frozen=True)
class Refusal:
    """Why a gate refused: ``kind`` None for the gate's total, else the kind of key that holds too much."""

    gate: str
    kind: str | None

    @property
    def reason(self) -> str:
        """A metric label: ``<gate>_cap`` or ``<gate>_cap_per_<kind>``."""
        return f"{self.gate}_cap" if self.kind is None else f"{self.gate}_cap_per_{self.kind}"


class Gate:
    """One resource held to its ``Caps``; ``keys`` name who asks, by kind (``{"ip": "10.0.0.7"}``)."""

    def __init__(self, name: str, caps: Caps, tally: Tally) -> None:
        assert name in GATES, "a gate's total has a cell of its own in the workers' table"
        self.name, self.caps, self.tally = name, caps, tally

    def _keys(self, keys: Mapping[str, str | None]) -> Iterator[tuple[str, str]]:
        for kind, key in keys.items():
            if key is not None:
                yield kind, f"{self.name}:{kind}:{key}"

    def refusal(self, keys: Mapping[str, str | None]) -> Refusal | None:
        """Why one more for ``keys`` would pass a cap now; None when it would not."""
        caps, tally = self.caps, self.tally
        total = tally.held(self.name)
        if total >= caps.total:
            return Refusal(self.name, None)
        reserved = total >= caps.total - caps.reserve
        for kind, key in self._keys(keys):
            held = tally.held(key)
            cap = caps.per_key.get(kind)
            if (cap is not None and held >= cap) or (reserved and held >= caps.light):
                return Refusal(self.name, kind)
        return None

    def take(self, keys: Mapping[str, str | None]) -> None:
        self.tally.add(self.name, 1)
        for _, key in self._keys(keys):
            self.tally.add(key, 1)

    def give(self, keys: Mapping[str, str | None]) -> None:
        self.tally.add(self.name, -1)
        for _, key in self._keys(keys):
            self.tally.add(key, -1)

    @property
    def held(self) -> int:
        """What this process holds."""
        return self.tally.mine(self.name)
