"""A deterministic, reversible tokenizer for the simulated engine.

Decides how text maps to token ids: special tokens first, then a fixed synthetic vocabulary of
words (with and without a leading space), newline runs and punctuation pieces, and a byte
fallback for everything else, so ``decode(encode(s)) == s`` for any string. Compound words
(``" stem" + "ing"`` also exists as the single piece ``" steming"``) let a generator emit id
sequences that re-tokenize differently, as BPE tokenizers do (retokenization drift).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import cache, cached_property

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
BYTE_BASE = 16  # ids 0..15 are reserved for special tokens
PIECE_BASE = BYTE_BASE + 256

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
SUFFIXES = ("ing", "ed", "er")
PUNCTUATION = (
    ".",
    ",",
    ":",
    "?",
    "!",
    ";",
    "-",
    "(",
    ")",
    '"',
    "'",
    "{",
    "}",
    "[",
    "]",
    '{"',
    '":',
    '",',
    '"}',
)
NEWLINES = ("\n", "\n\n")


def _synthetic_words(count: int) -> list[str]:
    """Pronounceable words of two and three syllables, in a fixed order."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words: list[str] = []
    for a in syllables:
        for b in syllables:
            words.append(a + b)
    step = 7919  # a prime walk gives three-syllable words spread over the space
    n = len(syllables)
    i = 0
    while len(words) < count:
        words.append(syllables[i % n] + syllables[(i // n) % n] + syllables[(i * 31 + 7) % n])
        i += step
    return list(dict.fromkeys(words))[:count]


_PRETOKEN = re.compile(r"\n+| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s")


class Tokenizer:
    """Maps text to ids and back. Instances are immutable and cheap to share."""

    def __init__(self, num_words: int = 4096, num_stems: int = 256) -> None:
        words = _synthetic_words(num_words)
        pieces: list[str] = list(NEWLINES) + list(PUNCTUATION) + [" "]
        pieces += [" " + w for w in words] + [w.capitalize() for w in words] + list(words)
        self.stems = words[:num_stems]
        pieces += list(SUFFIXES)
        pieces += [" " + s + suf for s in self.stems for suf in SUFFIXES]
        for d in range(10):
            pieces += [str(d), " " + str(d)]
        self._id_to_text: list[str] = list(SPECIAL_TOKENS) + [""] * (BYTE_BASE - len(SPECIAL_TOKENS))
        self._id_to_text += [chr(b) for b in range(256)]  # placeholder text; bytes decode separately
        self._piece_to_id: dict[str, int] = {}
        for p in dict.fromkeys(pieces):
            self._piece_to_id[p] = len(self._id_to_text)
            self._id_to_text.append(p)
        self._special_to_id = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
        self.words = words
        self.word_ids = [self._piece_to_id[" " + w] for w in words]
        self.start_word_ids = [self._piece_to_id[w.capitalize()] for w in words]

    @staticmethod
    @cache
    def shared() -> Tokenizer:
        """The default tokenizer, built once per process (building one takes tens of milliseconds; every
        simulated engine uses the same)."""
        return Tokenizer()

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    @property
    def special_ids(self) -> range:
        return range(len(SPECIAL_TOKENS))

    def special_id(self, token: str) -> int:
        return self._special_to_id[token]

    def piece_id(self, piece: str) -> int:
        return self._piece_to_id[piece]

    @cached_property
    def eos_id(self) -> int:
        return self._special_to_id["<|im_end|>"]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._special_re.split(text):
            if not part:
                continue
            special = self._special_to_id.get(part)
            if special is not None:
                ids.append(special)
                continue
            for m in _PRETOKEN.finditer(part):
                piece = m.group()
                pid = self._piece_to_id.get(piece)
                if pid is not None:
                    ids.append(pid)
                else:
                    ids.extend(BYTE_BASE + b for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            if BYTE_BASE <= i < PIECE_BASE:
                pending.append(i - BYTE_BASE)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if self.is_special(i) and skip_special_tokens:
                continue
            out.append(self.token_text(i))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._id_to_text):
            raise ValueError(f"token id {token_id} is out of vocabulary")
        return self._id_to_text[token_id]

    def valid(self, ids: Sequence[int]) -> bool:
        n = len(self._id_to_text)
        return all(0 <= i < n for i in ids)


class IncrementalDetokenizer:
    """Turns a growing id sequence into text deltas without splitting a UTF-8 byte run."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._pending: list[int] = []

    def push(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for i in ids:
            if BYTE_BASE <= i < PIECE_BASE:
                self._pending.append(i)
                text = self._tok.decode(self._pending)
                if "\ufffd" not in text:
                    out.append(text)
                    self._pending.clear()
                continue
            if self._pending:
                out.append(self._tok.decode(self._pending))
                self._pending.clear()
            out.append(self._tok.token_text(i))
        return "".join(out)

    def flush(self) -> str:
        text = self._tok.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text
