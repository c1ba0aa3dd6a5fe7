"""What a ``POST /v1/messages`` body may hold, checked before anything is translated.

Top-level fields are type-checked with pydantic as Anthropic's API does (unknown fields refused: ``x:
Extra inputs are not permitted``); a wrong one is a 400 naming it by path (``messages.0.content``).
Content blocks are checked as they are translated (``translate``). Features turnkv does not serve (server
tools, MCP servers, containers, context management) are refused by name rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from turnkv.errors import ClientError
from turnkv.gateway.body import Number


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: StrictInt | None = Field(None, ge=1)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Metadata(BaseModel):
    """Anthropic's ``user_id``; ``conversation_id`` or ``session_id`` name the conversation for turnkv, as
    on chat completions (``identity``)."""

    model_config = ConfigDict(extra="forbid")
    user_id: StrictStr | None = None
    conversation_id: StrictStr | None = None
    session_id: StrictStr | None = None


class MessagesBody(_Strict):
    model: StrictStr
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Message]
    system: StrictStr | list[dict[str, Any]] | None = None
    stream: StrictBool | None = False
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = Field(None, ge=0, le=1)
    top_p: Number | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    service_tier: StrictStr | None = None  # accepted: one tier here


class CountTokensBody(_Strict):
    """``POST /v1/messages/count_tokens``: what a message would be rendered from, no output settings."""

    model: StrictStr
    messages: list[Message]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# Messages API features turnkv does not serve: refused by name, never silently ignored
UNSUPPORTED = {
    "mcp_servers": "MCP servers are not supported by turnkv: run the tools on the client",
    "container": "containers are not supported by turnkv",
    "context_management": "context_management is not supported by turnkv",
}


def parse(body: dict[str, Any], model: type[MessagesBody] | type[CountTokensBody] = MessagesBody) -> Any:
    """The body checked as ``model``; a 400 naming the first wrong field, in Anthropic's words."""
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise ClientError(f"{name}: {why}", param=name)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(x) for x in err["loc"] if not _is_type_tag(x)]
        where = ".".join(loc)
        raise ClientError(f"{where}: {err['msg']}" if where else str(err["msg"]), param=where or None) from exc


def _is_type_tag(part: int | str) -> bool:
    """pydantic's union branch names in a location (``str``, ``list[dict[str,any]]``): not the client's."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[")))
