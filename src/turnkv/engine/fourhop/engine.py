"""``FourHopEngine``: the engine seam over four hops: a render service, tokens-only P, tokens-only D, derender.

vLLM's engines run ``--tokens-only`` (``/inference/v1/generate``: token ids in and out, no tokenizer), and a
render service (``vllm launch render``) turns OpenAI requests into ``GenerateRequest``s and output ids back
into answers. A turn is rendered once: ``render`` keeps render's answer for the turn's other calls (by its
request id), so its ids are the prompt the reuse check runs on and P and D compute from, and P's path has no
render of its own. P generates one token for remote decode (with D's trimmed handle, or a release); D
generates with P's params, streamed or not, and its ids are derendered (``turnkv.derender``) into the chat
answer a client of vLLM's chat server gets, streaming included. Releases and write-backs are generates of
bare ids. Where the KV params go on generate follows each engine's version (``wire.Placement``).

What needs turnkv's vLLM plugin: D's handle on a *streamed* generate (no vLLM version puts it there). Without
it a streamed turn stores no handle (its next turn recomputes or runs decode-local; D's blocks wait out
their TTL); a turn not streamed gets it in the body, and decode-local needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from turnkv.config import ConfigError, Settings
from turnkv.derender import Derender, DerenderConfig, FlushPolicy, Output, RenderClient, reasoning_open
from turnkv.derender.answer import Answer
from turnkv.derender.tokenizer import load_decode
from turnkv.engine.base import (
    CallMeta,
    DecodeAnswer,
    DecodeCall,
    EngineInfo,
    Gathered,
    Handle,
    HandleFacts,
    HandleProblem,
    LoadSample,
    ModelCard,
    PrefillCall,
    PrefillResult,
    WriteBack,
    WriteBackResult,
)
from turnkv.engine.fourhop import wire
from turnkv.engine.fourhop.stream import ChatChunks, FourHopDecodeStream, StreamTerms
from turnkv.engine.vllm import handles
from turnkv.engine.vllm.engine import VllmEngine
from turnkv.engine.vllm.http import Upstream
from turnkv.engine.vllm.info import PLUGIN_HEADER, plugin_lists, version_tuple
from turnkv.engine.vllm.prefill import (
    RELEASE_MAX_TOKENS,
    WRITE_BACK_MAX_TOKENS,
    ask_prefill,
    prefill_result,
    read_write_back,
    send_release,
)
from turnkv.errors import ClientError, UpstreamError, UpstreamProtocolError, UpstreamStatus

GENERATE = "/inference/v1/generate"
KEPT_RENDERS = 4096  # renders kept for their turn's later calls (a turn uses its own within seconds)
STOP_REFUSED = (
    "stop strings are not supported on four hops: the tokens-only engines have no detokenizer to match them "
    "(vLLM 0.26-0.32 would ignore them). Use stop_token_ids."
)


class FourHopEngine:
    """The seam's ``Engine`` for four hops; what is the same as with vLLM's chat engines (handles, probes,
    pass-through) is ``VllmEngine``'s."""

    name = "vllm-four-hop"

    def __init__(
        self,
        upstream: Upstream,
        block_size: int,
        renders: RenderClient,
        config: DerenderConfig,
        *,
        local_decode: Any = None,
        allow_client_kv_transfer_params: bool = False,
    ) -> None:
        self.vllm = VllmEngine(upstream, block_size, allow_client_kv_transfer_params=allow_client_kv_transfer_params)
        self.upstream = upstream
        self.block_size = block_size
        self.renders = renders
        self.config = config
        self.local_decode = local_decode
        self._rendered: OrderedDict[str, asyncio.Future[dict[str, Any]]] = OrderedDict()  # by the turn's request id
        self._versions: dict[str, tuple[int, ...]] = {}  # engines' versions by base URL, as /version said
        self._derender: Derender | None = None
        self.renders_on_path = 0  # turns rendered by their prefill or decode call (the pipeline had not)

    # -- the turn's render ---------------------------------------------------------------------------
    def check_request(self, body: Mapping[str, Any]) -> None:
        self.vllm.check_request(body)
        if body.get("stop"):
            raise ClientError(STOP_REFUSED, param="stop")
        if (body.get("n") or 1) != 1:
            raise ClientError("n > 1 is not supported on four hops", param="n")
        if body.get("logprobs") or body.get("echo") or "prompt" in body:
            raise ClientError("four hops serve chat completions without logprobs", param="logprobs")

    async def render(self, base: str, body: Mapping[str, Any], meta: CallMeta) -> list[int]:
        rendered = await self._render(body, meta)
        return list(rendered["token_ids"])

    async def _render(self, body: Mapping[str, Any], meta: CallMeta) -> dict[str, Any]:
        """The turn's render: one call to the render service, whoever asks first; a call for a turn whose
        render is on its way waits for it (P's leg sent beside the pipeline's render shares it), and one whose
        render failed renders on its own."""
        key = meta.request_id or ""
        pending = self._rendered.get(key) if key else None
        if pending is not None:
            with contextlib.suppress(UpstreamError):
                return await asyncio.shield(pending)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if key:
            self._rendered[key] = fut
            while len(self._rendered) > KEPT_RENDERS:
                self._rendered.popitem(last=False)
        try:
            rendered = await self._render_call(body)
        except BaseException as exc:
            if self._rendered.get(key) is fut:
                del self._rendered[key]
            if isinstance(exc, Exception):
                fut.set_exception(exc)
                fut.exception()  # retrieved: a waiter may not come
            else:
                fut.cancel()
            raise
        fut.set_result(rendered)
        return rendered

    async def _render_call(self, body: Mapping[str, Any]) -> dict[str, Any]:
        req = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        rendered = await self.renders.render_chat(req)
        ids = rendered.get("token_ids")
        if not isinstance(ids, list) or not ids or not isinstance(rendered.get("sampling_params"), dict):
            raise UpstreamStatus(502, {"error": {"message": "render returned no token ids"}}, leg="render")
        return rendered

    async def _rendered_for(self, body: Mapping[str, Any], meta: CallMeta, *, last: bool) -> dict[str, Any]:
        """The turn's render (from ``render``, done or on its way), or a render now; ``last``: no later call of the
        turn needs it."""
        if (meta.request_id or "") not in self._rendered:  # the pipeline did not render this turn: now, once
            self.renders_on_path += 1
        rendered = await self._render(body, meta)
        if last:
            self._rendered.pop(meta.request_id or "", None)
        return rendered

    def _placement(self, base: str) -> wire.Placement:
        return wire.placement_of(self._versions.get(base))

    def _rid(self, meta: CallMeta) -> str:
        return meta.request_id or uuid.uuid4().hex

    # -- prefill ------------------------------------------------------------------------------------
    async def prefill(self, base: str, call: PrefillCall, meta: CallMeta) -> PrefillResult:
        rendered = await self._rendered_for(call.body, meta, last=False)
        params = handles.prefill_params(call.handle, self.block_size)
        body = wire.prefill_body(rendered, params, self._placement(base), self._rid(meta))
        data = await ask_prefill(self.upstream, base, GENERATE, body, self._headers(meta), call)
        return prefill_result(data, rendered["token_ids"] if call.return_ids else None)

    # -- decode -------------------------------------------------------------------------------------
    def _generate_request(
        self, rendered: Mapping[str, Any], base: str, call: DecodeCall, meta: CallMeta
    ) -> dict[str, Any]:
        out = call.body.get("max_completion_tokens") or call.body.get("max_tokens")
        return wire.decode_body(
            rendered,
            call.for_decode,
            self._placement(base),
            stream=call.stream,
            max_tokens=out if isinstance(out, int) else None,
            request_id=self._rid(meta),
        )

    async def derender(self) -> Derender:
        """The derenderer, for the render services' version (asked once)."""
        if self._derender is None:
            version = await self._render_version()
            self._derender = Derender(self.renders, version, self.config, local_decode=self.local_decode)
        return self._derender

    async def _render_version(self) -> tuple[int, int]:
        for base in self.renders.bases:
            with contextlib.suppress(UpstreamError, ValueError, AttributeError):
                status, raw = await self.upstream.get(base, "/version")
                v = version_tuple(str(json.loads(raw).get("version"))) if status == 200 else ()
                if len(v) >= 2:
                    return v[0], v[1]
        return 0, 26  # the oldest it can be: non-streaming derender only, the prompt as a count

    async def open_decode(self, base: str, call: DecodeCall, meta: CallMeta) -> FourHopDecodeStream:
        rendered = await self._rendered_for(call.body, meta, last=True)
        derender = await self.derender()
        resp = await self.upstream.open_stream(
            "decode", base, GENERATE, self._generate_request(rendered, base, call, meta), self._headers(meta)
        )
        prompt = list(rendered["token_ids"])
        model = _model(rendered, call.body)
        derenderer = derender.stream(
            model=model,
            prompt_ids=prompt,
            chat_request=_chat_request(call.body, stream=True),
            request_id=str(rendered.get("request_id") or self._rid(meta)),
            reasoning_open=reasoning_open(rendered, call.body),
        )
        opts = call.body.get("stream_options")
        terms = StreamTerms(
            chunks=ChatChunks(f"chatcmpl-{self._rid(meta)}", model, call.keep_token_ids),
            policy=self.config.policy,
            include_usage=isinstance(opts, Mapping) and bool(opts.get("include_usage")),
            prompt_ids=prompt,
            cached_tokens=call.cached_tokens,
        )
        gathered = Gathered(prompt_token_ids=prompt)
        return FourHopDecodeStream(resp, derenderer, terms, gathered)

    async def decode_json(self, base: str, call: DecodeCall, meta: CallMeta, timeout_s: float) -> DecodeAnswer:
        rendered = await self._rendered_for(call.body, meta, last=True)
        derender = await self.derender()
        start = time.perf_counter()
        data = await self.upstream.post_json(
            "decode",
            base,
            GENERATE,
            self._generate_request(rendered, base, call, meta),
            self._headers(meta),
            timeout_s=timeout_s,
        )
        choice = (data.get("choices") or [None])[0]
        if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
            raise UpstreamProtocolError("decode engine answered no token ids", leg="decode", instance=base)
        prompt = list(rendered["token_ids"])
        ids = [int(t) for t in choice["token_ids"]]
        finish = str(choice.get("finish_reason") or "stop")
        model = _model(rendered, call.body)
        async with asyncio.timeout(max(timeout_s - (time.perf_counter() - start), 1.0)):
            answer = await derender.whole(
                Output(str(rendered.get("request_id") or "x"), ids, finish),
                model=model,
                prompt_ids=prompt,
                chat_request=_chat_request(call.body, stream=False),
            )
        kv = data.get("kv_transfer_params")
        gathered = Gathered(
            token_ids=ids,
            finish_reason=answer.finish_reason,
            prompt_token_ids=prompt,
            handle=kv if isinstance(kv, dict) else None,
        )
        message = _message(answer)
        gathered.answer.message(message)
        usage = data.get("usage") or {}
        cached = call.cached_tokens
        if cached is None and isinstance(usage.get("prompt_tokens_details"), dict):
            cached = usage["prompt_tokens_details"].get("cached_tokens")
        cid = f"chatcmpl-{self._rid(meta)}"
        body = _chat_body(cid, model, message, answer, prompt, ids, cached, call.keep_token_ids)
        return DecodeAnswer(body, gathered)

    # -- releases and write-backs, as generates of bare ids ---------------------------------------
    async def release(self, base: str, handle: Handle, model: str | None) -> None:
        body = wire.tokens_body(
            [0], handles.release_request(handle), self._placement(base), max_tokens=RELEASE_MAX_TOKENS, model=model
        )
        await send_release(self.upstream, base, GENERATE, body, self._headers(CallMeta()))

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        params = handles.write_back_request(call.handle, len(call.token_ids), self.block_size)
        body = wire.tokens_body(
            call.token_ids, params, self._placement(base), max_tokens=WRITE_BACK_MAX_TOKENS, model=call.model
        )
        if call.priority is not None:
            body["priority"] = call.priority
        finished = await read_write_back(
            self.upstream, base, GENERATE, body, self._headers(CallMeta()), call.timeout_s, _first_tokens
        )
        return WriteBackResult.PINNED if finished else WriteBackResult.CACHED

    # -- handles, probes and pass-through: as vLLM's ---------------------------------------------------
    def read_handle(self, handle: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
        return self.vllm.read_handle(handle, seq_len=seq_len, block_size=block_size)

    def pin_id(self, handle: Handle) -> str:
        return self.vllm.pin_id(handle)

    def pins_memory(self, handle: Handle) -> bool:
        return self.vllm.pins_memory(handle)

    async def health(self, base: str) -> bool:
        return await self.vllm.health(base)

    async def load(self, base: str) -> LoadSample | None:
        return await self.vllm.load(base)

    async def models(self, base: str) -> list[ModelCard] | None:
        return await self.vllm.models(base)

    async def api_get(self, base: str, path: str) -> tuple[int, bytes]:
        return await self.vllm.api_get(base, path)

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        return await self.vllm.api_post(base, path, body, meta)

    def _headers(self, meta: CallMeta) -> dict[str, str]:
        return self.upstream.headers(meta.request_id, meta.authorization)

    # -- what the engines say ---------------------------------------------------------------------------
    async def info(self, base: str, role: str) -> EngineInfo | None:
        try:
            _, raw, headers = await self.upstream.probe(base, "/version")
            version = str(json.loads(raw).get("version"))
        except (UpstreamError, ValueError, AttributeError):
            return None
        self._versions[base] = version_tuple(version)
        streams = plugin_lists(headers.get(PLUGIN_HEADER, "")).get("streams", frozenset())
        return EngineInfo(
            version=version,
            stream_handles=True if "generate" in streams else None,
            takes_prompt_ids=True,
            gpus=plugin_lists(headers.get(PLUGIN_HEADER, "")).get("gpus", frozenset()),
        )


def _model(rendered: Mapping[str, Any], body: Mapping[str, Any]) -> str | None:
    m = rendered.get("model") or body.get("model")
    return str(m) if m is not None else None


def _chat_request(body: Mapping[str, Any], *, stream: bool) -> dict[str, Any]:
    """The client's request as derender reads it (its parsers' tool and reasoning settings)."""
    out = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "stream_options")}
    out["stream"] = stream
    return out


