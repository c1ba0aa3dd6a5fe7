"""Responses API <-> chat completions: the chat request a Responses request becomes, and the Response
a chat answer becomes.

Input items become chat messages: ``instructions`` a first system message (not carried over from a
previous response, as in OpenAI's API), ``developer`` messages system messages, text parts text,
``function_call_output`` tool messages, and the items of one model answer (``reasoning``, then a
``message``, then ``function_call``s) one assistant message with its reasoning, content and tool
calls, which is the message the engine produced. A Response's output goes into the stored history
through the same translation, so ``previous_response_id`` and a client that sends the whole input
back (the OpenAI Agents SDK's default) give the engines the same prompt, token for token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.errors import ClientError
from turnkv.gateway.fields import shown
from turnkv.gateway.responses.models import NOT_FORWARDED, ResponsesBody
from turnkv.openai.answer import reasoning_of

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_STAGE = {"reasoning": 0, "message": 1, "function_call": 2}  # the order of one answer's items


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ClientError(f"Missing or invalid '{where}.{key}': expected a string.", param=f"{where}.{key}")
    return value


def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or parts when there are several or not only text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ClientError(f"Invalid '{where}': expected a string or a list of content parts.", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(part, Mapping):
            raise ClientError(f"Invalid '{at}': expected an object.", param=at)
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _str(part, "text", at)})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _str(part, "refusal", at)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ClientError(
                    f"'{at}': only images given by image_url are supported by turnkv.", param=f"{at}.image_url"
                )
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise ClientError(
                f"Invalid value for '{at}.type': {kind!r} is not supported by turnkv.", param=f"{at}.type"
            )
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _text_of(content: Any, where: str) -> str:
    c = _parts(content, where)
    if isinstance(c, str):
        return c
    if any(p["type"] != "text" for p in c):
        raise ClientError(f"Invalid '{where}': only text is supported here.", param=where)
    return "".join(str(p["text"]) for p in c)


@dataclass
class _Answer:
    """One assistant message being built from consecutive output items."""

    stage: int
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": "\n".join(self.content)}
        if self.reasoning:
            m["reasoning"] = "\n".join(self.reasoning)
        if self.calls:
            m["tool_calls"] = self.calls
        return m


def input_messages(items: str | Sequence[Any], *, where: str = "input") -> list[dict[str, Any]]:
    """Input items (or a string) as chat messages; a bad or unsupported item is a 400 naming it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    answer: _Answer | None = None

    def answering(stage: int) -> _Answer:
        nonlocal answer
        if answer is None or stage < answer.stage or (stage == answer.stage and stage < 2):
            if answer is not None:
                out.append(answer.message())
            answer = _Answer(stage)
        answer.stage = stage
        return answer

    def close() -> None:
        nonlocal answer
        if answer is not None:
            out.append(answer.message())
            answer = None

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise ClientError(f"Invalid '{at}': expected an object.", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ClientError(
                    f"Invalid value for '{at}.role': {role!r}; expected one of user, system, developer, assistant.",
                    param=f"{at}.role",
                )
            if role == "assistant":
                answering(_STAGE["message"]).content.append(_text_of(item.get("content"), f"{at}.content"))
                continue
            close()
            out.append({"role": ROLES[str(role)], "content": _parts(item.get("content"), f"{at}.content")})
        elif kind == "reasoning":
            texts = [p.get("text") for p in item.get("content") or [] if isinstance(p, Mapping)]
            if not texts:
                texts = [p.get("text") for p in item.get("summary") or [] if isinstance(p, Mapping)]
            if not all(isinstance(t, str) for t in texts):
                raise ClientError(f"Invalid '{at}': reasoning text must be strings.", param=f"{at}.content")
            text = "".join(str(t) for t in texts)
            if text:
                answering(_STAGE["reasoning"]).reasoning.append(text)
        elif kind == "function_call":
            call = {
                "id": _str(item, "call_id", at),
                "type": "function",
                "function": {"name": _str(item, "name", at), "arguments": _str(item, "arguments", at)},
            }
            answering(_STAGE["function_call"]).calls.append(call)
        elif kind == "function_call_output":
            close()
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", at), "content": text})
        else:
            raise ClientError(
                f"Invalid value for '{at}.type': {kind!r} is not supported by turnkv (supported: "
                "message, function_call, function_call_output, reasoning).",
                param=f"{at}.type",
            )
    close()
    return out


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
LIST_LIMITS = (1, 100, 20)  # a list page's least, most and default length (OpenAI's)


def input_items(items: str | Sequence[Any]) -> list[dict[str, Any]]:
    """A request's input (checked by ``input_messages``) as the items ``input_items`` lists: a string is one
    user message, a message's string content one text part, and each item has an id (its own, or a new one)."""
    given: Sequence[Any] = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
    out: list[dict[str, Any]] = []
    for item in given:
        d: dict[str, Any] = dict(item)
        kind = d.setdefault("type", "message")
        if kind == "message":
            if isinstance(d.get("content"), str):
                part = "output_text" if d.get("role") == "assistant" else "input_text"
                d["content"] = [{"type": part, "text": d["content"]}]
            d.setdefault("status", "completed")
        if not isinstance(d.get("id"), str):
            d["id"] = new_id(_ITEM_IDS.get(str(kind), "item"))
        out.append(d)
    return out


def item_page(items: Sequence[Mapping[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of ``items`` as OpenAI lists them: ``limit`` (1-100, default 20), ``order`` (``desc``, the
    default: the last item first; or ``asc``), ``after`` (an item id: the items that follow it in that order).
    A bad value is a 400 naming it."""
    least, most, default = LIST_LIMITS
    raw = query.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not least <= limit <= most:
        raise ClientError(f"Invalid 'limit': expected an integer from {least} to {most}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ClientError(f"Invalid 'order': {shown(order)!r}; expected 'asc' or 'desc'.", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise ClientError(f"Invalid 'after': no input item '{shown(after)}' in this response.", param="after")
        ordered = ordered[at + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if t.get("type") != "function":
            raise ClientError(
                f"Invalid value for '{at}.type': {t.get('type')!r}; turnkv serves function tools only.",
                param=f"{at}.type",
            )
        fn: dict[str, Any] = {"name": _str(t, "name", at)}
        for k in ("description", "parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ClientError(
        "Invalid value for 'tool_choice': turnkv supports auto, none, required and "
        '{"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = text.get("format") if text else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ClientError(f"Invalid value for 'text.format.type': {fmt.get('type')!r}.", param="text.format.type")


def chat_body(req: ResponsesBody, raw: Mapping[str, Any], conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request for ``req``, whose history (without instructions) is ``conversation``."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise ClientError("Invalid 'input': a response needs at least one input item.", param="input")
    body: dict[str, Any] = {k: v for k, v in raw.items() if k not in NOT_FORWARDED}
    body.update(messages=messages, stream=bool(req.stream))
    if req.model is not None:
        body["model"] = req.model
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    tools = _tools(req.tools)
    if tools:
        body["tools"] = tools
    choice = _tool_choice(req.tool_choice)
    if choice is not None:
        body["tool_choice"] = choice
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = _response_format(req.text.model_dump() if req.text else None)
    if fmt is not None:
        body["response_format"] = fmt
    return body


def usage(chat: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(chat, Mapping):
        return None
    prompt = int(chat.get("prompt_tokens") or 0)
    completion = int(chat.get("completion_tokens") or 0)
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
        "status": status,
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: Mapping[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """A chat completion's message as Response output items."""
    out: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if isinstance(reasoning, str) and reasoning:
        out.append(reasoning_item(reasoning))
    content = message.get("content")
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    if (isinstance(content, str) and content.strip()) or not calls:  # not a template's newlines before a call
        status = "incomplete" if finish_reason == "length" else "completed"
        out.append(message_item(content if isinstance(content, str) else "", status=status))
    for c in calls:
        fn = c.get("function") or {}
        out.append(
            call_item(str(c.get("id") or new_id("call")), str(fn.get("name", "")), str(fn.get("arguments") or ""))
        )
    return out


def response_object(
    resp_id: str,
    req: ResponsesBody,
    *,
    output: list[dict[str, Any]],
    status: str,
    created_at: float,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """A Response object, as OpenAI's API returns it."""
    tools = [
        {
            "type": "function",
            "name": t.get("name"),
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        for t in req.tools or []
    ]
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model or req.model or "",
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
        "store": req.store is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": req.text.model_dump(exclude_none=True) if req.text else {"format": {"type": "text"}},
        "tool_choice": choice,
        "tools": tools,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "metadata": req.metadata or {},
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
    }
