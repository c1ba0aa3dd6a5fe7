"""Messages API <-> chat completions: the chat request a Messages request becomes, and the Message a chat
answer becomes.

Request: ``system`` becomes a first system message; a user message's text and image blocks a user
message (one text block: a string; otherwise content parts, images as ``image_url``, base64 sources as
data URLs); each ``tool_result`` block a tool message (its text; ``is_error`` has no place in a chat
template and is not carried); an assistant message's ``thinking`` blocks its reasoning, its text blocks
its content and its ``tool_use`` blocks its tool calls (``input`` as JSON arguments): the message the
engine produced, so a history sent back renders to the tokens D computed. A final assistant message is
continued (``continue_final_message``), as Anthropic continues a prefilled answer. ``thinking`` turns the
model's thinking on or off (the chat template's ``enable_thinking``; ``budget_tokens`` is not enforced: the
answer is bounded by ``max_tokens``). ``cache_control`` marks are accepted and have no effect (prefix caching
is automatic). Every wrong or unsupported block is a 400 naming it (``messages.2.content.0.type``).

Answer: reasoning becomes a ``thinking`` block (with an empty signature: nothing signs it here), content a
``text`` block (not a template's blank lines before a tool call), each tool call a ``tool_use`` block
(arguments that are not a JSON object are kept as ``{"arguments": <text>}``); the finish reason Anthropic's
``stop_reason``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.errors import ClientError
from turnkv.gateway.messages.models import CountTokensBody, MessagesBody, ToolChoice
from turnkv.openai.answer import reasoning_of

Block = Mapping[str, Any]
_SERVER_TOOL = "server tools are not supported by turnkv: define the tool with name and input_schema"


def new_id(prefix: str = "msg") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(at: str, why: str) -> ClientError:
    return ClientError(f"{at}: {why}", param=at)


def _str(block: Block, key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise _bad(f"{at}.{key}", "Input should be a valid string")
    return value


def _blocks(content: str | Sequence[Any], at: str) -> list[tuple[str, Block]]:
    """(where, block) for each block of a content list; a string is one text block."""
    if isinstance(content, str):
        return [(at, {"type": "text", "text": content})]
    out = []
    for j, block in enumerate(content):
        where = f"{at}.{j}"
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _bad(where, "a content block is an object with a type")
        out.append((where, block))
    return out


def _image(block: Block, at: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise _bad(f"{at}.source", "Field required")
    if source.get("type") == "base64":
        media, data = _str(source, "media_type", f"{at}.source"), _str(source, "data", f"{at}.source")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": _str(source, "url", f"{at}.source")}}
    raise _bad(f"{at}.source.type", "turnkv takes images as base64 or url sources")


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: a string for one text part (as most clients send it), else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _tool_result(block: Block, at: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for where, part in _blocks(content, f"{at}.content"):
            if part["type"] != "text":
                raise _bad(f"{where}.type", f"{part['type']!r} in a tool result is not supported by turnkv")
            texts.append(_str(part, "text", where))
        text = "\n".join(texts)
    else:
        raise _bad(f"{at}.content", "Input should be a valid string or a list of content blocks")
    return {"role": "tool", "tool_call_id": _str(block, "tool_use_id", at), "content": text}


def _user(content: str | list[dict[str, Any]], at: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for where, block in _blocks(content, f"{at}.content"):
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _str(block, "text", where)})
        elif kind == "image":
            parts.append(_image(block, where))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(_tool_result(block, where))
        else:
            raise _bad(f"{where}.type", f"{kind!r} blocks in a user message are not supported by turnkv")
    if parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _arguments(value: Any, at: str) -> str:
    if not isinstance(value, Mapping):
        raise _bad(f"{at}.input", "Input should be a valid dictionary")
    return json.dumps(value, ensure_ascii=False)


def _assistant(content: str | list[dict[str, Any]], at: str) -> dict[str, Any]:
    texts: list[dict[str, Any]] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, block in _blocks(content, f"{at}.content"):
        kind = block["type"]
        if kind == "text":
            texts.append({"type": "text", "text": _str(block, "text", where)})
        elif kind == "thinking":
            thinking.append(_str(block, "thinking", where))
        elif kind == "redacted_thinking":
            continue  # nothing here makes it; nothing in it a template could show
        elif kind == "tool_use":
            fn = {"name": _str(block, "name", where), "arguments": _arguments(block.get("input"), where)}
            calls.append({"id": _str(block, "id", where), "type": "function", "function": fn})
        else:
            raise _bad(f"{where}.type", f"{kind!r} blocks in an assistant message are not supported by turnkv")
    m: dict[str, Any] = {"role": "assistant", "content": _content(texts) if texts else ""}
    if thinking:
        m["reasoning"] = "".join(thinking)
    if calls:
        m["tool_calls"] = calls
    return m


def _system(system: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(system, str):
        return system
    parts = []
    for where, block in _blocks(system, "system"):
        if block["type"] != "text":
            raise _bad(f"{where}.type", "a system prompt holds text blocks")
        parts.append({"type": "text", "text": _str(block, "text", where)})
    return _content(parts)


def chat_messages(req: MessagesBody | CountTokensBody) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages; a bad block is a 400 naming it."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _system(req.system)})
    for i, m in enumerate(req.messages):
        at = f"messages.{i}"
        if m.role == "user":
            out += _user(m.content, at)
        else:
            out.append(_assistant(m.content, at))
    if not req.messages:
        raise _bad("messages", "at least one message is required")
    return out


def _tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        at = f"tools.{i}"
        if not isinstance(t, Mapping):
            raise _bad(at, "a tool is an object")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"{at}.type", f"{t.get('type')!r}: {_SERVER_TOOL}")
        schema = t.get("input_schema")
        if not isinstance(schema, Mapping):
            raise _bad(f"{at}.input_schema", "Field required")
        fn: dict[str, Any] = {"name": _str(t, "name", at), "parameters": dict(schema)}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if not choice.name:
            raise _bad("tool_choice.name", "Field required when type is 'tool'")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_body(req: MessagesBody | CountTokensBody) -> dict[str, Any]:
    """The chat completions request for ``req``."""
    messages = chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if messages[-1]["role"] == "assistant":  # a prefilled answer: continued, not answered anew
        body.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(req, MessagesBody):
        body["max_tokens"] = req.max_tokens
        body["stream"] = bool(req.stream)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.top_k:
            body["top_k"] = req.top_k
    return body


# answers


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as ``tool_use.input`` (an object, as Anthropic's API promises)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def stop_reason(finish: str | None, matched: Any, stops: Sequence[str] | None, calls: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) for a chat finish reason and vLLM's ``stop_reason`` (the stop
    string that ended the answer, if any)."""
    if finish == "length":
        return "max_tokens", None
    if calls or finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    if finish == "content_filter":
        return "refusal", None
    return "end_turn", None


