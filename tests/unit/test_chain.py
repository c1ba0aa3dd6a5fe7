"""Hash chains and how far a prompt agrees with a stored sequence."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from turnkv.reuse.chain import DIGEST_SIZE, ChainBuilder, agreement, chain_of, proves, sequence_digest

BS = 4
SEQ = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108 109]


def test_incremental_equals_whole() -> None:
    b = ChainBuilder(BS).extend(SEQ[:3]).extend(SEQ[3:7]).extend(SEQ[7:])
    assert b.digests() == chain_of(SEQ, BS)
    assert len(b.digests()) == 3 * DIGEST_SIZE


def test_copy_is_independent() -> None:
    a = ChainBuilder(BS).extend(SEQ[:5])
    b = a.copy().extend(SEQ[5:])
    assert a.digests() == chain_of(SEQ[:5], BS)
    assert b.digests() == chain_of(SEQ, BS)


def test_each_digest_covers_everything_before() -> None:
    other = [999, *SEQ[1:]]
    mine, theirs = chain_of(SEQ, BS), chain_of(other, BS)
    for i in range(3):
        assert mine[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE] != theirs[i * DIGEST_SIZE : (i + 1) * DIGEST_SIZE]


@pytest.mark.parametrize(
    ("prompt", "tokens", "full", "diverges_at", "ended"),
    [
        (SEQ + [1, 2, 3], 10, True, None, False),  # extends exactly
        (SEQ, 10, True, None, False),  # equal
        (SEQ[:8] + [0, 0, 5], 8, False, 2, False),  # tail block differs: two full blocks agree
        (SEQ[:5] + [0] + SEQ[6:] + [7], 4, False, 1, False),  # second block differs
        ([0] + SEQ[1:] + [7], 0, False, 0, False),  # first token differs
        (SEQ[:9], 8, False, 2, True),  # prompt ends inside the tail block
        (SEQ[:6], 4, False, 1, True),  # prompt shorter than the full blocks
    ],
)
def test_agreement(prompt: list[int], tokens: int, full: bool, diverges_at: int | None, ended: bool) -> None:
    a = agreement(chain_of(SEQ, BS), len(SEQ), prompt, BS)
    assert (a.tokens, a.full, a.diverges_at, a.prompt_ended) == (tokens, full, diverges_at, ended)


def test_agreement_rejects_a_chain_of_the_wrong_length() -> None:
    a = agreement(chain_of(SEQ, BS)[:-1], len(SEQ), SEQ, BS)
    assert (a.tokens, a.full) == (0, False)


def test_block_aligned_stored_sequence() -> None:
    seq = SEQ[:8]
    a = agreement(chain_of(seq, BS), 8, seq + [1], BS)
    assert (a.tokens, a.full) == (8, True)


def test_a_chain_built_once_answers_the_comparison() -> None:
    prompt = SEQ + [1, 2, 3]
    built = ChainBuilder(BS).extend(prompt)
    for stored in (SEQ, SEQ[:8], SEQ[:6] + [0, 0, 0, 0]):
        assert agreement(chain_of(stored, BS), len(stored), prompt, BS, built) == agreement(
            chain_of(stored, BS), len(stored), prompt, BS
        )


@pytest.mark.parametrize("bad", [[1, "a"], [1, 2.5], [None], [2**70]])
def test_only_64_bit_ints_make_a_chain(bad: list[object]) -> None:
    with pytest.raises((TypeError, OverflowError)):
        ChainBuilder(BS).extend(bad)  # type: ignore[arg-type]


def test_the_chain_is_the_documented_blake2b_chain() -> None:
    # stored records keep only digests: the format must not change with how the chain is computed
    prev, expected = b"\x00" * DIGEST_SIZE, b""
    for i in range(0, len(SEQ), BS):
        prev = hashlib.blake2b(
            prev + array("q", SEQ[i : i + BS]).tobytes(), digest_size=DIGEST_SIZE, person=b"turnkv-chain"
        ).digest()
        expected += prev
    assert chain_of(SEQ, BS) == expected


def test_a_sequence_digest_proves_exactly_the_prompts_that_start_with_the_sequence() -> None:
    # the oracle: the ids themselves; random stored sequences and prompts that keep, cut, extend or
    # change them anywhere
    rng = random.Random(5)
    for _ in range(400):
        stored = [rng.randrange(200_000) for _ in range(rng.randrange(1, 60))]
        prompt = list(stored) + [rng.randrange(200_000) for _ in range(rng.randrange(0, 5))]
        how = rng.randrange(4)
        if how == 1:
            i = rng.randrange(len(stored))
            prompt[i] = prompt[i] + rng.choice([1, -1, 100_000])
        elif how == 2:
            prompt = prompt[: rng.randrange(len(stored))]
        elif how == 3:
            prompt.insert(rng.randrange(len(stored)), rng.randrange(200_000))
        expected = prompt[: len(stored)] == stored
        assert proves(sequence_digest(stored), len(stored), prompt) is expected, (stored, prompt)


@pytest.mark.parametrize(
    "prompt",
    [
        [1.0, 2, 3, 9],  # the same numbers, not all ints
        [True, 2, 3, 9],
        ["1", 2, 3, 9],
        [1, 2],  # shorter
    ],
)
def test_only_the_same_ints_are_proved(prompt: list[object]) -> None:
    assert not proves(sequence_digest([1, 2, 3]), 3, prompt)  # type: ignore[arg-type]


def test_a_sequence_digest_is_its_documented_blake2b() -> None:
    # stored records keep it: the format must not change with how it is computed
    expected = hashlib.blake2b(b"[1,2,3]", digest_size=16, person=b"turnkv-ids").digest()
    assert sequence_digest([1, 2, 3]) == sequence_digest((1, 2, 3)) == expected
    assert sequence_digest([2**70]) is None
    assert not proves(None, 3, [1, 2, 3]) and not proves(expected, 0, [1, 2, 3])
