"""The KV-content oracle: what a position's KV "is", and what an engine says given the KV it attends to.

A position's KV value is a hash of the token computed there, its position, and the KV value before
it, so it encodes the whole history that produced it. An engine samples the next token from the KV
value of the last position it attended to. Blocks pulled from another engine carry that engine's
values verbatim, so a pull of blocks computed for other tokens changes every later value and with
it the answer: the simulator cannot give a correct answer from a wrong reuse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.sim.tokenizer import SUFFIXES, Tokenizer

ROOT_KV = 0x5EED_C0DE
_MASK = (1 << 64) - 1


def kv_step(prev: int, token: int, position: int) -> int:
    """The KV value at ``position`` given the value before it; deterministic across processes."""
    return hash((prev, token, position)) & _MASK


def kv_extend(prev: int, tokens: Sequence[int], start: int) -> list[int]:
    """KV values for ``tokens`` placed at positions ``start, start+1, ...`` after value ``prev``."""
    out = []
    h = hash
    for i, t in enumerate(tokens):
        prev = h((prev, t, start + i)) & _MASK
        out.append(prev)
    return out


def opens_thinking(tok: Tokenizer, prompt: Sequence[int]) -> bool:
    """Whether a model given ``prompt`` starts its answer with a reasoning part.

    It does unless the prompt's last turn already closed thinking (a ``</think>`` after the last
    ``<|im_start|>``, as templates write for ``enable_thinking: false``). The answer depends on
    the prompt alone, never on the route that carried it.
    """
    end, turn = tok.special_id("</think>"), tok.special_id("<|im_start|>")
    for t in reversed(prompt):
        if t == end:
            return False
        if t == turn:
            return True
    return True


def _pick(kv: int, salt: int, n: int) -> int:
    return (hash((kv, salt)) & _MASK) % n


@dataclass
class Sampling:
    """The subset of sampling parameters the simulator honours."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    thinking: bool = True
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: Any = "auto"
    drift: bool = False


@dataclass
class Generator:
    """Emits an answer token by token: ``<think>`` reasoning ``</think>``, then content or a tool call.

    Lengths and the tool decision are drawn from the KV value at the end of the prompt; every word
    is drawn from the KV value of the position before it.
    """

    tok: Tokenizer
    sampling: Sampling
    _queue: list[int] = field(default_factory=list)
    _phase: str = "start"
    _left: int = 0
    _content_words: int = 0
    _last_was_punct: bool = True
    _line_start: bool = True

    def next_token(self, kv: int, produced: int) -> int:
        if self._queue:
            return self._queue.pop(0)
        t = self.tok
        if self._phase == "start":
            reasoning = 6 + _pick(kv, 1, 24)
            self._content_words = 8 + _pick(kv, 2, 48)
            if self.sampling.thinking:
                self._phase, self._left = "reason", reasoning
                self._queue = [t.piece_id("\n")]
                self._last_was_punct = self._line_start = True
                return t.special_id("<think>")
            self._enter_answer(kv)
            return self.next_token(kv, produced)
        if self._phase == "reason":
            if self._left > 0:
                self._left -= 1
                return self._word(kv)
            self._queue = [t.special_id("</think>"), t.piece_id("\n\n")]
            self._enter_answer(kv)
            return t.piece_id("\n")
        if self._phase == "tool":
            self._phase = "end"
            return self.next_token(kv, produced)
        if self._phase == "content":
            if self._left > 0:
                self._left -= 1
                return self._word(kv)
            self._phase = "end"
        # "end": stop unless the request asks for more tokens than the answer has.
        if self.sampling.ignore_eos or produced < self.sampling.min_tokens:
            return self._word(kv)
        return t.eos_id

    def _enter_answer(self, kv: int) -> None:
        self._last_was_punct = self._line_start = True
        call = self._tool_call(kv)
        if call is not None:
            self._phase = "tool"
            self._queue += call
        else:
            self._phase, self._left = "content", self._content_words

    def _word(self, kv: int) -> int:
        t = self.tok
        if not self._last_was_punct and _pick(kv, 3, 9) == 0:
            self._last_was_punct = True
            return t.piece_id("." if _pick(kv, 4, 3) else ",")
        start, self._line_start = self._line_start, False
        self._last_was_punct = False
        if self.sampling.drift and not start and self._phase in ("content", "end") and _pick(kv, 5, 5) == 0:
            stem = t.stems[_pick(kv, 6, len(t.stems))]
            self._queue.append(t.piece_id(SUFFIXES[_pick(kv, 8, len(SUFFIXES))]))
            return t.piece_id(" " + stem)
        ids = t.start_word_ids if start else t.word_ids
        return ids[_pick(kv, 0, len(ids))]

    def _tool_call(self, kv: int) -> list[int] | None:
        tools = [x for x in self.sampling.tools if isinstance(x, Mapping)]
        choice = self.sampling.tool_choice
        if not tools or choice == "none":
            return None
        named = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
        if named is None and choice != "required" and _pick(kv, 10, 2) == 0:
            return None
        fns = [x.get("function", x) for x in tools]
        fn = next((f for f in fns if f.get("name") == named), None) or fns[_pick(kv, 11, len(fns))]
        args = _arguments(fn.get("parameters") or {}, kv, self.tok)
        text = json.dumps({"name": fn.get("name", "tool"), "arguments": args}, ensure_ascii=False)
        t = self.tok
        return [
            t.special_id("<tool_call>"),
            t.piece_id("\n"),
            *t.encode(text),
            t.piece_id("\n"),
            t.special_id("</tool_call>"),
        ]


def _arguments(schema: Mapping[str, Any], kv: int, tok: Tokenizer) -> dict[str, Any]:
    props = schema.get("properties") or {}
    args: dict[str, Any] = {}
    for i, (name, spec) in enumerate(props.items()):
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        if kind in ("integer", "number"):
            args[name] = _pick(kv, 20 + i, 100)
        elif kind == "boolean":
            args[name] = bool(_pick(kv, 20 + i, 2))
        else:
            args[name] = tok.words[_pick(kv, 20 + i, len(tok.words))]
    return args
