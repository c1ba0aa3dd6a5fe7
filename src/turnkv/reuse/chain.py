"""Per-block hash chains of token ids, and how far a new prompt agrees with a stored one.

A chain has one 8-byte digest per block of ``block_size`` tokens (the last block may be partial);
each digest covers every token before it, so equal digests at block ``i`` mean equal tokens up to
the end of that block. Only digests are stored, never tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_SIZE = 8


class ChainBuilder:
    """Builds a chain incrementally: feed the prompt, later feed the generated tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"turnkv-chain")
        self._full: list[bytes] = []
        self._tail: list[int] = []
        self.num_tokens = 0

    def extend(self, tokens: Sequence[int]) -> ChainBuilder:
        bs = self.block_size
        buf = self._tail + list(tokens)
        cut = len(buf) - len(buf) % bs
        for i in range(0, cut, bs):
            self._h.update(array("q", buf[i:i + bs]).tobytes())
            self._full.append(self._h.digest())
        self._tail = buf[cut:]
        self.num_tokens += len(tokens)
        return self

    def copy(self) -> ChainBuilder:
        other = ChainBuilder(self.block_size)
        other._h = self._h.copy()
        other._full = list(self._full)
        other._tail = list(self._tail)
        other.num_tokens = self.num_tokens
        return other

    def digests(self) -> bytes:
        """One digest per block fed so far; the unfinished last block gets one too."""
        out = b"".join(self._full)
        if self._tail:
            h = self._h.copy()
            h.update(array("q", self._tail).tobytes())
            out += h.digest()
        return out


def chain_of(tokens: Sequence[int], block_size: int) -> bytes:
    return ChainBuilder(block_size).extend(tokens).digests()


@dataclass(frozen=True)
class Agreement:
    """How far a prompt agrees with a stored sequence of ``stored_tokens`` tokens."""

    tokens: int  # agreeing tokens, block aligned unless the whole stored sequence agrees
    full: bool  # the prompt starts with the whole stored sequence
    diverges_at: int | None  # first block index that differs (None when full)
    prompt_ended: bool = False  # no difference found, but the prompt is shorter than the stored sequence


def agreement(stored: bytes, stored_tokens: int, prompt: Sequence[int], block_size: int) -> Agreement:
    """Compare a stored chain with a new prompt, block by block, up to the first difference."""
    if stored_tokens <= 0 or len(stored) != DIGEST_SIZE * -(-stored_tokens // block_size):
        return Agreement(0, False, 0)
    full_blocks, tail = divmod(stored_tokens, block_size)
    usable = min(len(prompt), stored_tokens)
    mine = ChainBuilder(block_size).extend(prompt[:usable]).digests()
    d = DIGEST_SIZE
    n = 0
    for i in range(min(full_blocks, usable // block_size)):
        if mine[i * d:(i + 1) * d] != stored[i * d:(i + 1) * d]:
            return Agreement(n, False, i)
        n += block_size
    if n < full_blocks * block_size:
        return Agreement(n, False, n // block_size, prompt_ended=True)
    if tail == 0:
        return Agreement(n, True, None)
    if len(prompt) < stored_tokens:
        return Agreement(n, False, full_blocks, prompt_ended=True)
    if mine[full_blocks * d:(full_blocks + 1) * d] == stored[full_blocks * d:]:
        return Agreement(stored_tokens, True, None)
    return Agreement(n, False, full_blocks)
