"""The simulated engine's generation routes, and the app that wires every route.

Decides how a request becomes engine input (chat rendering, or under 0.33
``kv_transfer_params.prompt_token_ids``; length checks; faults) and how engine output becomes a
JSON body or an SSE stream, as vLLM's OpenAI server does. Utility routes live in ``info``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from turnkv.sim import generate, info
from turnkv.sim.chat import ChatTemplate, Delta, OutputParser, RenderError, count_reasoning_tokens
from turnkv.sim.engine import Engine
from turnkv.sim.faults import FaultInjector
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import Sampling, opens_thinking
from turnkv.sim.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    check_model,
    internal_error,
    max_tokens,
    parse_body,
)
from turnkv.sim.responses import (
    DONE,
    ChatFormatter,
    CompletionFormatter,
    error_body,
    error_event,
    random_uuid,
)
from turnkv.sim.sequence import EngineError
from turnkv.sim.settings import SimSettings
from turnkv.sim.tokenizer import IncrementalDetokenizer, Tokenizer

PRIVATE_FIELDS = ("priority", "vllm_xargs", "request_id")  # vLLM request fields that steer the engine


class DroppedByFault(Exception):
    """Raised inside a stream to cut the connection mid-response (fault injection)."""


@dataclass
class _Prepared:
    prompt: list[int]
    sampling: Sampling
    request_id: str
    arrival: float
    kv: dict[str, Any] | None
    cache_salt: str | None = None


class SimServer:
    """One simulated engine: settings, tokenizer, template, engine and faults."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.tok = Tokenizer.shared()
        self.template = ChatTemplate.load(settings.template, settings.chat_template)
        self.metrics = EngineMetrics(settings.model)
        e = settings.engine
        self.metrics.cache_config(
            {
                "block_size": str(e.block_size),
                "num_gpu_blocks": str(e.num_blocks),
                "enable_prefix_caching": str(e.prefix_caching),
                "cache_dtype": "auto",
            }
        )
        self.engine = Engine(settings.engine, self.tok, self.metrics)
        self.faults = FaultInjector(settings.faults)
        # requests that carried an engine-private field (priority, vllm_xargs, request_id), by field: a gateway
        # in front is to pass them only where configured (/_sim/state)
        self.private_fields: Counter[str] = Counter()
        digest = hashlib.sha256(settings.model_dump_json().encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{settings.version}-{digest}"

    # -- request preparation -----------------------------------------------------------------
    def render_chat(self, req: ChatRequest) -> tuple[list[int], bool]:
        """The prompt ids of a chat request, and whether the reasoning parser starts in reasoning."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = req.reasoning_effort != "none"
        thinking = self.settings.thinking and kwargs.get("enable_thinking", True) is not False
        # Tools are rendered even with tool_choice "none": vLLM leaves them out only with
        # --exclude-tools-when-tool-choice-none, off by default.
        try:
            text = self.template.render(
                req.messages,
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                kwargs=kwargs,
            )
        except RenderError as exc:
            raise ApiError(400, str(exc)) from exc
        return self.tok.encode(text), thinking

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], bool, bool]:
        """Prompt ids, parser thinking, and whether the ids came from text (not given as ids)."""
        ids, thinking = self.render_chat(req)
        override = (req.kv_transfer_params or {}).get("prompt_token_ids")
        if override is not None and self.settings.engine.compat == "0.33":
            # 0.32+: the renderer takes these ids instead of templating.
            if not (isinstance(override, list) and override and all(isinstance(i, int) for i in override)):
                raise ApiError(
                    400,
                    "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
                    param="kv_transfer_params",
                )
            self.check_ids(override)
            return list(override), thinking, False
        return ids, thinking, True

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self.tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param="prompt")

    def chat_max_tokens(self, req: ChatRequest, prompt_len: int, text_prompt: bool) -> int:
        used = req.max_completion_tokens is not None
        return max_tokens(
            req,
            prompt_len,
            self.settings.engine.max_model_len,
            param="max_completion_tokens" if used else "max_tokens",
            value=req.max_completion_tokens if used else req.max_tokens,
            default=None,
            text_prompt=text_prompt,
        )

    def note_private(self, req: GenerationRequest) -> None:
        """Count the engine-private fields ``req`` carries (vLLM accepts them; nothing here acts on them)."""
        sent = req.model_fields_set | set(req.model_extra or ())
        self.private_fields.update(f for f in PRIVATE_FIELDS if f in sent)

    async def _admit(self) -> float:
        arrival = time.perf_counter()
        await self.faults.delay(arrival)
        overhead = self.settings.engine.costs.scaled(self.settings.engine.costs.api_overhead_s)
        if overhead > 0:
            await asyncio.sleep(overhead)
        if self.faults.take_failure():
            raise internal_error()
        return arrival

    async def tokenizing(self, tokens: int) -> None:
        """What templating and tokenizing a text prompt costs this engine (``CostModel.text_per_token_s``)."""
        costs = self.settings.engine.costs
        seconds = costs.scaled(costs.text_per_token_s * tokens)
        if seconds > 0:
            await asyncio.sleep(seconds)

    def _prepare(
        self, req: GenerationRequest, prompt: list[int], sampling: Sampling, rid: str, arrival: float
    ) -> _Prepared:
        kv = None
        if req.kv_transfer_params is not None:
            kv = {k: v for k, v in req.kv_transfer_params.items() if k != "prompt_token_ids"}
        return _Prepared(prompt, sampling, rid, arrival, kv, req.cache_salt)

    def _sampling(self, req: GenerationRequest, prompt: Sequence[int], limit: int, **extra: Any) -> Sampling:
        # What the model says depends on its prompt alone, so whether it reasons is read from
        # the prompt, not from the route or the request's template kwargs.
        return Sampling(
            max_tokens=limit,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            thinking=self.settings.thinking and opens_thinking(self.tok, prompt),
            drift=self.settings.retokenize_drift,
            **extra,
        )

    # -- chat --------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        try:
            req = await parse_body(request, ChatRequest)
            self.note_private(req)
            check_model(req.model, self.settings.model)
            if req.n != 1:
                raise ApiError(400, "the simulator supports n=1 only", param="n")
            prompt, thinking, text_prompt = self.chat_prompt(req)
            limit = self.chat_max_tokens(req, len(prompt), text_prompt)
            arrival = await self._admit()
            await self.tokenizing(len(prompt) if text_prompt else 0)
        except ApiError as exc:
            return exc.response()
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        sampling = self._sampling(req, prompt, limit, tools=req.tools or (), tool_choice=tool_choice)
        rid = "chatcmpl-" + (request.headers.get("x-request-id") or random_uuid())
        opts = req.stream_options or {}
        fmt = ChatFormatter(
            request_id=rid,
            model=req.model or self.settings.model,
            compat=self.settings.engine.compat,
            fingerprint=self.fingerprint,
            return_token_ids=bool(req.return_token_ids),
            include_usage=bool(opts.get("include_usage")),
            continuous_usage=bool(opts.get("continuous_usage_stats")),
            prompt_tokens_details=self.settings.prompt_tokens_details,
        )
        parser = OutputParser(self.tok, parse_tools=bool(req.tools) and tool_choice != "none", thinking=thinking)
        required = tool_choice == "required" or isinstance(tool_choice, dict)
        prep = self._prepare(req, prompt, sampling, rid, arrival)
        if req.stream:
            return StreamingResponse(
                self._chat_stream(prep, fmt, parser, named=isinstance(tool_choice, dict)),
                media_type="text/event-stream",
            )
        out_ids: list[int] = []
        try:
            async with contextlib.aclosing(
                self.engine.generate(prompt, sampling, prep.kv, rid, arrival, prep.cache_salt)
            ) as outputs:
                async for out in outputs:
                    out_ids += out.token_ids
                    for t in out.token_ids:
                        parser.feed(t)
                    if out.finish_reason is None:
                        continue
                    parser.finish()
                    calls = parser.final_tool_calls()
                    reason = "tool_calls" if calls and not isinstance(tool_choice, dict) else out.finish_reason
                    return JSONResponse(
                        fmt.full(
                            content=parser.final_content(required=required),
                            reasoning=parser.reasoning or None,
                            tool_calls=calls,
                            finish_reason=reason,
                            prompt_ids=prompt,
                            output_ids=out_ids,
                            cached=out.num_cached_tokens,
                            reasoning_tokens=count_reasoning_tokens(self.tok, out_ids),
                            kv_transfer_params=out.kv_transfer_params,
                        )
                    )
        except EngineError:
            pass
        return internal_error().response()

    async def _chat_stream(
        self,
        prep: _Prepared,
        fmt: ChatFormatter,
        parser: OutputParser,
        *,
        named: bool,
    ) -> AsyncIterator[bytes]:
        n_prompt = len(prep.prompt)
        out_ids: list[int] = []
        cached = sent = 0
        started = False
        drop = self.faults.take_drop()
        freeze = self.faults.take_freeze()
        try:
            async with contextlib.aclosing(
                self.engine.generate(
                    prep.prompt, prep.sampling, prep.kv, prep.request_id, prep.arrival, prep.cache_salt
                )
            ) as outputs:
                async for out in outputs:
                    if not started:
                        started = True
                        yield fmt.role_chunk(prep.prompt)
                    delta = Delta()
                    for t in out.token_ids:
                        _merge(delta, parser.feed(t))
                    out_ids += out.token_ids
                    reason = None
                    if out.finish_reason is not None:
                        _merge(delta, parser.finish())
                        reason = "tool_calls" if parser.tool_calls and not named else out.finish_reason
                        cached = out.num_cached_tokens
                    chunk = fmt.token_chunk(
                        delta,
                        out.token_ids,
                        n_prompt,
                        len(out_ids),
                        finish_reason=reason,
                        kv_transfer_params=out.kv_transfer_params,
                    )
                    if chunk is not None:
                        yield chunk
                        sent += 1
                        if drop and sent >= self.faults.faults.drop_after_chunks:
                            raise DroppedByFault("connection dropped by fault injection")
                        if freeze and sent >= self.faults.faults.drop_after_chunks:
                            await asyncio.Event().wait()  # silent, the connection open, until the client leaves
        except EngineError:
            if not started:
                yield fmt.role_chunk(prep.prompt)
            # 0.26 skips empty outputs before it checks for errors: a request that fails before
            # its first token ends the stream with no error event at all.
            if not (fmt.compat == "0.26" and not out_ids):
                yield error_event(fmt.compat, error_body("Internal server error", "InternalServerError", 500))
                yield DONE
                return
        if fmt.include_usage:
            yield fmt.usage_chunk(n_prompt, len(out_ids), cached, count_reasoning_tokens(self.tok, out_ids))
        yield DONE

    # -- completions -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            req = await parse_body(request, CompletionRequest)
            self.note_private(req)
            check_model(req.model, self.settings.model)
            if req.n != 1:
                raise ApiError(400, "the simulator supports n=1 only", param="n")
            prompt, text_prompt = self._completion_prompt(req.prompt)
            limit = max_tokens(
                req,
                len(prompt),
                self.settings.engine.max_model_len,
                param="max_tokens",
                value=req.max_tokens,
                default=16,
                text_prompt=text_prompt,
            )
            arrival = await self._admit()
            await self.tokenizing(len(prompt) if text_prompt else 0)
        except ApiError as exc:
            return exc.response()
        rid = "cmpl-" + (request.headers.get("x-request-id") or random_uuid())
        fmt = CompletionFormatter(
            request_id=rid,
            model=req.model or self.settings.model,
            compat=self.settings.engine.compat,
            fingerprint=self.fingerprint,
            return_token_ids=bool(req.return_token_ids),
            include_usage=bool((req.stream_options or {}).get("include_usage")),
            prompt_tokens_details=self.settings.prompt_tokens_details,
        )
        # one prompt of a batch: the engine request is "cmpl-<id>-0", as in vLLM
        prep = self._prepare(req, prompt, self._sampling(req, prompt, limit), rid + "-0", arrival)
        if req.stream:
            return StreamingResponse(self._completion_stream(prep, fmt), media_type="text/event-stream")
        out_ids: list[int] = []
        try:
            async with contextlib.aclosing(
                self.engine.generate(prompt, prep.sampling, prep.kv, prep.request_id, arrival, prep.cache_salt)
            ) as outputs:
                async for out in outputs:
                    out_ids += out.token_ids
                    if out.finish_reason is not None:
                        text = self.tok.decode(out_ids, skip_special_tokens=True)
                        return JSONResponse(
                            fmt.full(
                                text=text,
                                finish_reason=out.finish_reason,
                                prompt_ids=prompt,
                                output_ids=out_ids,
                                cached=out.num_cached_tokens,
                                kv_transfer_params=out.kv_transfer_params,
                            )
                        )
        except EngineError:
            pass
        return internal_error().response()

    def _completion_prompt(self, prompt: Any) -> tuple[list[int], bool]:
        if prompt == "" or prompt == []:
            raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")  # vLLM's words
        if isinstance(prompt, str):
            return self.tok.encode(prompt), True
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return self._completion_prompt(prompt[0])
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            self.check_ids(prompt)
            return list(prompt), False
        raise ApiError(400, "the simulator accepts one prompt per request (text or token ids)", param="prompt")

    async def _completion_stream(self, prep: _Prepared, fmt: CompletionFormatter) -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(self.tok)
        completion = cached = 0
        try:
            async with contextlib.aclosing(
                self.engine.generate(
                    prep.prompt, prep.sampling, prep.kv, prep.request_id, prep.arrival, prep.cache_salt
                )
            ) as outputs:
                async for out in outputs:
                    first = completion == 0
                    completion += len(out.token_ids)
                    visible = [t for t in out.token_ids if not self.tok.is_special(t)]
                    text = detok.push(visible) + (detok.flush() if out.finish_reason else "")
                    if out.finish_reason is not None:
                        cached = out.num_cached_tokens
                    yield fmt.chunk(
                        text,
                        out.token_ids,
                        prep.prompt if first else None,
                        finish_reason=out.finish_reason,
                        kv_transfer_params=out.kv_transfer_params,
                    )
        except EngineError:
            if not (fmt.compat == "0.26" and completion == 0):
                yield error_event(fmt.compat, error_body("Internal server error", "InternalServerError", 500))
                yield DONE
                return
        if fmt.include_usage:
            yield fmt.usage_chunk(len(prep.prompt), completion, cached)
        yield DONE


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
        *(generate.routes(server) if settings.tokens_only else []),  # first: they shadow the text routes
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        *info.routes(server),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sim = server
    return app
