"""The simulated render service (``turnkv sim --role render``): vLLM's ``vllm launch render``, no engine.

It turns OpenAI requests into the ``GenerateRequest`` a tokens-only engine takes (``/v1/chat/completions/render``,
``/v1/completions/render``, and from 0.30 ``/v1/responses/render``) and engine output ids back into OpenAI
answers (``/v1/chat/completions/derender``, ``/v1/completions/derender``: ``sim.derender``), plus
``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, ``/version`` and ``/metrics``. Prompts are
rendered exactly as the simulated engines render them (the same template and tokenizer), so render's ids
are what a colocated engine would compute from.

A render service is CPU-bound and small: every call holds one of its ``cores`` for a modelled duration
(``RenderCosts``, fitted to timings of vLLM 0.34's render service on 2 cores; scaled by
``time_scale``), calls beyond its cores queue, and ``/_sim/state`` reports the modelled busy seconds per
route, so a render layer's capacity can be studied on one machine. Streaming derender's cost grows with
everything a call replays (earlier output tokens and chunks, and the prompt it rescans).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turnkv.sim import info
from turnkv.sim.app import SimServer
from turnkv.sim.costs import CostModel
from turnkv.sim.derender import Derenderer, Parsers, tool_choice_of
from turnkv.sim.engine import EngineConfig
from turnkv.sim.faults import FaultInjector, Faults, FaultUpdate
from turnkv.sim.generate import SIM_EXTRA
from turnkv.sim.oracle import opens_thinking
from turnkv.sim.requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_model,
    internal_error,
    json_object,
    max_tokens,
    parse_body,
    validate,
)
from turnkv.sim.responses import random_uuid
from turnkv.sim.settings import SimSettings


class RenderCosts(BaseModel):
    """Seconds of one render core per call. Fitted to vLLM 0.34 on 2 x86 cores (9k-token prompts): render
    2.3 ms + 2.42 us/prompt token (7 / 21 / 76 ms at 1k / 9k / 30k); non-streaming derender 10 ms + 15 us per
    output token (13 / 30 / 34 ms at 200 / 800 / 1,600); a streaming call 7.5 ms at a 9k prompt (split here as
    2 ms + 0.6 us per prompt token, a guess) + 18.5 us per output token it decodes (earlier ones replayed and
    its own) + 27.8 us per earlier chunk it replays (the three chunkings 1, 4 and 16 tokens per call took
    78 / 11.2 / 2.4 s for 1,600 tokens; this fit gives 61 / 11.3 / 2.6 s). ``/detokenize`` was not measured:
    0.5 ms + 1 us per token is an assumption."""

    render_base_s: float = Field(2.3e-3, ge=0)
    render_per_token_s: float = Field(2.42e-6, ge=0)
    derender_base_s: float = Field(10e-3, ge=0)
    derender_per_token_s: float = Field(15e-6, ge=0)
    stream_base_s: float = Field(2.0e-3, ge=0)
    stream_per_prompt_token_s: float = Field(0.6e-6, ge=0)
    stream_per_token_s: float = Field(18.5e-6, ge=0)
    stream_per_chunk_s: float = Field(27.8e-6, ge=0)
    detok_base_s: float = Field(0.5e-3, ge=0)
    detok_per_token_s: float = Field(1e-6, ge=0)
    time_scale: float = Field(1.0, ge=0)

    def render(self, prompt: int) -> float:
        return self.render_base_s + self.render_per_token_s * prompt

    def derender(self, output: int) -> float:
        return self.derender_base_s + self.derender_per_token_s * output

    def stream_call(self, prompt: int, earlier: int, new: int, chunks: int) -> float:
        return (
            self.stream_base_s
            + self.stream_per_prompt_token_s * prompt
            + self.stream_per_token_s * (earlier + new)
            + self.stream_per_chunk_s * chunks
        )

    def detokenize(self, tokens: int) -> float:
        return self.detok_base_s + self.detok_per_token_s * tokens


class RenderFaultUpdate(FaultUpdate):
    fail_render_next: int | None = Field(None, ge=0, description="answer the next N render calls with a 500")
    fail_derender_next: int | None = Field(None, ge=0, description="answer the next N derender calls with a 500")


class RenderSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    model: str = "sim-model"
    template: Literal["keep", "strip"] = "keep"
    chat_template: str | None = None
    compat: Literal["0.26", "0.33"] = "0.26"
    max_model_len: int = Field(40960, ge=16)
    thinking: bool = True  # the simulated model reasons (as the engines' --thinking)
    reasoning_parser: bool = True  # --reasoning-parser qwen3
    tool_parser: bool = True  # --enable-auto-tool-choice --tool-call-parser hermes
    cores: int = Field(1, ge=1, description="calls served at once (vLLM renders in one executor thread)")
    costs: RenderCosts = Field(default_factory=RenderCosts)
    faults: Faults = Field(default_factory=Faults)

    @property
    def version(self) -> str:
        return {"0.26": "0.26.0", "0.33": "0.33.0"}[self.compat]

    def text_settings(self) -> SimSettings:
        """The settings of an engine that renders exactly as this service does."""
        engine = EngineConfig(compat=self.compat, max_model_len=self.max_model_len, costs=CostModel(time_scale=0))
        return SimSettings(
            model=self.model,
            template=self.template,
            chat_template=self.chat_template,
            thinking=self.thinking,
            engine=engine,
        )


def render_settings_from_args(a: argparse.Namespace) -> RenderSettings:
    overrides = {
        k: v / 1e3
        for k, v in {
            "render_base_s": a.render_ms,
            "derender_base_s": a.derender_ms,
            "stream_base_s": a.stream_derender_ms,
        }.items()
        if v is not None
    }
    if a.stream_replay_us is not None:
        overrides["stream_per_token_s"] = a.stream_replay_us / 1e6
    return RenderSettings(
        host=a.host,
        port=a.port,
        model=a.model,
        template=a.template,
        chat_template=a.chat_template,
        compat=a.vllm_compat,
        max_model_len=a.max_model_len,
        thinking=a.thinking,
        reasoning_parser=a.reasoning_parser,
        tool_parser=a.tool_parser,
        cores=a.render_cores,
        costs=RenderCosts(time_scale=a.time_scale, **overrides),
        faults=Faults(fail_next=a.fail_next, delay_ms=a.delay_ms),
    )


# -- what a render answer carries -----------------------------------------------------------------


def sampling_params(
    req: ChatRequest | CompletionRequest,
    limit: int,
    *,
    compat: str,
    parsers: Parsers,
    kv: dict[str, Any] | None,
    sim: dict[str, Any] | None,
) -> dict[str, Any]:
    """``SamplingParams`` as msgspec writes it with ``omit_defaults`` (vLLM's ``/render`` answer): the model's
    default sampling parameters first, then only what differs from ``SamplingParams``' defaults. A
    ``max_tokens`` of 16 is SamplingParams' default and so is left out, as vLLM leaves it out."""
    extra = req.model_extra or {}
    stop = extra.get("stop")
    sp: dict[str, Any] = {
        "presence_penalty": float(extra.get("presence_penalty") or 0.0),
        "frequency_penalty": float(extra.get("frequency_penalty") or 0.0),
        "repetition_penalty": 1.0,
        "temperature": float(extra["temperature"]) if extra.get("temperature") is not None else 1.0,
        "top_p": float(extra["top_p"]) if extra.get("top_p") is not None else 1.0,
        "min_p": 0.0,
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "stop_token_ids": list(extra.get("stop_token_ids") or []),
    }
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if limit != 16:
        sp["max_tokens"] = limit
    if req.min_tokens:
        sp["min_tokens"] = req.min_tokens
    if parsers.any:
        sp["skip_special_tokens"] = False  # the parsers read special tokens
    sp.update(output_kind=1 if req.stream else 2, skip_clone=True)
    extra_args: dict[str, Any] = {}
    if kv and compat == "0.26":
        extra_args["kv_transfer_params"] = kv  # 0.26 leaves it here; 0.33 hoists it to the top level
    if sim:
        extra_args[SIM_EXTRA] = sim
    if extra_args:
        sp["extra_args"] = extra_args
    sp.update(bad_words=[], skip_reading_prefix_cache=False)
    return sp


def _kv_of(req: ChatRequest | CompletionRequest) -> dict[str, Any] | None:
    return {k: v for k, v in (req.kv_transfer_params or {}).items() if k != "prompt_token_ids"} or None


def _history_tool_calls(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or []) for m in messages if isinstance(m, Mapping))


