"""Reads and checks a client's request before any engine sees it: size, JSON, field types, model.

Known OpenAI fields are type-checked; unknown ones pass through to the engines, as vLLM accepts
its own extensions. Everything wrong here is a ``ClientError`` (a 4xx in OpenAI's shape).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.requests import Request

from turnkv.errors import BodyTooLarge, ClientError, ModelNotFound


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Common(_Open):
    model: str | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    return_token_ids: StrictBool | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    session_id: str | None = None
    conversation_id: str | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    raw = b""
    async for piece in request.stream():
        raw += piece
        if len(raw) > max_bytes:
            raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ClientError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    return body


def validate(body: dict[str, Any], model: type[_Common]) -> _Common:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"] if not _TYPE_TAG.match(str(x)))
        raise ClientError(f"{where}: {err['msg']}", param=where or None) from exc


def check_model(name: str | None, known: list[str]) -> None:
    if name is not None and known and name not in known:
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
