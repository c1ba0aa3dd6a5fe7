"""turnkv's incremental reading of parser markup (``derender.markup``), and the text of a growing id list
(``derender.detok``): however the text is cut into pieces, the same reasoning and content come out, and
nothing that is markup is ever released."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from turnkv.derender.answer import Answer, Delta, ToolCall, reconcile
from turnkv.derender.detok import IncrementalText, LocalText
from turnkv.derender.markup import Markup, MarkupSplitter, markup_for
from turnkv.derender.tokenizer import TokenizerUnavailable, load_decode
from turnkv.sim.tokenizer import Tokenizer

QWEN = Markup()
CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def split_all(text: str, cuts: list[int], **kw: bool) -> tuple[str, str, MarkupSplitter]:
    s = MarkupSplitter(QWEN, **{"reasoning_open": True, "parse_tools": True, **kw})
    reasoning = content = ""
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out = s.feed(text[a:b])
        reasoning += out.reasoning
        content += out.content
        for marker in QWEN.dropped:  # special tokens' text is never released
            assert marker not in out.reasoning + out.content
    end = s.finish()
    return reasoning + end.reasoning, content + end.content, s


CASES = [
    # (text, reasoning_open, parse_tools, reasoning, content)
    ("<think>\nwhy\n</think>\n\nThe answer.<|im_end|>", True, True, "\nwhy\n", "\n\nThe answer."),
    ("why</think>answer", True, True, "why", "answer"),  # no opening tag: the prompt left reasoning open
    ("plain answer<|im_end|>", False, True, "", "plain answer"),
    ("<think>\nr\n</think>\n\n" + CALL, True, True, "\nr\n", ""),  # blank content before a call: none
    ("<think>\nr\n</think>\n\nLet me check. " + CALL + " after", True, True, "\nr\n", "\n\nLet me check. "),
    ("r<tool_call>{}</tool_call>", True, True, "r", ""),  # a tool call also ends reasoning
    ("<think>r</think>x <tool_call>y", True, False, "r", "x <tool_call>y"),  # tools not parsed: text
    ("<think>r</think>a <think> b", True, True, "r", "a <think> b"),  # <think> after reasoning is text
    ("<think>r</think>a < b </thin", True, True, "r", "a < b </thin"),  # partial markers at the end are text
]


@pytest.mark.parametrize(("text", "open_", "tools", "reasoning", "content"), CASES)
def test_every_cut_gives_the_same_split(text: str, open_: bool, tools: bool, reasoning: str, content: str) -> None:
    rng = random.Random(7)
    for n in range(60):
        cuts = [] if n == 0 else rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))
        if n == 1:
            cuts = list(range(1, len(text)))  # one character at a time
        got_r, got_c, _ = split_all(text, cuts, reasoning_open=open_, parse_tools=tools)
        assert (got_r, got_c) == (reasoning, content), cuts


def test_a_partial_marker_is_held_until_it_is_told() -> None:
    s = MarkupSplitter(QWEN, reasoning_open=True, parse_tools=True)
    assert s.feed("thinking </th").reasoning == "thinking "
    assert s.feed("ink>\n\nok").content == "\n\nok"
    assert s.feed(" <tool").content == " "  # "<tool" may be a call: held
    assert s.feed("_call>{").content == "" and s.finish().content == ""


def test_markup_for_knows_its_parsers() -> None:
    assert markup_for("qwen3", "hermes") == QWEN
    assert markup_for(None, None) == Markup(think=None, tool=None)
    assert markup_for("qwen3", "mistral") is None and markup_for("gpt-oss", None) is None


def test_reconcile_gives_what_the_stream_still_owes() -> None:
    call = ToolCall("id1", "f", "{}")
    answer = Answer("Hello world", "why", (call,), "tool_calls")
    rest, diverged = reconcile(Delta("wh", "Hello "), answer)
    assert rest == Delta("y", "world", (call,)) and not diverged
    rest, diverged = reconcile(Delta("why", "Help"), answer)
    assert diverged and rest.content == "lo world"  # after the longest common prefix "Hel"
    assert reconcile(Delta(), Answer(None, None, (), "stop")) == (Delta(), False)


@pytest.mark.parametrize("window", [3, 64])
async def test_incremental_text_adds_up_to_the_whole_decode(window: int) -> None:
    tok = Tokenizer()
    text = "Ünïcödé → 漢字 and plain words, 🙂 emoji; <think>mark</think> ok"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # byte fallback: characters span several ids
    rng = random.Random(3)
    for _ in range(20):
        source = LocalText(tok.decode)
        inc = IncrementalText(source, window=window)
        out, i, pushes = "", 0, 0
        while i < len(ids):
            n = rng.randint(1, 5)
            out += await inc.push(ids[i : i + n], final=i + n >= len(ids))
            assert "\ufffd" not in out  # an incomplete character is never given out
            i, pushes = i + n, pushes + 1
        assert out == tok.decode(ids) == text
        assert source.calls <= 2 * pushes  # one decode a push, two where the anchor moves
        assert max(len(a) for a in [inc.ids]) == len(ids)


def byte_level_tokenizer(path: Path) -> Path:
    """A small byte-level BPE tokenizer (the kind Qwen and Llama 3 use), trained here, with added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_end|>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "Ünïcödé → 漢字 🙂", "reasoning, then the answer"] * 20
    tok.train_from_iterator(corpus, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


async def test_a_tokenizer_json_in_process_gives_the_same_text_incrementally(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer

    file = byte_level_tokenizer(tmp_path)
    decode = load_decode(tmp_path)  # the model folder: its tokenizer.json
    text = "<think>the fox → 漢字</think>🙂 Ünïcödé lazy dog<|im_end|>"
    ids = HfTokenizer.from_file(str(file)).encode(text).ids
    assert decode(ids) == text  # special tokens kept, as the parsers read them
    rng = random.Random(5)
    for _ in range(20):
        inc, out, i = IncrementalText(LocalText(decode), window=4), "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out += await inc.push(ids[i : i + n], final=i + n >= len(ids))
            assert "\ufffd" not in out
            i += n
        assert out == text
    with pytest.raises(TokenizerUnavailable):
        load_decode(tmp_path / "missing")
