"""The block pool: prefix-cache hits, the order in which free blocks are reused, and stale content."""

from __future__ import annotations

import pytest

from turnkv.sim.blocks import BlockPool, OutOfBlocks, block_hashes

BS = 4
ROOT = 7


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate, write and commit blocks for ``tokens`` as a finished request would have."""
    hashes = block_hashes(tokens, BS, ROOT)
    ids = pool.allocate(-(-len(tokens) // BS))
    for k, bid in enumerate(ids):
        pool.write(bid, 0, [t * 10 for t in tokens[k * BS : (k + 1) * BS]])
        if k < len(hashes):
            pool.commit(bid, hashes[k])
    return ids


@pytest.mark.parametrize(
    ("query", "hit_blocks"),
    [
        (list(range(12)), 3),
        (list(range(14)), 3),  # the partial block after the full ones is not cached
        (list(range(8)) + [99, 99, 99, 99], 2),
        ([99] + list(range(1, 12)), 0),  # a different first token changes every key after it
        (list(range(3)), 0),
    ],
)
def test_prefix_hits_are_the_longest_run_of_cached_full_blocks(query: list[int], hit_blocks: int) -> None:
    pool = BlockPool(16, BS, enable_caching=True)
    ids = fill(pool, list(range(12)))
    pool.release(ids)
    assert pool.lookup(block_hashes(query, BS, ROOT)) == ids[:hit_blocks]


def test_without_caching_nothing_is_ever_hit() -> None:
    pool = BlockPool(16, BS, enable_caching=False)
    pool.release(fill(pool, list(range(12))))
    assert pool.lookup(block_hashes(list(range(12)), BS, ROOT)) == []


def test_free_blocks_are_reused_least_recently_freed_first_and_a_request_tail_first() -> None:
    pool = BlockPool(6, BS, enable_caching=True)
    a = fill(pool, list(range(8)))  # blocks 0, 1
    b = fill(pool, list(range(100, 108)))  # blocks 2, 3
    pool.release(b)
    pool.release(a)
    # never-used 4, 5 first; then b (freed first), tail first; then a, tail first
    assert pool.allocate(6) == [4, 5, b[1], b[0], a[1], a[0]]


def test_reallocating_a_cached_block_evicts_it_from_the_prefix_cache() -> None:
    pool = BlockPool(2, BS, enable_caching=True)
    ids = fill(pool, list(range(8)))
    pool.release(ids)
    keys = block_hashes(list(range(8)), BS, ROOT)
    assert pool.lookup(keys) == ids
    (taken,) = pool.allocate(1)  # the tail block goes first
    assert taken == ids[1]
    assert pool.lookup(keys) == ids[:1]


def test_a_hit_block_taken_by_a_request_is_not_handed_out() -> None:
    pool = BlockPool(2, BS, enable_caching=True)
    ids = fill(pool, list(range(8)))
    pool.release(ids)
    pool.acquire(pool.lookup(block_hashes(list(range(8)), BS, ROOT)))
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release(ids)
    pool.release(ids)  # a second release of a free block is ignored
    assert pool.num_free == 2


def test_freed_block_keeps_its_content_until_reallocated_and_rewritten() -> None:
    pool = BlockPool(1, BS, enable_caching=False)
    (bid,) = fill(pool, [1, 2, 3, 4])
    pool.release([bid])
    assert pool.read(bid) == [10, 20, 30, 40]  # a reader of a freed block still sees the old KV
    assert pool.allocate(1) == [bid]
    pool.write(bid, 0, [5, 6])
    assert pool.read(bid) == [5, 6, 30, 40]  # only what the new owner wrote has changed


def test_usage_counts_blocks_in_use() -> None:
    pool = BlockPool(4, BS, enable_caching=True)
    ids = pool.allocate(3)
    assert pool.usage() == 0.75
    pool.release(ids)
    assert pool.usage() == 0.0
