"""vLLM-shaped response bodies and SSE chunks, key for key, for the two compat levels.

Full bodies carry every field (nulls included); stream chunks carry exactly the keys vLLM sets,
in vLLM's field order, as compact JSON (held to recordings of vLLM: tests/compat). 0.33 adds ``kv_transfer_params``
to stream chunks (``null`` except on the chunk that has a ``finish_reason``), ``weight_versions``
on that chunk, and ``completion_tokens_details`` to usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.sim.chat import Delta, ToolCall


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def error_event(compat: str, body: dict[str, Any]) -> bytes:
    """The mid-stream error event; 0.26 writes this one event with ``json.dumps`` defaults."""
    if compat == "0.26":
        return f"data: {json.dumps(body)}\n\n".encode()
    return sse(body)


def random_uuid() -> str:
    return uuid.uuid4().hex[:16]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(
    prompt: int, completion: int, cached: int | None = None, details: bool = False, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """Usage as a stream chunk writes it: null members left out."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": cached or 0}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def full_usage(
    prompt: int, completion: int, cached: int, *, details: bool, compat: str, reasoning_tokens: int | None
) -> dict[str, Any]:
    """Usage as a full body writes it: every field, nulls included."""
    u = usage(prompt, completion)
    u["prompt_tokens_details"] = (
        {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None} if details else None
    )
    if compat == "0.33":
        u["completion_tokens_details"] = None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    return u


def _tool_call_full(tc: ToolCall) -> dict[str, Any]:
    return {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}


@dataclass
class ChatFormatter:
    request_id: str
    model: str
    compat: str
    fingerprint: str
    return_token_ids: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens_details: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    def _usage(self, chunk: dict[str, Any], prompt: int, completion: int) -> None:
        if self.include_usage and self.continuous_usage:
            chunk["usage"] = usage(prompt, completion)

    def role_chunk(self, prompt_ids: Sequence[int]) -> bytes:
        c = self._head()
        c["choices"] = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]
        self._usage(c, len(prompt_ids), 0)
        c["prompt_token_ids"] = list(prompt_ids) if self.return_token_ids else None
        c["prompt_text"] = None
        return sse(c)

    def token_chunk(
        self,
        delta: Delta,
        token_ids: Sequence[int],
        prompt: int,
        completion: int,
        *,
        finish_reason: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> bytes | None:
        d = _delta(delta)
        if not d and finish_reason is None and not self.return_token_ids:
            return None
        choice: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = list(token_ids) if self.return_token_ids else None
        if finish_reason is not None and self.compat == "0.33":
            choice["weight_versions"] = None
        c = self._head()
        c["choices"] = [choice]
        self._usage(c, prompt, completion)
        if finish_reason is not None and not self.include_usage:
            c["system_fingerprint"] = self.fingerprint
        if self.compat == "0.33":
            c["kv_transfer_params"] = kv_transfer_params if finish_reason is not None else None
        return sse(c)

    def usage_chunk(self, prompt: int, completion: int, cached: int, reasoning_tokens: int) -> bytes:
        c = self._head()
        c["choices"] = []
        c["usage"] = usage(
            prompt, completion, cached, self.prompt_tokens_details, reasoning_tokens if self.compat == "0.33" else None
        )
        c["system_fingerprint"] = self.fingerprint
        return sse(c)

    def full(
        self,
        *,
        content: str | None,
        reasoning: str | None,
        tool_calls: Sequence[ToolCall],
        finish_reason: str,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        cached: int,
        reasoning_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if tool_calls:
            message["tool_calls"] = [_tool_call_full(tc) for tc in tool_calls]
        message["reasoning"] = reasoning
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": list(output_ids) if self.return_token_ids else None,
            "routed_experts": None,
        }
        if self.compat == "0.33":
            choice["weight_versions"] = None
        u = full_usage(
            len(prompt_ids),
            len(output_ids),
            cached,
            details=self.prompt_tokens_details,
            compat=self.compat,
            reasoning_tokens=reasoning_tokens,
        )
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": u,
            "prompt_logprobs": None,
            "prompt_token_ids": list(prompt_ids) if self.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }


def _delta(delta: Delta) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if delta.tool_calls:
        d["content"] = delta.content or None
    elif delta.content:
        d["content"] = delta.content
    if delta.reasoning:
        d["reasoning"] = delta.reasoning
    if delta.tool_calls:
        calls: list[dict[str, Any]] = []
        for tc in delta.tool_calls:
            calls.append({"id": tc.id, "type": "function", "index": tc.index, "function": {"name": tc.name}})
            calls.append({"index": tc.index, "function": {"arguments": tc.arguments}})
        d["tool_calls"] = calls
    return d


@dataclass
class CompletionFormatter:
    request_id: str
    model: str
    compat: str
    fingerprint: str
    return_token_ids: bool
    include_usage: bool
    prompt_tokens_details: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(
        self,
        text: str,
        token_ids: Sequence[int],
        prompt_ids: Sequence[int] | None,
        *,
        finish_reason: str | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> bytes:
        show_prompt = self.return_token_ids and prompt_ids is not None
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_token_ids": list(prompt_ids) if show_prompt and prompt_ids is not None else None,
            "token_ids": list(token_ids) if self.return_token_ids else None,
        }
        c: dict[str, Any] = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if finish_reason is not None and not self.include_usage:
            c["system_fingerprint"] = self.fingerprint
        if self.compat == "0.33":
            choice["weight_versions"] = None
            c["kv_transfer_params"] = kv_transfer_params if finish_reason is not None else None
        return sse(c)

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> bytes:
        return sse(
            {
                "id": self.request_id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt, completion, cached, self.prompt_tokens_details),
                "system_fingerprint": self.fingerprint,
            }
        )

    def full(
        self,
        *,
        text: str,
        finish_reason: str,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        cached: int,
        kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        u = full_usage(
            len(prompt_ids),
            len(output_ids),
            cached,
            details=self.prompt_tokens_details,
            compat=self.compat,
            reasoning_tokens=None,
        )  # no reasoning parser on completions
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": list(output_ids) if self.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(prompt_ids) if self.return_token_ids else None,
            "routed_experts": None,
        }
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": u,
            "kv_transfer_params": kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }
