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
from datetime import datetime
from functools import cache
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


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template, in the environment transformers gives chat templates."""

    def __init__(self, source: str, name: str = "custom") -> None:
        # transformers utils/chat_template_utils.py: trim_blocks, lstrip_blocks, loopcontrols,
        # a tojson that keeps key order and default separators, raise_exception, strftime_now.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.name = name
        self.source = source
        self._template = env.from_string(source)

    @classmethod
    def load(cls, template: str = "keep", path: str | None = None) -> ChatTemplate:
        if path:
            return cls(Path(path).read_text(encoding="utf-8"), name=Path(path).stem)
        if template not in BUILTIN_TEMPLATES:
            raise ValueError(f"unknown template {template!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}")
        return _builtin(template)

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
                messages=msgs,
                tools=[_normalize_tool(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                **dict(kwargs or {}),
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
    if calls is not None and not calls:
        out.pop("tool_calls")  # vLLM removes an empty list
    elif calls:
        norm = []
        for c in calls:
            if not isinstance(c, Mapping) or c.get("type", "function") != "function":
                raise RenderError("tool_calls entries must be objects of type 'function'")
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args else {}
                except (json.JSONDecodeError, RecursionError) as exc:  # vLLM: a 400 (RecursionError is a RuntimeError)
                    raise RenderError(str(exc)) from exc
            fn["arguments"] = {} if args is None else args  # vLLM parses history arguments
            norm.append({**c, "function": fn})
        out["tool_calls"] = norm
    return out


def _normalize_tool(t: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as vLLM hands it to templates: ``ChatCompletionToolsParam.model_dump()``.

    ``description`` and ``parameters`` stay as None when omitted; ``strict`` and ``defer_loading``
    are dropped when None; other keys are kept after the declared ones, as vLLM's request model keeps them.
    """
    if not isinstance(t, Mapping) or not isinstance(t.get("function"), Mapping):
        raise RenderError("each tool must be an object with a 'function' object")
    fn = t["function"]
    declared = ("name", "description", "parameters", "strict", "defer_loading")
    f: dict[str, Any] = {
        "name": fn.get("name"),
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
    }
    for k in ("strict", "defer_loading"):
        if fn.get(k) is not None:
            f[k] = fn[k]
    f.update({k: v for k, v in fn.items() if k not in declared})
    out: dict[str, Any] = {"type": t.get("type", "function"), "function": f}
    if t.get("defer_loading") is not None:
        out["defer_loading"] = t["defer_loading"]
    out.update({k: v for k, v in t.items() if k not in ("type", "function", "defer_loading")})
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

    As vLLM's Qwen3 reasoning parser and hermes tool parser do: reasoning
    is the raw text after ``<think>`` up to ``</think>`` (whitespace kept), and ``<tool_call>`` also
    ends it; parsing starts in reasoning unless thinking is off; other special tokens are dropped.
    ``<tool_call>`` ... ``</tool_call>`` spans are JSON tool calls (an unclosed last one too) and
    text after the first one is not content. If any call fails to parse, the non-streaming answer
    has no tool calls and the whole post-reasoning text as content.
    """

    def __init__(self, tok: Tokenizer, *, parse_tools: bool, thinking: bool) -> None:
        self._detok = IncrementalDetokenizer(tok)
        self._parse_tools = parse_tools
        self._mode = "reasoning" if thinking else "content"
        self._tool_text = ""
        self._failed = False
        self._answer = ""  # everything after reasoning, tags included: what hermes parses
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self._think = tok.special_id("<think>")
        self._end_think = tok.special_id("</think>")
        self._tool_open = tok.special_id("<tool_call>")
        self._tool_close = tok.special_id("</tool_call>")
        terminals = {self._think, self._end_think, self._tool_open, self._tool_close}
        self._silent = set(tok.special_ids) - terminals
        self._tok = tok

    def feed(self, token_id: int) -> Delta:
        d = Delta()
        if token_id in self._silent:
            return d
        if token_id == self._think:
            if self._mode == "content":
                self._route(d, self._detok.push([token_id]))  # <think> after reasoning is literal content
            return d
        if token_id == self._end_think:
            if self._mode == "reasoning":
                self._mode = "content"
            return d
        if token_id == self._tool_open and self._mode == "reasoning":
            self._mode = "content"  # an implicit end of reasoning
        if self._parse_tools and token_id == self._tool_open and self._mode != "tool":
            self._answer += self._tok.token_text(token_id)
            self._mode, self._tool_text = "tool", ""
            return d
        if self._parse_tools and token_id == self._tool_close and self._mode == "tool":
            self._answer += self._tok.token_text(token_id)
            self._finish_tool(d)
            self._mode = "after_tool"
            return d
        text = self._detok.push([token_id])
        self._route(d, text)
        return d

    def finish(self) -> Delta:
        d = Delta()
        self._route(d, self._detok.flush())
        if self._mode == "tool":
            self._finish_tool(d)  # an unclosed final call is still a call, if its JSON parses
        return d

    def final_content(self, *, required: bool = False) -> str | None:
        """Content as a non-streaming response reports it.

        None when empty, or blank before tool calls; ``""`` instead of None when the request
        required a tool call (``tool_choice`` "required" or named).
        """
        if self._failed:
            content: str | None = self._answer or None
        elif self.tool_calls and not self.content.strip():
            content = None
        else:
            content = self.content or None
        return (content or "") if required else content

    def final_tool_calls(self) -> list[ToolCall]:
        return [] if self._failed else list(self.tool_calls)

    def _route(self, d: Delta, text: str) -> None:
        if self._mode == "tool":
            self._tool_text += text
        elif self._mode != "after_tool":
            self._emit(d, text)
        if self._mode != "reasoning":
            self._answer += text

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
            self._failed = True
            return
        tc = ToolCall(
            id=f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
            name=name,
            arguments=json.dumps(args, ensure_ascii=False),
            index=len(self.tool_calls),
        )
        self.tool_calls.append(tc)
        d.tool_calls.append(tc)


def count_reasoning_tokens(tok: Tokenizer, ids: Sequence[int]) -> int:
    """Output tokens strictly between ``<think>`` and ``</think>`` (0.33's ``reasoning_tokens``)."""
    start, end = tok.special_id("<think>"), tok.special_id("</think>")
    count = depth = 0
    for t in ids:
        if t == start:
            depth += 1
        elif t == end:
            depth = max(depth - 1, 0)
        elif depth:
            count += 1
    return count


@cache
def _builtin(template: str) -> ChatTemplate:
    """A built-in template, compiled once per process (a compiled template is immutable)."""
    text = resources.files("turnkv.sim").joinpath("templates", f"{template}.jinja").read_text("utf-8")
    return ChatTemplate(text, name=template)
