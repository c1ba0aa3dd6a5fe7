"""Reads and checks a client's request before any engine sees it, and before its conversation's record is
claimed: size, time to arrive, JSON (depth, text encodable as UTF-8), field types, model, output length.

Every field that may reach the engines (``fields``: OpenAI's and vLLM's documented ones) is type-checked
strictly, as OpenAI and vLLM document it (``"40"`` is not an integer). Everything wrong here is a
``ClientError`` (a 4xx in OpenAI's shape); a body that stops arriving is a 408, a client gone mid-body a
``ClientGone``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import ClientDisconnect, Request

from turnkv import jsonwire
from turnkv.errors import BodyTooLarge, ClientError, ClientGone, ModelNotFound, RequestTimeout
from turnkv.gateway.fields import shown

Number = Annotated[float, Field(strict=True)]  # an int or a float, never a string or a bool


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Open):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class ResponseFormat(_Open):
    type: StrictStr


class FunctionDefinition(_Open):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Open):
    name: StrictStr


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


Int64 = Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)]


class _Common(_Open):
    """The fields both endpoints share (``fields`` says which reach the engines), each of the type OpenAI
    or vLLM documents: a wrong one is a 400 here, never a 500 or an engine's error after a prefill."""

    model: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt | None = Field(1, ge=1, le=128)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = None
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None
    response_format: ResponseFormat | None = None
    logprobs: StrictBool | StrictInt | None = None  # chat: a flag; completions: how many
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # vLLM's sampling parameters
    use_beam_search: StrictBool | None = None
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0)
    length_penalty: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    prompt_logprobs: StrictInt | None = Field(None, ge=-1)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    # structured outputs (and the guided_* fields of vLLM's releases before them)
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_token_ids: StrictBool | None = None
    add_special_tokens: StrictBool | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = None
    conversation_id: str | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    include_reasoning: StrictBool | None = None
    thinking_token_budget: StrictInt | None = None
    echo: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: StrictInt | None = Field(None, ge=1)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    prompt_embeds: StrictStr | list[StrictStr] | None = None


Body = TypeVar("Body", ChatBody, CompletionBody)
# what pydantic adds to an error's location besides field names: a union member's type or model class
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|literal\[.*\]|[A-Z][A-Za-z0-9]*)$")


# Lone surrogates can only come from a \uD800-\uDFFF escape or from their (invalid) UTF-8 bytes: orjson
# refuses both; the stdlib (kept for bodies with integers past 64 bits) lets them through, so its result
# is walked for them when the raw bytes may hold one.
_MAY_HOLD_SURROGATES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ERROR = "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"
# orjson reads an integer past 64 bits as a float: such a body is read again with the stdlib, exactly
_BIG = float(1 << 63)


async def _read(request: Request, max_bytes: int) -> bytes:
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > max_bytes:
            raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    return bytes(raw)


def check_tree(body: Any, max_depth: int, strings: bool) -> bool:
    """Refuse a body nested deeper than ``max_depth`` or (``strings``) holding text that UTF-8 cannot encode:
    either would fail later, in a validator, an encoder or an engine, as a 500. True when a number in it is
    a float of an integer's size past 64 bits (orjson's reading of a big integer)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    big = False
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                break
            stack.extend((v, depth + 1) for v in value.values())
            if strings:
                stack.extend((k, depth) for k in value)
        elif isinstance(value, list):
            if depth > max_depth:
                break
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float):
            big = big or abs(value) >= _BIG
        elif strings and isinstance(value, str) and _SURROGATE.search(value):
            raise ClientError(_SURROGATE_ERROR)
    else:
        return big
    raise ClientError(f"request body is nested more than {max_depth} levels deep")


async def read_json(
    request: Request, max_bytes: int, *, timeout_s: float | None = None, max_depth: int = 64
) -> dict[str, Any]:
    """The body as a JSON object, read within ``timeout_s`` (408 past it)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ClientError(
            f"Content-Encoding {shown(encoding)!r} is not supported: send the request body uncompressed",
            param="content-encoding",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"request body exceeds {max_bytes} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _read(request, max_bytes)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientGone("the client disconnected before its request body arrived") from None
    try:
        body: Any = jsonwire.loads(raw)
    except ValueError as exc:
        text = str(exc)
        if "not valid UTF-8" in text:
            raise ClientError(_not_utf8(raw)) from None
        if "surrogate" in text:
            raise ClientError(_SURROGATE_ERROR) from None
        if text.startswith("depth limit"):
            raise ClientError(f"request body is nested more than {max_depth} levels deep") from None
        raise ClientError(f"request body is not valid JSON: {text}") from None
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object")
    if check_tree(body, max_depth, strings=False):
        return _stdlib_read(raw, max_depth)
    return body


def _not_utf8(raw: bytes) -> str:
    """Why a body orjson found not to be UTF-8 is not text: compressed, a surrogate's bytes, or the first
    byte that is not UTF-8."""
    if raw.startswith(b"\x1f\x8b"):
        return "request body is gzip-compressed: send it uncompressed (Content-Encoding is not supported)"
    if re.search(rb"\xed[\xa0-\xbf]", raw):
        return _SURROGATE_ERROR
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        return f"request body is not valid UTF-8 (byte {exc.start})"
    return "request body is not valid UTF-8"


def _stdlib_read(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as the stdlib reads it (integers of any size), for the rare body orjson would round."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ClientError(f"request body is nested more than {max_depth} levels deep") from None
    except ValueError as exc:
        raise ClientError(f"request body is not valid JSON: {exc}") from None
    assert isinstance(body, dict)  # orjson read the same bytes as an object
    check_tree(body, max_depth, strings=_MAY_HOLD_SURROGATES.search(raw) is not None)
    return body


def validate(body: dict[str, Any], model: type[Body]) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = shown(".".join(str(x) for x in err["loc"] if not _TYPE_TAG.match(str(x))))
        raise ClientError(f"{where}: {err['msg']}", param=where or None) from exc


def check_model(name: str | None, known: list[str]) -> None:
    if name is not None and known and name not in known:
        raise ModelNotFound(f"The model `{shown(name)}` does not exist.", param="model")


def check_output_length(body: Mapping[str, Any], model_len: int | None) -> None:
    """Refuse an output length the model's context cannot hold with any prompt, before any engine work (vLLM
    would refuse it too, but only after a render, a prefill and a pull)."""
    if model_len is None:
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and value >= model_len:
            raise ClientError(
                f"{field}={value} leaves no room for a prompt: the model's context length is "
                f"{model_len} tokens. Please request fewer output tokens.",
                param=field,
            )
