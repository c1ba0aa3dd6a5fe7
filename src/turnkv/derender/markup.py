"""Splitting a model's streamed text into reasoning and content without parser markup, as it arrives.

``MarkupSplitter`` is turnkv's own incremental reading of the markers a render service's reasoning and
tool-call parsers act on (``Markup``: for vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser,
``<think>``/``</think>`` and ``<tool_call>``/``</tool_call>``). It is conservative by construction: text
is released only once no marker can still change what it is, so what it streams is a prefix of what the
render service's non-streaming derender says at the end, which stays the authority (``stream``):

* reasoning: the text before ``</think>`` (an opening ``<think>`` dropped) while the prompt left reasoning
  open, and a ``<tool_call>`` also ends it;
* content: the text after reasoning, held back while all of it is whitespace (a derender reports blank
  content before a tool call as none) and from the first ``<tool_call>`` on, for good (the tool calls,
  and what a parser does with text around them, come from the final derender);
* text that could be the start of a marker (``<``, ``</thi``) waits for the next piece; special-token
  texts the parsers drop (``<|im_end|>``) are dropped.

Pure and synchronous: no I/O, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class Markup:
    """The marker texts of a reasoning parser and a tool-call parser (None: that parser is not configured)."""

    think: tuple[str, str] | None = ("<think>", "</think>")
    tool: tuple[str, str] | None = ("<tool_call>", "</tool_call>")
    dropped: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")

    @property
    def markers(self) -> tuple[str, ...]:
        out: list[str] = [*self.dropped]
        if self.think:
            out += self.think
        if self.tool:
            out += self.tool
        return tuple(out)


# The parser names a render service is started with, and the markup turnkv reads for them.
REASONING_MARKUP = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}
TOOL_MARKUP = {"hermes": ("<tool_call>", "</tool_call>")}


def markup_for(reasoning_parser: str | None, tool_parser: str | None) -> Markup | None:
    """The markup of a parser pair, or None when turnkv has no incremental reading for one of them."""
    if reasoning_parser and reasoning_parser not in REASONING_MARKUP:
        return None
    if tool_parser and tool_parser not in TOOL_MARKUP:
        return None
    return Markup(
        think=REASONING_MARKUP[reasoning_parser] if reasoning_parser else None,
        tool=TOOL_MARKUP[tool_parser] if tool_parser else None,
    )


class Mode(enum.StrEnum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"  # from the first tool-call marker on: nothing more is streamed


@dataclass(frozen=True)
class Split:
    """What one piece of text released."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class MarkupSplitter:
    """Reasoning and content deltas from text pieces, markup held back (see the module docstring)."""

    def __init__(self, markup: Markup, *, reasoning_open: bool, parse_tools: bool) -> None:
        self.markup = markup
        self.parse_tools = parse_tools and markup.tool is not None
        self.mode = Mode.REASONING if (reasoning_open and markup.think) else Mode.CONTENT
        self._buf = ""  # text not yet looked at to its end: it may end with the start of a marker
        self._blank = ""  # content that is only whitespace so far, not yet released
        self.reasoning = ""  # released so far
        self.content = ""

    def feed(self, text: str) -> Split:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Split:
        """The end of the output: what no marker can follow any more is released (blank content still not)."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> Split:
        out: dict[Mode, list[str]] = {Mode.REASONING: [], Mode.CONTENT: []}
        while self._buf and self.mode is not Mode.TOOLS:
            hit = self._next_marker()
            if hit is None:
                keep = 0 if final else self._partial_tail()
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            at, marker = hit
            self._text(self._buf[:at], out)
            self._buf = self._buf[at + len(marker) :]
            self._marker(marker, out)
        if self.mode is Mode.TOOLS:
            self._buf = ""
        split = Split("".join(out[Mode.REASONING]), "".join(out[Mode.CONTENT]))
        self.reasoning += split.reasoning
        self.content += split.content
        return split

    def _text(self, text: str, out: dict[Mode, list[str]]) -> None:
        if not text or self.mode is Mode.TOOLS:
            return
        if self.mode is Mode.REASONING:
            out[Mode.REASONING].append(text)
            return
        if self.content or out[Mode.CONTENT]:
            out[Mode.CONTENT].append(text)
            return
        self._blank += text
        if self._blank.strip():  # not blank any more: a derender reports it as content whatever follows
            out[Mode.CONTENT].append(self._blank)
            self._blank = ""

    def _marker(self, marker: str, out: dict[Mode, list[str]]) -> None:
        m = self.markup
        if marker in m.dropped:
            return
        if m.think is not None and marker in m.think:
            if self.mode is Mode.REASONING:
                if marker == m.think[1]:
                    self.mode = Mode.CONTENT
            elif marker == m.think[0]:
                self._text(marker, out)  # a <think> after reasoning is text; a later </think> is dropped
            return
        assert m.tool is not None
        if marker == m.tool[0] and self.mode is Mode.REASONING:
            self.mode = Mode.CONTENT  # a tool call also ends reasoning
        if marker == m.tool[0] and self.parse_tools:
            self.mode = Mode.TOOLS
            return
        self._text(marker, out)  # not parsed here: the marker is text

    def _next_marker(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for marker in self.markup.markers:
            at = self._buf.find(marker)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker)
        return best

    def _partial_tail(self) -> int:
        """How many characters at the end of the buffer could begin a marker."""
        buf = self._buf
        longest = 0
        for marker in self.markup.markers:
            for n in range(min(len(marker) - 1, len(buf)), longest, -1):
                if buf.endswith(marker[:n]):
                    longest = n
                    break
        return longest
