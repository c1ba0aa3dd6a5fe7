"""The simulated engine's HTTP surface: vLLM's OpenAI-compatible routes on a simulated engine.

Decides what each route answers: request validation and errors as vLLM words them, chat
rendering (or, under 0.33, ``kv_transfer_params.prompt_token_ids``), length checks, and how
engine output becomes a JSON body or an SSE stream. Faults are applied here, per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turnkv.sim.chat import ChatTemplate, Delta, OutputParser, RenderError
from turnkv.sim.engine import Engine, EngineError
from turnkv.sim.faults import FaultUpdate
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import Sampling
from turnkv.sim.responses import (
    DONE,
    ChatFormatter,
    CompletionFormatter,
    error_body,
    error_event,
    random_uuid,
)
from turnkv.sim.settings import SimSettings
from turnkv.sim.tokenizer import IncrementalDetokenizer, Tokenizer


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.status, self.param), status_code=self.status)


class DroppedByFault(Exception):
    """Raised inside a stream to cut the connection mid-response (fault injection)."""


class _Req(BaseModel):
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


class ChatRequest(_Req):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None


class CompletionRequest(_Req):
    prompt: str | list[int] | list[str] | list[list[int]]


@dataclass
class _Prepared:
    prompt: list[int]
    sampling: Sampling
    request_id: str
    arrival: float


class SimServer:
    """One simulated engine: settings, tokenizer, template, engine and faults."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.tok = Tokenizer()
        self.template = ChatTemplate.load(settings.template, settings.chat_template)
        self.metrics = EngineMetrics(settings.model)
        self.engine = Engine(settings.engine, self.tok, self.metrics)
        self.faults = settings.faults.model_copy()
        digest = hashlib.sha256(settings.model_dump_json().encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{settings.version}-{digest}"

    # -- helpers -----------------------------------------------------------------------------
    async def _json(self, request: Request, model: type[BaseModel]) -> Any:
        try:
            body = await request.json()
        except ValueError as exc:
            raise ApiError(400, f"1 validation error:\n  JSON decode error: {exc}", "Bad Request") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "1 validation error:\n  Input should be a valid dictionary", "Bad Request")
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            errs = exc.errors(include_url=False)
            lines = [str({**e, "loc": ("body", *e["loc"])}) for e in errs]
            param = "body." + ".".join(str(x) for x in errs[0]["loc"]) if errs else None
            n = len(errs)
            raise ApiError(400, f"{n} validation error{'s' if n > 1 else ''}:\n  " + "\n  ".join(lines),
                           "Bad Request", param) from exc

    def _check_model(self, name: str | None) -> None:
        if name and name != self.settings.model:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def _max_tokens(self, req: _Req, prompt_len: int, param: str, value: int | None, default: int | None) -> int:
        limit = self.settings.engine.max_model_len
        if value is not None:
            if value < 1:
                raise ApiError(400, f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, "
                                    f"value={value})", param="max_tokens")
            if value > limit:
                raise ApiError(400, f"{param}={value} cannot be greater than max_model_len=max_total_tokens="
                                    f"{limit}. Please request fewer output tokens. (parameter={param}, "
                                    f"value={value})", param=param)
        out = value if value is not None else (default if default is not None else limit - prompt_len)
        if prompt_len > limit - (value or 0) or out < 1:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{value or 0} output tokens and your prompt contains {prompt_len} input tokens, "
                                f"for a total of {prompt_len + (value or 0)} tokens. Please reduce the length of "
                                f"the input prompt or the number of requested output tokens. (parameter="
                                f"input_tokens, value={prompt_len})", param="input_tokens")
        if req.min_tokens < 0 or req.min_tokens > out:
            raise ApiError(400, f"min_tokens must be in [0, max_tokens], got {req.min_tokens}.", param="min_tokens")
        return out

    def _render(self, req: ChatRequest) -> tuple[list[int], bool]:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = req.reasoning_effort != "none"
        thinking = self.settings.thinking and kwargs.get("enable_thinking", True) is not False
        tools = None if req.tool_choice == "none" else req.tools
        try:
            text = self.template.render(
                req.messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, kwargs=kwargs)
        except RenderError as exc:
            raise ApiError(400, str(exc)) from exc
        return self.tok.encode(text), thinking

    def _prompt_ids(self, req: ChatRequest) -> tuple[list[int], bool]:
        ids, thinking = self._render(req)
        override = (req.kv_transfer_params or {}).get("prompt_token_ids")
        if override is not None and self.settings.engine.compat == "0.33":
            if not (isinstance(override, list) and override and all(isinstance(i, int) for i in override)):
                raise ApiError(400, "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
                               param="kv_transfer_params")
            self._check_ids(override)
            ids = list(override)
        return ids, thinking

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self.tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param="prompt")

    async def _admit(self, request: Request) -> float:
        arrival = time.perf_counter()
        delay = self.faults.delay_ms / 1e3 + self.settings.engine.costs.scaled(
            self.settings.engine.costs.api_overhead_s)
        if delay > 0:
            await asyncio.sleep(delay)
        if self.faults.take_failure():
            raise ApiError(500, "Internal server error", "InternalServerError")
        return arrival

    def _kv_params(self, req: _Req) -> dict[str, Any] | None:
        p = req.kv_transfer_params
        if p is None:
            return None
        return {k: v for k, v in p.items() if k != "prompt_token_ids"}

    # -- chat --------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        try:
            req: ChatRequest = await self._json(request, ChatRequest)
            self._check_model(req.model)
            if req.n != 1:
                raise ApiError(400, "the simulator supports n=1 only", param="n")
            prompt, thinking = self._prompt_ids(req)
            value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = self._max_tokens(req, len(prompt), param, value, None)
            arrival = await self._admit(request)
        except ApiError as exc:
            return exc.response()
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        sampling = Sampling(max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                            thinking=thinking, tools=req.tools or (), tool_choice=tool_choice,
                            drift=self.settings.retokenize_drift)
        rid = "chatcmpl-" + (request.headers.get("x-request-id") or random_uuid())
        opts = req.stream_options or {}
        fmt = ChatFormatter(
            request_id=rid, model=req.model or self.settings.model, compat=self.settings.engine.compat,
            fingerprint=self.fingerprint, return_token_ids=bool(req.return_token_ids),
            include_usage=bool(opts.get("include_usage")),
            continuous_usage=bool(opts.get("continuous_usage_stats")),
            prompt_tokens_details=self.settings.prompt_tokens_details)
        parse_tools = bool(req.tools) and tool_choice != "none"
        parser = OutputParser(self.tok, parse_tools=parse_tools, thinking=thinking)
        named = isinstance(tool_choice, dict)
        prep = _Prepared(prompt, sampling, rid, arrival)
        if req.stream:
            return StreamingResponse(self._chat_stream(prep, fmt, parser, self._kv_params(req), named),
                                     media_type="text/event-stream")
        out_ids: list[int] = []
        try:
            async for out in self.engine.generate(prompt, sampling, self._kv_params(req), rid, arrival):
                out_ids += out.token_ids
                for t in out.token_ids:
                    parser.feed(t)
                if out.finish_reason is not None:
                    parser.finish()
                    reason = "tool_calls" if parser.tool_calls and not named else out.finish_reason
                    return JSONResponse(fmt.full(
                        content=parser.final_content(), reasoning=parser.reasoning or None,
                        tool_calls=parser.tool_calls, finish_reason=reason, prompt_ids=prompt, output_ids=out_ids,
                        cached=out.num_cached_tokens, kv_transfer_params=out.kv_transfer_params))
        except EngineError:
            pass
        return ApiError(500, "Internal server error", "InternalServerError").response()

    async def _chat_stream(
        self, prep: _Prepared, fmt: ChatFormatter, parser: OutputParser, kv: dict[str, Any] | None, named: bool,
    ) -> AsyncIterator[bytes]:
        n_prompt = len(prep.prompt)
        completion = 0
        sent = 0
        started = False
        drop = self.faults.take_drop()
        try:
            async for out in self.engine.generate(prep.prompt, prep.sampling, kv, prep.request_id, prep.arrival):
                if not started:
                    started = True
                    yield fmt.role_chunk(prep.prompt)
                delta = Delta()
                for t in out.token_ids:
                    _merge(delta, parser.feed(t))
                completion += len(out.token_ids)
                reason = None
                if out.finish_reason is not None:
                    _merge(delta, parser.finish())
                    reason = "tool_calls" if parser.tool_calls and not named else out.finish_reason
                chunk = fmt.token_chunk(delta, out.token_ids, n_prompt, completion, finish_reason=reason,
                                        kv_transfer_params=out.kv_transfer_params)
                if chunk is not None:
                    yield chunk
                    sent += 1
                    if drop and sent >= self.faults.drop_after_chunks:
                        raise DroppedByFault("connection dropped by fault injection")
        except EngineError:
            if not started:
                yield fmt.role_chunk(prep.prompt)
            # 0.26 skips empty outputs before it checks for errors: a request that fails before
            # its first token ends the stream with no error event at all.
            if not (self.settings.engine.compat == "0.26" and completion == 0):
                yield error_event(fmt.compat, error_body("Internal server error", "InternalServerError", 500))
                yield DONE
                return
        if fmt.include_usage:
            yield fmt.usage_chunk(n_prompt, completion, 0)
        yield DONE

    # -- completions -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            req: CompletionRequest = await self._json(request, CompletionRequest)
            self._check_model(req.model)
            if req.n != 1:
                raise ApiError(400, "the simulator supports n=1 only", param="n")
            prompt = self._completion_prompt(req.prompt)
            max_tokens = self._max_tokens(req, len(prompt), "max_tokens", req.max_tokens, 16)
            arrival = await self._admit(request)
        except ApiError as exc:
            return exc.response()
        sampling = Sampling(max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                            thinking=False, drift=self.settings.retokenize_drift)
        rid = "cmpl-" + (request.headers.get("x-request-id") or random_uuid())
        fmt = CompletionFormatter(
            request_id=rid, model=req.model or self.settings.model, compat=self.settings.engine.compat,
            fingerprint=self.fingerprint, return_token_ids=bool(req.return_token_ids),
            include_usage=bool((req.stream_options or {}).get("include_usage")),
            prompt_tokens_details=self.settings.prompt_tokens_details)
        prep = _Prepared(prompt, sampling, rid + "-0", arrival)
        if req.stream:
            return StreamingResponse(self._completion_stream(prep, fmt, self._kv_params(req)),
                                     media_type="text/event-stream")
        out_ids: list[int] = []
        try:
            async for out in self.engine.generate(prompt, sampling, self._kv_params(req), prep.request_id, arrival):
                out_ids += out.token_ids
                if out.finish_reason is not None:
                    text = self.tok.decode(out_ids, skip_special_tokens=True)
                    return JSONResponse(fmt.full(
                        text=text, finish_reason=out.finish_reason, prompt_ids=prompt, output_ids=out_ids,
                        cached=out.num_cached_tokens, kv_transfer_params=out.kv_transfer_params))
        except EngineError:
            pass
        return ApiError(500, "Internal server error", "InternalServerError").response()

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._completion_prompt(prompt[0])
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            self._check_ids(prompt)
            return list(prompt)
        raise ApiError(400, "the simulator accepts one prompt per request (text or token ids)", param="prompt")

    async def _completion_stream(
        self, prep: _Prepared, fmt: CompletionFormatter, kv: dict[str, Any] | None,
    ) -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(self.tok)
        completion = 0
        first = True
        try:
            async for out in self.engine.generate(prep.prompt, prep.sampling, kv, prep.request_id, prep.arrival):
                completion += len(out.token_ids)
                visible = [t for t in out.token_ids if not self.tok.is_special(t)]
                text = detok.push(visible) + (detok.flush() if out.finish_reason else "")
                yield fmt.chunk(text, out.token_ids, prep.prompt if first else None,
                                finish_reason=out.finish_reason, kv_transfer_params=out.kv_transfer_params)
                first = False
        except EngineError:
            if not (self.settings.engine.compat == "0.26" and completion == 0):
                yield error_event(fmt.compat, error_body("Internal server error", "InternalServerError", 500))
                yield DONE
                return
        if fmt.include_usage:
            yield fmt.usage_chunk(len(prep.prompt), completion, 0)
        yield DONE

    # -- token utilities and metadata ----------------------------------------------------------
    async def render(self, request: Request) -> Response:
        try:
            req: ChatRequest = await self._json(request, ChatRequest)
            self._check_model(req.model)
            ids, _ = self._prompt_ids(req)
        except ApiError as exc:
            return exc.response()
        sp: dict[str, Any] = {"stop": [], "stop_token_ids": [], "skip_special_tokens": False,
                              "output_kind": 1 if req.stream else 2, "skip_clone": True, "bad_words": [],
                              "skip_reading_prefix_cache": False}
        mt = req.max_completion_tokens or req.max_tokens
        if mt is not None and mt != 16:
            sp = {**{k: sp[k] for k in ("stop", "stop_token_ids")}, "max_tokens": mt,
                  **{k: v for k, v in sp.items() if k not in ("stop", "stop_token_ids")}}
        return JSONResponse({
            "request_id": f"chatcmpl-{random_uuid()}", "token_ids": ids, "assistant_tokens_mask": None,
            "token_offsets": None, "features": None, "sampling_params": sp, "model": req.model or self.settings.model,
            "stream": bool(req.stream), "stream_options": req.stream_options if req.stream else None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None,
        })

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return ApiError(400, "1 validation error:\n  JSON decode error", "Bad Request").response()
        try:
            if isinstance(body, dict) and "messages" in body:
                req = ChatRequest.model_validate({**body, "add_generation_prompt": body.get("add_generation_prompt",
                                                                                             True)})
                self._check_model(req.model)
                ids, _ = self._render(req)
            elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
                self._check_model(body.get("model"))
                ids = self.tok.encode(body["prompt"])
            else:
                raise ApiError(400, "tokenize takes 'messages' or a string 'prompt'")
        except ValidationError as exc:
            return ApiError(400, str(exc), "Bad Request").response()
        except ApiError as exc:
            return exc.response()
        strs = [self.tok.decode([i]) for i in ids] if body.get("return_token_strs") else None
        return JSONResponse({"count": len(ids), "max_model_len": self.settings.engine.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        body = await request.json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return ApiError(400, "detokenize takes 'tokens': a list of ids").response()
        try:
            self._check_ids(tokens)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": self.tok.decode(tokens)})

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        return JSONResponse({"object": "list", "data": [{
            "id": self.settings.model, "object": "model", "created": now, "owned_by": "vllm",
            "root": self.settings.model, "parent": None, "max_model_len": self.settings.engine.max_model_len,
            "permission": [{"id": f"modelperm-{random_uuid()}", "object": "model_permission", "created": now,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": self.settings.version})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- simulator control -------------------------------------------------------------------
    async def set_faults(self, request: Request) -> Response:
        try:
            upd: FaultUpdate = await self._json(request, FaultUpdate)
        except ApiError as exc:
            return exc.response()
        for name in ("fail_next", "delay_ms", "drop_next", "drop_after_chunks"):
            value = getattr(upd, name)
            if value is not None:
                setattr(self.faults, name, value)
        expired = self.engine.expire_handles() if upd.expire_handles else 0
        if upd.restart:
            self.engine.restart()
        if upd.reset_prefix_cache:
            self.engine.reset_prefix_cache()
        return JSONResponse({"faults": self.faults.model_dump(), "engine_id": self.engine.engine_id,
                             "expired_handles": expired})

    async def state(self, request: Request) -> Response:
        e = self.engine
        return JSONResponse({
            "engine_id": e.engine_id, "role": self.settings.engine.role, "compat": self.settings.engine.compat,
            "side_channel_port": e.side_channel_port, "pins": len(e.pins), "pinned_tokens": e.pinned_tokens(),
            "kv_cache_usage": e.pool.usage(), "free_blocks": e.pool.num_free, "faults": self.faults.model_dump(),
        })


def _merge(into: Delta, d: Delta) -> None:
    into.reasoning += d.reasoning
    into.content += d.content
    into.tool_calls += d.tool_calls


def create_sim_app(settings: SimSettings) -> Starlette:
    server = SimServer(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.engine.start()
        try:
            yield
        finally:
            await server.engine.stop()

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions/render", server.render, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        Route("/_sim/faults", server.set_faults, methods=["POST"]),
        Route("/_sim/state", server.state, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sim = server
    return app
