"""The simulated KV cache: fixed-size blocks, reference counts, and a hash-chained prefix cache.

Decides which physical block holds which positions, when a block may be reused, and what a
reader of a block id gets. As in vLLM, a freed block keeps its contents (and its prefix-cache
entry) until it is handed to another request, so reading a block id after it was freed returns
whatever the block holds now: possibly another request's KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Block:
    id: int
    kv: list[int] = field(default_factory=list)
    hash: int | None = None
    ref: int = 0


def block_hashes(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """Prefix-cache keys of the full blocks of ``tokens``; each key covers every token before it."""
    out: list[int] = []
    parent = root
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


class OutOfBlocks(RuntimeError):
    """No free block is left: the request cannot be scheduled."""


class _Blocks(dict[int, Block]):
    """The pool's blocks by id (0 to ``n`` - 1), each made the first time it is looked up: an engine of tens
    of thousands of blocks starts without making them all (most runs touch a few hundred)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __missing__(self, bid: int) -> Block:
        if not 0 <= bid < self.n:
            raise IndexError(f"block {bid} is not one of the pool's {self.n}")
        b = self[bid] = Block(bid)
        return b


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_blocks = num_blocks
        self.blocks = _Blocks(num_blocks)
        # Free blocks in eviction order: the least recently freed is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self.evictions = 0  # prefix-cache entries lost to reuse of their free blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a prefix-cache entry, in use or free."""
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / max(1, self.num_blocks)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The longest run of cached blocks for these prefix keys (not yet referenced)."""
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].hash != h:
                break
            hit.append(bid)
        return hit

    def acquire(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref == 0:
                self._free.pop(bid, None)
            b.ref += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None and self._cached.get(b.hash) == bid:
                del self._cached[b.hash]  # evicted from the prefix cache
                self.evictions += 1
            b.hash = None
            b.ref = 1
            out.append(bid)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the end of the free list.

        With caching on, a request's blocks are freed tail first so that its tail is evicted
        first (vLLM ``v1/core/single_type_kv_cache_manager.py`` ``free``).
        """
        for bid in reversed(block_ids) if self.enable_caching else block_ids:
            b = self.blocks[bid]
            if b.ref <= 0:
                continue
            b.ref -= 1
            if b.ref == 0:
                self._free[bid] = None

    def commit(self, block_id: int, key: int) -> None:
        """Register a full block in the prefix cache under ``key`` (the request's own token hash)."""
        if not self.enable_caching:
            return
        b = self.blocks[block_id]
        if b.hash is None and key not in self._cached:
            b.hash = key
            self._cached[key] = block_id

    def reset_cache(self) -> None:
        self._cached.clear()
        for b in self.blocks.values():
            b.hash = None

    def write(self, block_id: int, offset: int, values: Sequence[int]) -> None:
        kv = self.blocks[block_id].kv
        end = offset + len(values)
        if len(kv) < end:
            kv.extend([0] * (end - len(kv)))
        kv[offset:end] = values

    def read(self, block_id: int) -> list[int]:
        return list(self.blocks[block_id].kv)

    def value_at(self, block_ids: Sequence[int], position: int) -> int:
        b = self.blocks[block_ids[position // self.block_size]]
        off = position % self.block_size
        return b.kv[off] if off < len(b.kv) else 0
