"""Derender for the simulated render service: a tokens-only engine's output ids back into OpenAI answers.

Decides what ``POST /v1/chat/completions/derender`` and ``/v1/completions/derender`` answer, in the
shapes of vLLM 0.26 (non-streaming only) and 0.33/0.34 (non-streaming, and streaming with the client
carrying ``stream_state``), read from vLLM's ``scale_out/derender`` and ``renderers/online_derenderer``:

* 0.26 takes ``prompt_tokens`` (a count) and, when a parser is configured, needs ``chat_request`` or
  it falls back to plain detokenization; its tool calls have a bare uuid as id and its
  ``finish_reason`` stays the engine's (no ``tool_calls``); ``tool_calls`` is always a list.
* 0.33 takes ``prompt_token_ids`` (and seeds decoding with them), refuses a parser-configured call
  without ``chat_request`` (plain detokenization would leak parser markup), drops the stop token,
  and reports ``finish_reason: "tool_calls"`` when a call was made.
* Streaming (0.33): one call per generate chunk, ``{chunk, stream_state}`` back. The server keeps
  nothing: every call rebuilds the parser and replays every earlier chunk through it, so a stream's
  cost grows with the square of its length; that replay is done here for real (``replay``).

Reasoning, content and tool calls come from the simulator's own parser (``chat.OutputParser``), the one
the chat route uses, so a derendered answer is the chat route's answer for the same ids.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from turnkv.sim.chat import Delta, OutputParser, ToolCall
from turnkv.sim.oracle import opens_thinking
from turnkv.sim.requests import ApiError, ChatRequest, validate
from turnkv.sim.responses import random_uuid
from turnkv.sim.tokenizer import Tokenizer

STREAM_STOP_ERROR = (
    "stop strings are not supported by streaming derender because text already sent cannot be cut. "
    "Use non-streaming derender or output_mode=text on /inference/v1/generate which holds stop strings back."
)
NEEDS_CHAT_REQUEST = (
    "chat_request is required when a tool or reasoning parser is configured because plain detokenization "
    "would leak raw parser markup into content."
)
NEEDS_PROMPT_IDS = (
    "prompt_token_ids is required when a tool or reasoning parser is configured. Without it parse_delta cannot "
    "tell whether the prompt left reasoning open (e.g. a chat template that pre-opens <think>) and would "
    "misclassify reasoning content as plain content."
)


class GenChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    index: int = 0
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None


class GenAnswer(BaseModel):
    """A generate response or one streamed chunk of it, as derender reads it."""

    model_config = ConfigDict(extra="allow")
    request_id: str = Field(default_factory=random_uuid)
    choices: list[GenChoice]
    kv_transfer_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None


class Derender026(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    generate_response: GenAnswer
    prompt_tokens: int | None = None
    chat_request: dict[str, Any] | None = None


class Derender033(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = False
    generate_response: GenAnswer
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


class DerenderStream(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    stream: bool = True
    generate_chunk: GenAnswer
    stream_state: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


class StreamState(BaseModel):
    """What the client carries between streaming derender calls (vLLM's ``DerenderStreamState``)."""

    prev_tokens: list[str] = Field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    role_sent: bool = False
    logprob_context_token_ids: list[int] = Field(default_factory=list)
    logprob_text_offset: int = 0
    output_token_ids: list[int] = Field(default_factory=list)
    output_chunk_lens: list[int] = Field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Parsers:
    """The parsers the render service was started with (``--reasoning-parser``, ``--tool-call-parser``)."""

    reasoning: bool = True
    tools: bool = True

    @property
    def any(self) -> bool:
        return self.reasoning or self.tools


def thinking_of(req: ChatRequest) -> bool:
    """Whether the reasoning parser starts in reasoning, from the request's template kwargs (qwen3)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = req.reasoning_effort != "none"
    return kwargs.get("enable_thinking", True) is not False


def tool_choice_of(req: ChatRequest) -> Any:
    return req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")


@dataclass
class Parsed:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    named: bool


@dataclass
class Derenderer:
    """Derender logic of one render service: its tokenizer, parsers and vLLM version."""

    tok: Tokenizer
    parsers: Parsers
    compat: str
    max_model_len: int
    replayed_tokens: int = 0  # tokens fed through a parser again by streaming calls (the quadratic part)
    _created: int = field(default_factory=lambda: int(time.time()))

    # -- parsing ---------------------------------------------------------------------------------
    def parser(self, req: ChatRequest | None, *, thinking: bool) -> OutputParser:
        tools = req is not None and self.parsers.tools and bool(req.tools) and tool_choice_of(req) != "none"
        return OutputParser(self.tok, parse_tools=tools, thinking=self.parsers.reasoning and thinking)

    def parse(self, ids: Sequence[int], finish: str | None, req: ChatRequest | None, thinking: bool) -> Parsed:
        """A whole output, as non-streaming derender parses it."""
        if req is None or not self.parsers.any:
            text = self.tok.decode(ids, skip_special_tokens=True)
            return Parsed(None, text, [], finish, False)
        p = self.parser(req, thinking=thinking)
        for t in ids:
            p.feed(t)
        p.finish()
        choice = tool_choice_of(req)
        named = isinstance(choice, dict)
        calls = p.final_tool_calls()
        reasoning = (p.reasoning or None) if _include_reasoning(req) else None
        return Parsed(reasoning, p.final_content(required=named or choice == "required"), calls, finish, named)

    # -- non-streaming ---------------------------------------------------------------------------
    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.compat == "0.26":
            b26 = validate(body, Derender026)
            return self._chat(b26.model, b26.generate_response, b26.prompt_tokens, None, b26.chat_request)
        b = validate(body, Derender033)
        if self.parsers.any and b.chat_request is None:
            raise ApiError(400, NEEDS_CHAT_REQUEST)
        self._check_prompt(b.prompt_token_ids)
        return self._chat(b.model, b.generate_response, b.prompt_tokens, b.prompt_token_ids, b.chat_request)

    def _check_prompt(self, ids: list[int] | None) -> None:
        if ids is not None and len(ids) > self.max_model_len:
            raise ApiError(400, f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({self.max_model_len}).")

    def _bounds(self, gen: GenAnswer) -> None:
        for ch in gen.choices:
            if ch.token_ids and len(ch.token_ids) > self.max_model_len:
                raise ApiError(
                    400,
                    f"token_ids length ({len(ch.token_ids)}) in choice {ch.index} exceeds "
                    f"max_model_len ({self.max_model_len}).",
                )

    def _chat(
        self,
        model: str | None,
        gen: GenAnswer,
        prompt_tokens: int | None,
        prompt_ids: list[int] | None,
        chat_request: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self._bounds(gen)
        req = validate(chat_request, ChatRequest) if chat_request is not None else None
        choices = []
        completion = 0
        for ch in gen.choices:
            if not ch.token_ids:
                raise ApiError(400, f"choice {ch.index} has empty or null token_ids")
            completion += len(ch.token_ids)
            thinking = thinking_of(req) if req is not None else True
            parsed = self.parse(ch.token_ids, ch.finish_reason, req, thinking)
            choices.append(self._full_choice(ch.index, parsed))
        prompt = prompt_tokens or 0
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        if self.compat == "0.26":
            usage["prompt_tokens_details"] = None
            return {
                "id": gen.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "kv_transfer_params": gen.kv_transfer_params,
            }
        usage["completion_tokens_details"] = None
        return {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": gen.kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _call_id(self) -> str:
        return uuid.uuid4().hex if self.compat == "0.26" else f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"

    def _full_choice(self, index: int, p: Parsed) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": p.content,
            "refusal": None,
            "audio": None,
            "function_call": None,
        }
        calls = [
            {"id": self._call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in p.tool_calls
        ]
        if calls or self.compat == "0.26":
            message["tool_calls"] = calls
        message["reasoning"] = p.reasoning
        finish = p.finish_reason
        if self.compat != "0.26" and calls and not p.named:
            finish = "tool_calls"
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
        }
        if self.compat != "0.26":
            choice.update(routed_experts=None, weight_versions=None)
        return choice

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        gens = body.get("generate_responses") if isinstance(body, dict) else None
        if not isinstance(gens, list) or not gens:
            raise ApiError(400, "generate_responses must not be empty")
        answers = [validate(g, GenAnswer) for g in gens]
        prompts = body.get("prompt_tokens") or [0] * len(answers)
        if not isinstance(prompts, list) or len(prompts) != len(answers):
            raise ApiError(400, "prompt_tokens length must equal generate_responses length")
        choices: list[dict[str, Any]] = []
        completion = 0
        for gen in answers:
            self._bounds(gen)
            for ch in gen.choices:
                if not ch.token_ids:
                    raise ApiError(400, f"choice {ch.index} in response {gen.request_id} has empty or null token_ids")
                completion += len(ch.token_ids)
                choices.append(
                    {
                        "index": len(choices),
                        "text": self.tok.decode(ch.token_ids, skip_special_tokens=True),
                        "logprobs": None,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "token_ids": None,
                    }
                )
        prompt = sum(int(p) for p in prompts)
        return {
            "id": answers[0].request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion},
            "kv_transfer_params": answers[0].kv_transfer_params,
        }

    # -- streaming (0.33) -------------------------------------------------------------------------
    def chat_stream(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
        """One streaming call: the chunk, the new state, and how many earlier tokens it replayed."""
        b = validate(body, DerenderStream)
        req = validate(b.chat_request, ChatRequest) if b.chat_request is not None else None
        if req is not None and req.model_extra and req.model_extra.get("stop"):
            raise ApiError(400, STREAM_STOP_ERROR)
        if self.parsers.any and req is None:
            raise ApiError(400, NEEDS_CHAT_REQUEST)
        if self.parsers.any and b.prompt_token_ids is None:
            raise ApiError(400, NEEDS_PROMPT_IDS)
        if len(b.generate_chunk.choices) > 1:
            raise ApiError(
                400, f"derender_chat_stream expects at most one choice per chunk (got {len(b.generate_chunk.choices)})."
            )
        try:
            state = StreamState.model_validate(b.stream_state or {})
        except ValueError as exc:
            raise ApiError(400, "invalid stream_state: derender failed") from exc
        prompt = b.prompt_token_ids or []
        choice = b.generate_chunk.choices[0] if b.generate_chunk.choices else GenChoice(finish_reason=None)
        new = list(choice.token_ids or [])
        total = len(prompt) + len(state.output_token_ids) + len(new)
        if total > self.max_model_len:
            raise ApiError(
                400,
                f"prompt_token_ids length ({len(prompt)}) plus output_token_ids length "
                f"({len(state.output_token_ids)}) plus delta ({len(new)}) exceeds "
                f"max_model_len ({self.max_model_len}).",
            )
        if sum(state.output_chunk_lens) != len(state.output_token_ids):
            raise ApiError(400, "invalid stream_state: derender failed")
        delta, calls = self._replay(state, new, choice.finish_reason, req, prompt)
        chunk = self._stream_chunk(b, state, delta, calls, choice.finish_reason, req)
        replayed = len(state.output_token_ids)
        state.output_token_ids += new
        state.output_chunk_lens.append(len(new))
        state.role_sent = True
        state.tools_streamed = state.tools_streamed or bool(calls)
        state.last_tool_call_ids = [c.id for c in calls] or state.last_tool_call_ids
        return chunk, state.model_dump(), replayed

    def _replay(
        self, state: StreamState, new: list[int], finish: str | None, req: ChatRequest | None, prompt: list[int]
    ) -> tuple[Delta, list[ToolCall]]:
        """Rebuild the parser, feed it every earlier chunk again, then the new one: the delta it gives."""
        thinking = opens_thinking(self.tok, prompt) if prompt else True
        if req is None or not self.parsers.any:
            text = self.tok.decode(state.output_token_ids + new, skip_special_tokens=True)
            before = self.tok.decode(state.output_token_ids, skip_special_tokens=True)
            return Delta(content=text[len(before) :]), []
        p = self.parser(req, thinking=thinking)
        for t in state.output_token_ids:
            p.feed(t)
        self.replayed_tokens += len(state.output_token_ids)
        delta = Delta()
        for t in new:
            _merge(delta, p.feed(t))
        if finish is not None:
            _merge(delta, p.finish())
        ids = state.last_tool_call_ids
        for i, c in enumerate(p.tool_calls):  # the ids the client already saw stay the same
            if i < len(ids):
                c.id = ids[i]
        return delta, list(p.tool_calls)

    def _stream_chunk(
        self,
        b: DerenderStream,
        state: StreamState,
        delta: Delta,
        calls: list[ToolCall],
        finish: str | None,
        req: ChatRequest | None,
    ) -> dict[str, Any]:
        d: dict[str, Any] = {
            "role": None if state.role_sent else "assistant",
            "content": delta.content or None,
            "reasoning": delta.reasoning or None,
        }
        if delta.tool_calls:
            d["tool_calls"] = [
                {
                    "index": tc.index,
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments},
                }
                for tc in delta.tool_calls
            ]
        named = req is not None and isinstance(tool_choice_of(req), dict)
        if finish is not None and (calls or state.tools_streamed) and not named:
            finish = "tool_calls"
        return {
            "id": b.generate_chunk.request_id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": b.model,
            "choices": [
                {
                    "index": 0,
                    "delta": d,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": None,
                    "weight_versions": None,
                }
            ],
            "usage": None,
            "system_fingerprint": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "metrics": None,
            "kv_transfer_params": None,
        }


def _include_reasoning(req: ChatRequest) -> bool:
    extra = req.model_extra or {}
    return extra.get("include_reasoning", True) is not False


def _merge(into: Delta, d: Delta) -> None:
    into.reasoning += d.reasoning
    into.content += d.content
    into.tool_calls += d.tool_calls
