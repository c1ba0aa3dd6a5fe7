"""The tokens-only engine's routes: ``POST /inference/v1/generate`` and ``POST /abort_requests``.

A ``--tokens-only`` vLLM engine has no tokenizer: it takes a rendered ``GenerateRequest`` (token ids
and a ``SamplingParams`` dict, as a render service writes them) and answers with token ids, never
text. What this module decides, as vLLM's ``scale_out/token_in_token_out`` does:

* where the KV transfer params are read: 0.26-0.28 only from ``sampling_params.extra_args
  .kv_transfer_params`` (a top-level ``kv_transfer_params`` is ignored there); 0.29+ (compat
  ``0.33``) also from the top level, which wins;
* stop *strings*: 0.33 rejects them with a 400 (no detokenizer, so they would never match); 0.26
  accepts them and never applies them (its engine has no detokenizer to match them with);
* the answer's shape: a non-streamed body with the handle in ``kv_transfer_params``, or SSE chunks
  of ``token_ids`` with no ``kv_transfer_params`` in any of them (no vLLM version streams it),
  unless the simulated turnkv plugin is on: then the chunk that finishes the choice carries the
  handle, as turnkv's vLLM plugin makes a real engine's do.

The simulated model has no tokenizer-free way to know the request's tools; the render service
(``sim.render``) hands them over in ``sampling_params.extra_args.turnkv_sim`` (a real engine sees
them in the prompt and is constrained through structured outputs), so a turn's answer is the one
the chat route gives the same conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turnkv.sim.oracle import Sampling, opens_thinking
from turnkv.sim.requests import ApiError, check_model, internal_error, parse_body
from turnkv.sim.responses import DONE, error_body, error_event, random_uuid, sse
from turnkv.sim.sequence import EngineError, Output

if TYPE_CHECKING:
    from turnkv.sim.app import SimServer

SIM_EXTRA = "turnkv_sim"  # sampling_params.extra_args key: the request's tools, for the simulated model
TOKENS_ONLY_STOP_ERROR = (
    "stop strings are not supported on a --tokens-only server because detokenization is disabled. "
    "Check stop strings on the coordinator, or use stop_token_ids."
)
NO_TOKENIZER_ERROR = "Tokenizer not available when `skip_tokenizer_init=True`"


class SamplingBody(BaseModel):
    """The ``SamplingParams`` fields the simulator honours or checks; the rest are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingBody:
        # SamplingParams._verify_args, worded as vLLM words it
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if any(not s for s in self.stop_strings):
            raise ValueError("stop cannot contain an empty string.")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateBody(BaseModel):
    """vLLM's ``GenerateRequest``: unknown top-level fields (newer versions' ``parse_context``...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(default_factory=random_uuid)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingBody
    model: str | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool | None = None  # 0.32+

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


def kv_params_of(body: GenerateBody, compat: str) -> dict[str, Any] | None:
    """The KV transfer params the engine acts on, where this version reads them."""
    extra = body.sampling_params.extra_args or {}
    nested = extra.get("kv_transfer_params")
    nested = nested if isinstance(nested, dict) else None
    if compat == "0.26":
        return nested  # 0.26-0.28 never read the top-level field on generate
    return body.kv_transfer_params if body.kv_transfer_params is not None else nested


def sim_tools(body: GenerateBody) -> tuple[list[dict[str, Any]], Any]:
    """The tools and tool choice the render service passed on for the simulated model."""
    info = (body.sampling_params.extra_args or {}).get(SIM_EXTRA)
    if not isinstance(info, Mapping):
        return [], "none"
    tools = [t for t in info.get("tools") or [] if isinstance(t, dict)]
    choice = info.get("tool_choice", "auto" if tools else "none")
    return tools, choice


@dataclass
class _Request:
    body: GenerateBody
    prompt: list[int]
    sampling: Sampling
    kv: dict[str, Any] | None
    request_id: str  # as the engine knows it: ``generate-tokens-<id>``
    arrival: float  # when it was admitted (after a fault's delay)


class GenerateFormatter:
    """Bodies and SSE chunks of ``/inference/v1/generate``, key for key per compat level."""

    def __init__(self, *, compat: str, request_id: str, model: str, details: bool, plugin: bool) -> None:
        self.compat, self.request_id, self.model = compat, request_id, model
        self.details, self.plugin = details, plugin
        self.created = int(time.time())

    def _usage(self, prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
        details = {"cached_tokens": cached or 0} if self.details and cached is not None else None
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    def full(
        self,
        *,
        prompt: list[int],
        output: list[int],
        finish_reason: str,
        cached: int,
        kv: dict[str, Any] | None,
        return_ids: bool,
    ) -> dict[str, Any]:
        usage = self._usage(len(prompt), len(output), cached)
        if self.compat == "0.26":
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": output,
                "routed_experts": None,
            }
            return {
                "request_id": self.request_id,
                "model": self.model,
                "created": self.created,
                "choices": [choice],
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": kv,
                "ec_transfer_params": None,
            }
        choice = {
            "index": 0,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": output,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": None,
        }
        return {
            "request_id": self.request_id,
            "model": self.model,
            "created": self.created,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if return_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": kv,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def chunk(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        *,
        prompt_ids: list[int] | None,
        kv: dict[str, Any] | None,
    ) -> bytes:
        if self.compat == "0.26":
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
                "routed_experts": None,
            }
            c: dict[str, Any] = {"request_id": self.request_id, "choices": [choice], "usage": None}
        else:
            choice = {
                "index": 0,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": token_ids,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": None,
            }
            c = {"request_id": self.request_id, "usage": None}
            if prompt_ids is not None:
                c["prompt_token_ids"] = prompt_ids
            c.update(output_mode="tokens", choices=[choice])
        if self.plugin:
            # turnkv's vLLM plugin: the key on every token chunk, the handle on the finishing one
            c["kv_transfer_params"] = kv if finish_reason is not None else None
        return sse(c)

    def usage_chunk(self, prompt: int, completion: int, cached: int | None) -> bytes:
        usage = {k: v for k, v in self._usage(prompt, completion, cached).items() if v is not None}
        if self.compat == "0.26":
            return sse({"request_id": self.request_id, "choices": [], "usage": usage})
        return sse({"request_id": self.request_id, "usage": usage, "output_mode": "tokens", "choices": []})


class GenerateRoutes:
    """``/inference/v1/generate`` and ``/abort_requests`` of one simulated tokens-only engine."""

    def __init__(self, server: SimServer) -> None:
        self.s = server
        self._aborts: dict[str, asyncio.Event] = {}  # running requests by the id a client aborts them with

    def _validate(self, body: GenerateBody) -> tuple[list[int], int]:
        s = self.s
        check_model(body.model, s.settings.model)
        sp = body.sampling_params
        if sp.n != 1:
            raise ApiError(400, "the simulator supports n=1 only", param="n")
        if sp.stop_strings and s.settings.engine.compat != "0.26":
            raise ApiError(400, TOKENS_ONLY_STOP_ERROR)
        s.check_ids(body.token_ids)
        prompt = list(body.token_ids)
        limit = s.settings.engine.max_model_len
        if len(prompt) >= limit:
            raise ApiError(
                400,
                f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length of {limit}. "
                "Make sure that `max_model_len` is no smaller than the number of text tokens.",
                param="input_tokens",
            )
        room = limit - len(prompt)  # the engine stops at max_model_len ("length")
        given = sp.max_tokens if "max_tokens" in sp.model_fields_set else None
        return prompt, room if given is None else min(given, room)

    def _prepare(self, body: GenerateBody, request: Request) -> _Request:
        s = self.s
        prompt, limit = self._validate(body)
        tools, choice = sim_tools(body)
        sp = body.sampling_params
        sampling = Sampling(
            max_tokens=limit,
            min_tokens=min(sp.min_tokens, limit),
            ignore_eos=sp.ignore_eos,
            thinking=s.settings.thinking and opens_thinking(s.tok, prompt),
            drift=s.settings.retokenize_drift,
            tools=tools,
            tool_choice=choice,
        )
        base = request.headers.get("x-request-id") or body.request_id
        kv = kv_params_of(body, s.settings.engine.compat)
        return _Request(body, prompt, sampling, kv, f"generate-tokens-{base}", time.perf_counter())

    async def generate(self, request: Request) -> Response:
        s = self.s
        try:
            body = await parse_body(request, GenerateBody)
            req = self._prepare(body, request)
            req.arrival = await s._admit()
        except ApiError as exc:
            return exc.response()
        compat = s.settings.engine.compat
        fmt = GenerateFormatter(
            compat=compat,
            request_id=req.request_id,
            model=body.model or s.settings.model,
            details=s.settings.prompt_tokens_details,
            plugin=s.settings.turnkv_plugin,
        )
        return_ids = bool(body.return_token_ids) and compat != "0.26"
        if body.stream:
            return StreamingResponse(self._stream(req, fmt, return_ids), media_type="text/event-stream")
        out: list[int] = []
        try:
            async for o in self._outputs(req):
                out += o.token_ids
                if o.finish_reason is not None:
                    return JSONResponse(
                        fmt.full(
                            prompt=req.prompt,
                            output=out,
                            finish_reason=o.finish_reason,
                            cached=o.num_cached_tokens,
                            kv=o.kv_transfer_params,
                            return_ids=return_ids,
                        )
                    )
        except EngineError:
            pass
        return internal_error().response()

    async def _outputs(self, req: _Request) -> AsyncIterator[Output]:
        """The engine's outputs for ``req``; an abort (``/abort_requests``) ends it at its next output."""
        aborted = self._aborts.setdefault(req.request_id, asyncio.Event())
        try:
            async with contextlib.aclosing(
                self.s.engine.generate(
                    req.prompt, req.sampling, req.kv, req.request_id, req.arrival, req.body.cache_salt
                )
            ) as outputs:
                async for out in outputs:
                    if aborted.is_set():
                        yield Output([], "abort", None, 0)
                        return
                    yield out
                    if out.finish_reason is not None:
                        return
        finally:
            if self._aborts.get(req.request_id) is aborted:
                del self._aborts[req.request_id]

    async def _stream(self, req: _Request, fmt: GenerateFormatter, return_ids: bool) -> AsyncIterator[bytes]:
        completion = 0
        cached: int | None = None
        first = True
        opts = req.body.stream_options or {}
        drop = self.s.faults.take_drop()
        sent = 0
        try:
            async for o in self._outputs(req):
                if first:
                    cached = o.num_cached_tokens
                completion += len(o.token_ids)
                if not o.token_ids:
                    continue  # vLLM skips outputs with no new tokens (an abort's among them)
                if o.finish_reason is not None:
                    cached = o.num_cached_tokens
                yield fmt.chunk(
                    list(o.token_ids),
                    o.finish_reason,
                    prompt_ids=req.prompt if first and return_ids else None,
                    kv=o.kv_transfer_params,
                )
                first = False
                sent += 1
                if drop and sent >= self.s.faults.faults.drop_after_chunks:
                    raise ConnectionAbortedError("connection dropped by fault injection")
        except EngineError:
            yield error_event(fmt.compat, error_body("Internal server error", "InternalServerError", 500))
            yield DONE
            return
        if opts.get("include_usage"):
            yield fmt.usage_chunk(len(req.prompt), completion, cached)
        yield DONE

    async def abort(self, request: Request) -> Response:
        """``POST /abort_requests {"request_ids": [...]}``: each named running request ends now."""
        try:
            body = await request.json()
        except ValueError as exc:
            return JSONResponse({"detail": f"JSON decode error: {exc}"}, status_code=400)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return JSONResponse({"detail": "Missing 'request_ids' in request body"}, status_code=400)
        for rid in ids if isinstance(ids, list) else [ids]:
            for key in (str(rid), f"generate-tokens-{rid}"):
                event = self._aborts.get(key)
                if event is not None:
                    event.set()
        return Response(status_code=200)


async def no_tokenizer(request: Request) -> Response:
    """What a text route answers on a tokens-only engine (no tokenizer was loaded)."""
    return JSONResponse(error_body(NO_TOKENIZER_ERROR, "BadRequestError", 400), status_code=400)


TEXT_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/chat/completions/render",
    "/tokenize",
    "/detokenize",
)


def routes(server: SimServer) -> list[Route]:
    """The routes a ``--tokens-only`` engine adds, and the text routes it cannot serve."""
    r = GenerateRoutes(server)
    return [
        Route("/inference/v1/generate", r.generate, methods=["POST"]),
        Route("/abort_requests", r.abort, methods=["POST"]),
        Route("/inference/v1/abort_requests", r.abort, methods=["POST"]),
        *(Route(path, no_tokenizer, methods=["POST"]) for path in TEXT_ROUTES),
    ]
