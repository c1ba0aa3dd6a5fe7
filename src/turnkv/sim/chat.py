"""Chat rendering and output parsing for the simulated engine, the way vLLM does both.

Rendering: OpenAI messages through a Jinja chat template (sandboxed, ``trim_blocks`` and
``lstrip_blocks``, a ``tojson`` that keeps key order) into text, then token ids. Parsing: the
generated ids split into reasoning, content and tool calls by a streaming parser that works on
token ids, so the non-streaming and streaming answers are the same text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from turnkv.sim.tokenizer import IncrementalDetokenizer, Tokenizer

BUILTIN_TEMPLATES = ("keep", "strip")


class RenderError(ValueError):
    """The messages cannot be rendered (bad shape, unsupported content, template error)."""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=False)


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str, name: str = "custom") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self.name = name
        self.source = source
        self._template = env.from_string(source)

    @classmethod
    def load(cls, template: str = "keep", path: str | None = None) -> ChatTemplate:
        if path:
            return cls(Path(path).read_text(encoding="utf-8"), name=Path(path).stem)
        if template not in BUILTIN_TEMPLATES:
            raise ValueError(f"unknown template {template!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}")
        text = resources.files("turnkv.sim").joinpath("templates", f"{template}.jinja").read_text("utf-8")
        return cls(text, name=template)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise RenderError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        msgs = [_normalize_message(m) for m in messages]
        try:
            text = self._template.render(
                messages=msgs, tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, **dict(kwargs or {}),
            )
        except TemplateError as exc:
            raise RenderError(f"chat template error: {exc}") from exc
        except (TypeError, AttributeError, KeyError) as exc:
            raise RenderError(f"chat template could not render the messages: {exc}") from exc
        if continue_final_message and msgs:
            last = msgs[-1].get("content") or ""
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text


def _normalize_message(m: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise RenderError("each message must be an object with a string 'role'")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise RenderError("only text content parts are supported by this model")
            texts.append(str(part.get("text", "")))
        out["content"] = "\n".join(texts)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise RenderError("message content must be a string or a list of content parts")
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    out.pop("reasoning_content", None)
    out.pop("reasoning", None)
    if m.get("role") == "assistant":
        # vLLM hands templates both names with the same value
        out["reasoning"] = out["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls:
        norm = []
        for c in calls:
            fn = dict(c.get("function") or {}) if isinstance(c, Mapping) else {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args else {}
                except json.JSONDecodeError as exc:
                    raise RenderError(str(exc)) from exc
            fn["arguments"] = {} if args is None else args  # vLLM parses history arguments
            norm.append({**c, "function": fn})
        out["tool_calls"] = norm
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    index: int


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """Splits generated ids into reasoning, content and tool calls, one token at a time.

    As vLLM's Qwen3 reasoning parser and hermes tool parser do: reasoning is the raw text after
    ``<think>`` up to ``</think>`` (whitespace kept); parsing starts in reasoning unless the prompt
    already closed thinking; ``<tool_call>`` ... ``</tool_call>`` spans are JSON tool calls and text
    after the first one is not content.
    """

    def __init__(self, tok: Tokenizer, *, parse_tools: bool, thinking: bool) -> None:
        self._detok = IncrementalDetokenizer(tok)
        self._parse_tools = parse_tools
        self._mode = "reasoning" if thinking else "content"
        self._tool_text = ""
        self._seen_tool = False
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self._think = tok.special_id("<think>")
        self._end_think = tok.special_id("</think>")
        self._tool_open = tok.special_id("<tool_call>")
        self._tool_close = tok.special_id("</tool_call>")
        self._silent = {tok.special_id("<|im_end|>"), tok.special_id("<|endoftext|>")}

    def feed(self, token_id: int) -> Delta:
        d = Delta()
        if token_id in self._silent:
            return d
        if token_id == self._think:
            if self._mode == "content":
                self._emit(d, self._detok.push([token_id]))  # a second <think> is literal content
            return d
        if token_id == self._end_think:
            if self._mode == "reasoning":
                self._mode = "content"
            return d
        if self._parse_tools and token_id == self._tool_open and self._mode != "tool":
            self._mode, self._tool_text, self._seen_tool = "tool", "", True
            return d
        if self._parse_tools and token_id == self._tool_close and self._mode == "tool":
            self._finish_tool(d)
            self._mode = "after_tool"
            return d
        text = self._detok.push([token_id])
        if self._mode == "tool":
            self._tool_text += text
        elif self._mode != "after_tool":
            self._emit(d, text)
        return d

    def finish(self) -> Delta:
        d = Delta()
        tail = self._detok.flush()
        if self._mode == "tool":
            self._tool_text += tail
            self._finish_tool(d)  # an unclosed final call is still a call, if its JSON parses
        elif self._mode != "after_tool":
            self._emit(d, tail)
        return d

    def final_content(self) -> str | None:
        """Content as a non-streaming response reports it: None when empty or blank before a tool call."""
        if self.tool_calls and not self.content.strip():
            return None
        return self.content or None

    def _emit(self, d: Delta, text: str) -> None:
        if not text:
            return
        if self._mode == "reasoning":
            d.reasoning += text
            self.reasoning += text
        else:
            d.content += text
            self.content += text

    def _finish_tool(self, d: Delta) -> None:
        try:
            call = json.loads(self._tool_text)
            name = str(call["name"])
            args = call["arguments"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return
        tc = ToolCall(
            id=f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", name=name,
            arguments=json.dumps(args, ensure_ascii=False), index=len(self.tool_calls),
        )
        self.tool_calls.append(tc)
        d.tool_calls.append(tc)