# -- Responses input as chat messages ---------------------------------------------------------------


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat request vLLM's renderer builds from it (text input, function tools)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "input must be a string or a list of input items", param="input")
    for item in items:
        _add_item(messages, item)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": bool(body.get("stream"))}
    tools = [
        {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
        }
        for t in body.get("tools") or []
        if isinstance(t, Mapping) and t.get("type") == "function"
    ]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, Mapping) and choice.get("type") == "function":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif isinstance(choice, str):
            chat["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            chat[k] = body[k]
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), Mapping) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise ApiError(400, "message content must be a string or a list of content parts", param="input")


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    if not isinstance(item, Mapping):
        raise ApiError(400, "each input item must be an object", param="input")
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "message":
        role = {"developer": "system"}.get(str(item.get("role")), str(item.get("role")))
        messages.append({"role": role, "content": _text(item.get("content"))})
    elif kind == "function_call":
        fn = {"name": item.get("name"), "arguments": item.get("arguments")}
        call = {"id": item.get("call_id"), "type": "function", "function": fn}
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"))})
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        messages.append({"role": "assistant", "content": None, "reasoning": _text(parts)})
    else:
        raise ApiError(400, f"input items of type {kind!r} are not supported by this model", param="input")


# -- the service ------------------------------------------------------------------------------------


