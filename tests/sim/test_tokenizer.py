"""The simulator's tokenizer: reversible on any text, special tokens atomic, and BPE-like drift."""

from __future__ import annotations

import pytest

from turnkv.sim.tokenizer import SPECIAL_TOKENS, SUFFIXES, IncrementalDetokenizer, Tokenizer

TOK = Tokenizer()

ROUND_TRIP = [
    "",
    "hello world",
    " Bada kesi, lomu.",
    "Héllo wörld ✓ 日本語 🎉 naïve",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>\n\n</think>\n\n",
    "x<think>y</think>z",
    "<think partial <|im_end",
    "tabs\t\tand  double  spaces\r\n",
    "\n\n\n\nfour newlines",
    '{"name": "get_weather", "arguments": {"city": "Paris", "n": 42}}',
    "digits 0123456789 and 3.14159",
    "nul\x00byte and \u200b zero width",
    "<tool_call>\n{}\n</tool_call><tool_response>ok</tool_response>",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_of_encode_is_identity(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_incremental_detokenizer_matches_decode_one_id_at_a_time(text: str) -> None:
    detok = IncrementalDetokenizer(TOK)
    pieces = [detok.push([i]) for i in TOK.encode(text)] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("special", SPECIAL_TOKENS)
def test_special_tokens_are_single_ids(special: str) -> None:
    ids = TOK.encode(f"a{special}b")
    assert TOK.special_id(special) in ids
    assert TOK.is_special(TOK.special_id(special))
    assert len([i for i in ids if TOK.is_special(i)]) == 1


def test_skip_special_tokens_drops_only_specials() -> None:
    ids = TOK.encode("<think>\nBada</think>\n\nkesi<|im_end|>")
    assert TOK.decode(ids, skip_special_tokens=True) == "\nBada\n\nkesi"


@pytest.mark.parametrize("stem", [TOK.stems[0], TOK.stems[17], TOK.stems[-1]])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_generated_stem_plus_suffix_retokenizes_to_the_compound_id(stem: str, suffix: str) -> None:
    generated = [TOK.piece_id(" " + stem), TOK.piece_id(suffix)]
    text = TOK.decode(generated)
    assert text == f" {stem}{suffix}"
    assert TOK.encode(text) == [TOK.piece_id(f" {stem}{suffix}")]
    assert TOK.encode(text) != generated


@pytest.mark.parametrize("words", [TOK.words[:50], TOK.words[1000:1100:3], TOK.words[-20:]])
def test_word_sequences_retokenize_exactly(words: list[str]) -> None:
    ids = [TOK.start_word_ids[TOK.words.index(words[0])]] + [TOK.piece_id(" " + w) for w in words[1:]]
    ids += [TOK.piece_id(","), TOK.piece_id(" " + words[0]), TOK.piece_id("."), TOK.piece_id("\n\n")]
    assert TOK.encode(TOK.decode(ids)) == ids


def test_out_of_vocabulary_ids_are_rejected() -> None:
    assert not TOK.valid([TOK.vocab_size])
    assert TOK.valid([0, TOK.vocab_size - 1])
    with pytest.raises(ValueError):
        TOK.token_text(TOK.vocab_size)
