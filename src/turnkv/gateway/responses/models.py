"""What a ``POST /v1/responses`` body may hold, checked before anything is translated.

Top-level fields are type-checked with pydantic; a wrong one is a 400 naming it as the Responses API
does (``input[2].content``). Features turnkv does not serve (built-in tools, ``background``, stored
prompts, the Conversations API) are refused by name rather than silently ignored. Fields that are
neither Responses fields nor refused pass through to the engines, as vLLM's own extensions
(``chat_template_kwargs``, ``top_k``...) do on chat completions.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from turnkv.errors import ClientError


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: StrictBool | None = False
    store: StrictBool | None = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    session_id: str | None = None
    conversation_id: str | None = None


# Responses API fields turnkv does not serve: refused, so a client never gets a silently different answer
UNSUPPORTED = {
    "background": "background responses are not supported by turnkv",
    "conversation": "the Conversations API is not supported by turnkv: use previous_response_id, or send the "
    "whole input",
    "prompt": "stored prompt templates are not supported by turnkv",
    "context_management": "context_management is not supported by turnkv",
}
# Responses API fields with nothing to do on a chat engine: accepted, not forwarded
NOT_FORWARDED = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "stream",
    "store",
    "reasoning",
    "text",
    "include",
    "metadata",
    "prompt_cache_key",
    "truncation",
    "user",
    "session_id",
    "conversation_id",
    "service_tier",
    "max_tool_calls",
    "safety_identifier",
    "prompt_cache_retention",
    "prompt_cache_options",
    "stream_options",
    "top_logprobs",
)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def param_of(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as the Responses API names parameters: ``input[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def parse(body: dict[str, Any]) -> ResponsesBody:
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], {}):
            raise ClientError(why, param=name)
    try:
        return ResponsesBody.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and _TYPE_TAG.match(x)))
        where = param_of(loc)
        raise ClientError(f"Invalid value for '{where}': {err['msg']}", param=where or None) from exc