def usage(chat: Mapping[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from a cache (``cache_read_input_tokens``)."""
    chat = chat if isinstance(chat, Mapping) else {}
    prompt = int(chat.get("prompt_tokens") or 0)
    cached = int((chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": int(chat.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def shows_text(content: Any, calls: bool) -> bool:
    """Whether an answer's text is a text block: not a template's blank lines before a tool call."""
    return (isinstance(content, str) and bool(content.strip())) or not calls


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as content blocks."""
    out: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if isinstance(reasoning, str) and reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    content = message.get("content")
    if shows_text(content, bool(calls)):
        out.append({"type": "text", "text": content if isinstance(content, str) else ""})
    for c in calls:
        fn = c.get("function") or {}
        out.append(
            {
                "type": "tool_use",
                "id": str(c.get("id") or new_id("toolu")),
                "name": str(fn.get("name", "")),
                "input": tool_input(str(fn.get("arguments") or "")),
            }
        )
    return out


@dataclass
class Reply:
    """The parts of a Message that are not its content."""

    msg_id: str
    model: str
    stops: Sequence[str] | None = None
    usage: dict[str, int] = field(default_factory=lambda: usage(None))

    def message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage,
        }


def message_object(reply: Reply, chat: Mapping[str, Any]) -> dict[str, Any]:
    """A chat completion as a Message."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    reply.usage = usage(chat.get("usage"))
    calls = bool(message.get("tool_calls"))
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), reply.stops, calls)
    return reply.message(content_blocks(message), reason, sequence)
