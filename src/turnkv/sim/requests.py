"""Request bodies the simulated engine accepts, and the 400s vLLM gives for bad ones.

Decides what is a valid request and how an invalid one is worded: pydantic schema failures as
FastAPI's validation handler words them, ``max_tokens`` and context-length checks as vLLM's
renderer words them, unknown model names as a 404.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from turnkv.sim.responses import error_body

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.status, self.param)
        return JSONResponse(body, status_code=self.status)


def internal_error() -> ApiError:
    """What a request finished with an error becomes: vLLM's ``GenerationError``."""
    return ApiError(500, "Internal server error", "InternalServerError")


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    n: int = 1
    cache_salt: str | None = None  # keys the prefix cache (vLLM: only requests with the same salt share it)


class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


async def json_body(request: Request) -> Any:
    """The request's JSON, any shape; unreadable JSON is vLLM's 400 (an ``ApiError``)."""
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "1 validation error:\n  JSON decode error", "Bad Request") from None


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object; unreadable JSON or another shape is vLLM's 400 (an ``ApiError``)."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "1 validation error:\n  Input should be a valid dictionary", "Bad Request")
    return body


async def parse_body(request: Request, model: type[M]) -> M:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"1 validation error:\n  JSON decode error: {exc}", "Bad Request") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "1 validation error:\n  Input should be a valid dictionary", "Bad Request")
    return validate(body, model)


def validate(body: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        lines = [str({**e, "loc": ("body", *e["loc"])}) for e in errs]
        param = "body." + ".".join(str(x) for x in errs[0]["loc"]) if errs else None
        n = len(errs)
        raise ApiError(
            400, f"{n} validation error{'s' if n > 1 else ''}:\n  " + "\n  ".join(lines), "Bad Request", param
        ) from exc


def check_model(name: str | None, served: str) -> None:
    if name and name != served:
        raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


def max_tokens(
    req: GenerationRequest,
    prompt_len: int,
    limit: int,
    *,
    param: str,
    value: int | None,
    default: int | None,
    text_prompt: bool,
) -> int:
    """The engine's ``max_tokens``, after vLLM's renderer and ``SamplingParams`` checks."""
    if value is not None and value > limit:
        raise ApiError(
            400,
            f"{param}={value} cannot be greater than max_model_len=max_total_tokens={limit}. "
            f"Please request fewer output tokens. (parameter={param}, value={value})",
            param=param,
        )
    max_input = limit - value if value else limit
    if prompt_len > max_input:
        # Text prompts are tokenized with truncation to max_input + 1, so vLLM reports "at least"
        # that many; token-id prompts report their exact length.
        n = min(prompt_len, max_input + 1) if text_prompt else prompt_len
        least = "at least " if n == max_input + 1 else ""
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{value or 0} output tokens and your prompt contains {least}{n} input tokens, for "
            f"a total of {least}{n + (value or 0)} tokens. Please reduce the length of the "
            f"input prompt or the number of requested output tokens. (parameter=input_tokens, "
            f"value={n})",
            param="input_tokens",
        )
    out = value if value is not None else (default if default is not None else limit - prompt_len)
    if out < 1:
        raise ApiError(
            400, f"max_tokens must be at least 1, got {out}. (parameter=max_tokens, value={out})", param="max_tokens"
        )
    if not 0 <= req.min_tokens <= out:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens={out}], got {req.min_tokens}.", param="min_tokens")
    return out