class RenderServer:
    """One simulated render service: the engines' renderer, the derenderer, its cores and what they did."""

    def __init__(self, settings: RenderSettings) -> None:
        self.settings = settings
        self.text = SimServer(settings.text_settings())  # renders; its engine never starts
        self.parsers = Parsers(reasoning=settings.reasoning_parser, tools=settings.tool_parser)
        self.derenderer = Derenderer(self.text.tok, self.parsers, settings.compat, settings.max_model_len)
        self.faults = FaultInjector(settings.faults)
        self.fail_next: dict[str, int] = {}  # render or derender calls to answer with a 500, by kind
        self._cores = asyncio.Semaphore(settings.cores)
        self.calls: Counter[str] = Counter()
        self.busy_s: dict[str, float] = {}  # modelled seconds of a core, per route
        self.info = info.InfoRoutes(self.text)

    async def work(self, route: str, seconds: float) -> None:
        """Hold a core for ``seconds`` of modelled CPU (scaled by ``time_scale``); calls beyond the cores queue."""
        self.calls[route] += 1
        self.busy_s[route] = self.busy_s.get(route, 0.0) + seconds
        scaled = seconds * self.settings.costs.time_scale
        async with self._cores:
            if scaled > 0:
                await asyncio.sleep(scaled)

    async def _admit(self, kind: str = "render") -> None:
        await self.faults.delay(time.perf_counter())
        if self.faults.take_failure() or self._take(kind):
            raise internal_error()

    def _take(self, kind: str) -> bool:
        """A failure set for this kind of call only (``fail_render_next``, ``fail_derender_next``)."""
        left = self.fail_next.get(kind, 0)
        if left > 0:
            self.fail_next[kind] = left - 1
            return True
        return False

    # -- render ------------------------------------------------------------------------------------
    def _generate_request(
        self, req: ChatRequest, ids: list[int], limit: int, *, rid: str, responses: bool = False
    ) -> dict[str, Any]:
        st = self.settings
        kv = _kv_of(req)
        choice = tool_choice_of(req)
        sim = {"tools": req.tools, "tool_choice": choice} if req.tools else None
        sp = sampling_params(req, limit, compat=st.compat, parsers=self.parsers, kv=kv, sim=sim)
        if st.compat == "0.26":
            return {
                "request_id": rid,
                "token_ids": ids,
                "assistant_tokens_mask": None,
                "token_offsets": None,
                "features": None,
                "sampling_params": sp,
                "model": req.model,
                "stream": bool(req.stream),
                "stream_options": req.stream_options if req.stream else None,
                "cache_salt": req.cache_salt,
                "priority": 0,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
            }
        kwargs = {
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        }
        parse_context = None
        if not responses:
            parse_context = {
                "tools": req.tools,
                "tool_choice": choice,
                "parallel_tool_calls": True,
                "include_reasoning": (req.model_extra or {}).get("include_reasoning", True) is not False,
                "chat_template_kwargs": kwargs,
                "history_tool_call_cnt": _history_tool_calls(req.messages),
            }
        reasoning_ended = None
        if self.parsers.reasoning and not responses:
            reasoning_ended = not opens_thinking(self.text.tok, ids)
        return {
            "request_id": rid,
            "token_ids": ids,
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": sp,
            "model": req.model,
            "reasoning_ended": reasoning_ended,
            "reasoning_parser_kwargs": {"chat_template_kwargs": kwargs},
            "return_token_ids": req.return_token_ids,
            "output_mode": "tokens",
            "parse_context": parse_context,
            "stream": bool(req.stream),
            "stream_options": req.stream_options if req.stream else None,
            "cache_salt": req.cache_salt,
            "priority": 0,
            "kv_transfer_params": kv,
            "ec_transfer_params": None,
        }

    async def render_chat(self, request: Request) -> Response:
        try:
            req = await parse_body(request, ChatRequest)
            return JSONResponse(await self._render_chat(req, responses=False))
        except ApiError as exc:
            return exc.response()

    async def _render_chat(self, req: ChatRequest, *, responses: bool) -> dict[str, Any]:
        check_model(req.model, self.settings.model)
        if req.n != 1:
            raise ApiError(400, "the simulator supports n=1 only", param="n")
        await self._admit()
        ids, _, text_prompt = self.text.chat_prompt(req)
        limit = self.text.chat_max_tokens(req, len(ids), text_prompt)
        await self.work("render", self.settings.costs.render(len(ids)))
        prefix = "resp" if responses else "chatcmpl"
        return self._generate_request(req, ids, limit, rid=f"{prefix}-{random_uuid()}", responses=responses)

    async def render_responses(self, request: Request) -> Response:
        try:
            body = await json_object(request)
            if body.get("previous_response_id") is not None:
                raise ApiError(
                    400,
                    "previous_response_id is not supported by the stateless render endpoint.",
                    "invalid_request_error",
                    "previous_response_id",
                )
            req = validate(responses_to_chat(body), ChatRequest)
            return JSONResponse(await self._render_chat(req, responses=True))
        except ApiError as exc:
            return exc.response()

    async def render_completions(self, request: Request) -> Response:
        s = self.text
        try:
            req = await parse_body(request, CompletionRequest)
            check_model(req.model, self.settings.model)
            await self._admit()
            ids, text_prompt = s._completion_prompt(req.prompt)
            limit = max_tokens(
                req,
                len(ids),
                self.settings.max_model_len,
                param="max_tokens",
                value=req.max_tokens,
                default=16,
                text_prompt=text_prompt,
            )
            await self.work("render", self.settings.costs.render(len(ids)))
        except ApiError as exc:
            return exc.response()
        plain = Parsers(reasoning=False, tools=False)
        sp = sampling_params(req, limit, compat=self.settings.compat, parsers=plain, kv=_kv_of(req), sim=None)
        out = {
            "request_id": f"cmpl-{random_uuid()}",
            "token_ids": ids,
            "token_offsets": None,
            "features": None,
            "sampling_params": sp,
            "model": req.model,
            "stream": bool(req.stream),
            "stream_options": req.stream_options if req.stream else None,
            "cache_salt": req.cache_salt,
            "priority": 0,
            "kv_transfer_params": _kv_of(req) if self.settings.compat != "0.26" else None,
            "ec_transfer_params": None,
        }
        return JSONResponse([out])

    # -- derender ----------------------------------------------------------------------------------
    async def derender_chat(self, request: Request) -> Response:
        d = self.derenderer
        try:
            body = await json_object(request)
            if body.get("model") is not None:
                check_model(body["model"], self.settings.model)
            await self._admit("derender")
            if body.get("stream") is True and self.settings.compat != "0.26":
                chunk, state, replayed = d.chat_stream(body)
                new = len(state["output_token_ids"]) - replayed
                prompt = len(body.get("prompt_token_ids") or [])
                cost = self.settings.costs.stream_call(prompt, replayed, new, len(state["output_chunk_lens"]) - 1)
                await self.work("derender_stream", cost)
                return JSONResponse({"chunk": chunk, "stream_state": state})
            out = d.chat(body)
            await self.work("derender", self.settings.costs.derender(out["usage"]["completion_tokens"]))
            return JSONResponse(out)
        except ApiError as exc:
            return exc.response()

    async def derender_completions(self, request: Request) -> Response:
        try:
            body = await json_object(request)
            if body.get("model") is not None:
                check_model(body["model"], self.settings.model)
            await self._admit("derender")
            out = self.derenderer.completions(body)
            await self.work("derender", self.settings.costs.derender(out["usage"]["completion_tokens"]))
            return JSONResponse(out)
        except ValueError:
            return ApiError(400, "1 validation error:\n  JSON decode error", "Bad Request").response()
        except ApiError as exc:
            return exc.response()

    # -- token utilities, with their cost --------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        response = await self.info.tokenize(request)
        await self.work("tokenize", self.settings.costs.render(_count(response)))
        return response

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        await self.work("detokenize", self.settings.costs.detokenize(len(tokens) if isinstance(tokens, list) else 0))
        return await self.info.detokenize(request)

    # -- simulator control ---------------------------------------------------------------------------
    async def set_faults(self, request: Request) -> Response:
        """The engines' faults, plus ``fail_render_next`` and ``fail_derender_next`` (calls of that kind only)."""
        try:
            upd = await parse_body(request, RenderFaultUpdate)
        except ApiError as exc:
            return exc.response()
        self.faults.update(upd)
        for kind in ("render", "derender"):
            n = getattr(upd, f"fail_{kind}_next")
            if n is not None:
                self.fail_next[kind] = n
        return JSONResponse({"faults": self.faults.faults.model_dump(), "fail_next": self.fail_next})

    async def state(self, request: Request) -> Response:
        return JSONResponse(
            {
                "role": "render",
                "compat": self.settings.compat,
                "cores": self.settings.cores,
                "calls": dict(self.calls),
                "busy_s": {k: round(v, 6) for k, v in self.busy_s.items()},
                "replayed_tokens": self.derenderer.replayed_tokens,
                "faults": self.faults.faults.model_dump(),
            }
        )


def _count(response: Response) -> int:
    body = bytes(response.body) if isinstance(response, JSONResponse) else b""
    try:
        return int(json.loads(body).get("count", 0))
    except (ValueError, AttributeError):
        return 0


async def _not_found(request: Request) -> Response:
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def create_render_app(settings: RenderSettings) -> Starlette:
    server = RenderServer(settings)
    responses = server.render_responses if settings.compat != "0.26" else _not_found
    routes = [
        Route("/v1/chat/completions/render", server.render_chat, methods=["POST"]),
        Route("/v1/completions/render", server.render_completions, methods=["POST"]),
        Route("/v1/responses/render", responses, methods=["POST"]),
        Route("/v1/chat/completions/derender", server.derender_chat, methods=["POST"]),
        Route("/v1/completions/derender", server.derender_completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/v1/models", server.info.models, methods=["GET"]),
        Route("/health", server.info.health, methods=["GET"]),
        Route("/version", server.info.version, methods=["GET"]),
        Route("/metrics", server.info.metrics, methods=["GET"]),
        Route("/_sim/faults", server.set_faults, methods=["POST"]),
        Route("/_sim/state", server.state, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.render = server
    return app