def _message(answer: Answer) -> dict[str, Any]:
    m: dict[str, Any] = {
        "role": "assistant",
        "content": answer.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if answer.tool_calls:
        m["tool_calls"] = [tc.as_json() for tc in answer.tool_calls]
    m["reasoning"] = answer.reasoning
    return m


def _chat_body(
    cid: str,
    model: str | None,
    message: dict[str, Any],
    answer: Answer,
    prompt: Sequence[int],
    ids: Sequence[int],
    cached: int | None,
    keep_ids: bool,
) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids)}
    usage["completion_tokens"] = len(ids)
    usage["prompt_tokens_details"] = {"cached_tokens": cached} if cached is not None else None
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": answer.finish_reason,
        "stop_reason": None,
        "token_ids": list(ids) if keep_ids else None,
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": list(prompt) if keep_ids else None,
        "kv_transfer_params": None,
    }


async def _first_tokens(resp: aiohttp.ClientResponse, base: str) -> bool:
    """Read a generate stream to its first chunk with ids; whether the request had finished by then (raises on
    an error event or an end without output)."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            raise UpstreamProtocolError("write-back: unreadable event", leg="prefill", instance=base) from None
        if not isinstance(event, dict) or "error" in event:
            raise UpstreamStatus(500, event if isinstance(event, dict) else None, leg="prefill", instance=base)
        choices = event.get("choices") or []
        if not choices:
            continue
        finished = choices[0].get("finish_reason") is not None
        rest = resp.content.read_nowait()
        return finished or b'"finish_reason":"' in rest.replace(b" ", b"")
    raise UpstreamProtocolError("write-back: the stream ended without output", leg="prefill", instance=base)


def _local_decode(tokenizer: str | None) -> Callable[[Sequence[int]], str] | None:
    if tokenizer == "sim":  # the simulator's tokenizer: for runs against ``turnkv sim``
        from turnkv.sim.tokenizer import Tokenizer

        return Tokenizer().decode
    return load_decode(tokenizer) if tokenizer else None


@contextlib.asynccontextmanager
async def fourhop_engine(settings: Settings) -> AsyncIterator[FourHopEngine]:
    """A ``FourHopEngine`` with its own aiohttp session; the render services are ``four_hop.render`` (else
    ``render``)."""
    fh = settings.four_hop
    bases = list(fh.render) or ([settings.render] if settings.render else [])
    if not bases:
        raise ConfigError("engine vllm-four-hop needs a render service: four_hop.render (or render)")
    local = _local_decode(fh.tokenizer)
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections, limit_per_host=0, keepalive_timeout=settings.engine_keep_alive_s
    )
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        upstream = Upstream(session, settings.timeouts, settings.upstream_api_key)

        async def post(leg: str, base: str, path: str, body: Any) -> Any:
            return await upstream.post_json(
                leg, base, path, body, upstream.headers(None, None), timeout_s=settings.timeouts.render_s
            )

        config = DerenderConfig(
            reasoning_parser=fh.reasoning_parser,
            tool_parser=fh.tool_parser,
            mode=fh.derender,
            policy=FlushPolicy(fh.flush_tokens, fh.flush_ms / 1e3),
        )
        yield FourHopEngine(
            upstream,
            settings.block_size,
            RenderClient(bases, post),
            config,
            local_decode=local,
            allow_client_kv_transfer_params=settings.allow_client_kv_transfer_params,
        )
