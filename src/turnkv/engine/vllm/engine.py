"""``VllmEngine``: the engine seam over vLLM's HTTP API and its P/D protocol (NixlConnector).

A turn's calls as vLLM's P/D proxy makes them: P prefills with ``max_tokens: 1`` and
``kv_transfer_params`` asking for remote decode (with D's trimmed handle to pull, or a release);
its params go to D with the client's request and ``return_token_ids``; D's handle comes back in the
answer (the final SSE chunk from 0.33 on). A rendered prompt goes to P as token ids on
``/v1/completions``, and to D inside the params from 0.32 on, so D cannot tokenize differently.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from turnkv.config import Settings
from turnkv.engine.base import (
    CallMeta,
    DecodeAnswer,
    DecodeCall,
    EngineInfo,
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
from turnkv.engine.vllm import handles
from turnkv.engine.vllm.http import Upstream
from turnkv.engine.vllm.info import PLUGIN_HEADER, engine_info, load_sample
from turnkv.engine.vllm.prefill import (
    RELEASE_MAX_TOKENS,
    WRITE_BACK_MAX_TOKENS,
    ask_prefill,
    prefill_result,
    read_write_back,
    send_release,
)
from turnkv.engine.vllm.stream import DecodeCapture, VllmDecodeStream
from turnkv.errors import ClientError, UpstreamError, UpstreamProtocolError, UpstreamStatus

RENDER_PATH = "/v1/chat/completions/render"
# request fields that do not shape the prompt (vLLM's render refuses some of them)
_NOT_FOR_RENDER = (
    "stream",
    "stream_options",
    "kv_transfer_params",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
)
# fields of the client's request a 1-token prefill does without
_NOT_FOR_PREFILL = (
    "stream",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    "kv_transfer_params",
    "return_token_ids",
    "n",
    "logprobs",
    "top_logprobs",
)


class VllmEngine:
    name = "vllm"

    def __init__(self, upstream: Upstream, block_size: int, *, allow_client_kv_transfer_params: bool = False) -> None:
        self.upstream = upstream
        self.block_size = block_size
        self.allow_client_kv_transfer_params = allow_client_kv_transfer_params

    # -- one turn --------------------------------------------------------------------------------
    def check_request(self, body: Mapping[str, Any]) -> None:
        """``kv_transfer_params`` are turnkv's to set: a client's would steer P's and D's KV transfers
        (unless ``allow_client_kv_transfer_params``)."""
        if "kv_transfer_params" in body and not self.allow_client_kv_transfer_params:
            raise ClientError("kv_transfer_params is set by turnkv, not by clients", param="kv_transfer_params")

    async def render(self, base: str, body: Mapping[str, Any], meta: CallMeta) -> list[int]:
        req = {k: v for k, v in body.items() if k not in _NOT_FOR_RENDER}
        data = await self.upstream.post_json("render", base, RENDER_PATH, req, self._headers(meta))
        ids = data.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise UpstreamStatus(
                502, {"error": {"message": "render returned no token ids"}}, leg="render", instance=base
            )
        return ids  # each id is checked to be an int when the chain is built (array("q") refuses others)

    def _prefill_request(self, call: PrefillCall) -> tuple[str, dict[str, Any]]:
        params = handles.prefill_params(call.handle, self.block_size)
        if call.prompt_ids is not None:
            body: dict[str, Any] = {
                "model": call.body.get("model"),
                "prompt": call.prompt_ids,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": params,
            }
            if call.body.get("cache_salt") is not None:
                body["cache_salt"] = call.body["cache_salt"]
            return "/v1/completions", {k: v for k, v in body.items() if v is not None}
        body = {k: v for k, v in call.body.items() if k not in _NOT_FOR_PREFILL}
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["kv_transfer_params"] = params
        if call.return_ids:
            body["return_token_ids"] = True  # the prompt's ids come back with P's answer (every version)
        return call.path, body

    async def prefill(self, base: str, call: PrefillCall, meta: CallMeta) -> PrefillResult:
        path, body = self._prefill_request(call)
        data = await ask_prefill(self.upstream, base, path, body, self._headers(meta), call)
        return prefill_result(data, _prompt_ids(data) if call.return_ids else None)

    def _decode_request(self, call: DecodeCall) -> dict[str, Any]:
        body = dict(call.body)
        body["stream"] = call.stream
        if call.track:
            body["return_token_ids"] = True
        # Without P's params (decode-local) D gets none at all: vLLM (0.26-0.33) pins the blocks of a
        # request whose params set neither do_remote_prefill nor do_remote_decode but never tracks the pin,
        # so no release or TTL frees it until D restarts. Its prefix cache still holds the turn.
        if call.for_decode:
            params = dict(call.for_decode)
            if call.prompt_ids is not None:
                params["prompt_token_ids"] = call.prompt_ids
            body["kv_transfer_params"] = params
        return body

    def _capture(self, call: DecodeCall) -> DecodeCapture:
        return DecodeCapture(keep_token_ids=call.keep_token_ids, collect=call.track, cached_tokens=call.cached_tokens)

    async def open_decode(self, base: str, call: DecodeCall, meta: CallMeta) -> VllmDecodeStream:
        resp = await self.upstream.open_stream(
            "decode", base, call.path, self._decode_request(call), self._headers(meta)
        )
        return VllmDecodeStream(resp, self._capture(call))

    async def decode_json(self, base: str, call: DecodeCall, meta: CallMeta, timeout_s: float) -> DecodeAnswer:
        data = await self.upstream.post_json(
            "decode", base, call.path, self._decode_request(call), self._headers(meta), timeout_s=timeout_s
        )
        capture = self._capture(call)
        return DecodeAnswer(capture.body(data), capture)

    async def release(self, base: str, handle: Handle, model: str | None) -> None:
        """Send P the handle as a one-token remote prefill (``handles.release_request``), streamed, and
        close the stream at its first event or after ``RELEASE_WAIT_S`` in P's queue: either way D is
        told (P notifies D when it allocates the request, and vLLM's abort path notifies D for a request
        aborted before that), and the abort keeps P from pinning the request's own block."""
        body: dict[str, Any] = {
            "prompt": ".",
            "max_tokens": RELEASE_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "kv_transfer_params": handles.release_request(handle),
        }
        if model:
            body["model"] = model
        await send_release(self.upstream, base, "/v1/completions", body, self._headers(CallMeta()))

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        """Send P the handle's sequence as token ids with D's handle for a remote prefill
        (``handles.write_back_request``), streamed, and close the stream at its first output: P has then
        pulled D's blocks (its request waits for the pull before it computes the last token) and cached them,
        and its read told D to free them. The close aborts the request, so P keeps no pin of its own: its
        blocks go to its prefix cache, evictable. Should the request have finished by then (P decoded its
        ``WRITE_BACK_MAX_TOKENS`` before the abort reached it), P pins the blocks as D did: released through
        ``call.release_via`` where the final event carried P's handle (``RELEASED``), else ``PINNED``. An
        error event, or an end before any output, is P failing the pull (``kv_load_failure_policy: fail``)."""
        body: dict[str, Any] = {
            "prompt": list(call.token_ids),
            "max_tokens": WRITE_BACK_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "kv_transfer_params": handles.write_back_request(call.handle, len(call.token_ids), self.block_size),
        }
        if call.model:
            body["model"] = call.model
        if call.priority is not None:
            body["priority"] = call.priority
        finished, left = await read_write_back(
            self.upstream, base, "/v1/completions", body, self._headers(CallMeta()), call.timeout_s, _first_output
        )
        if not finished:
            return WriteBackResult.CACHED
        if left is None or call.release_via is None:
            return WriteBackResult.PINNED
        # P pinned the blocks as D did; its handle came with the final event: D reads it, and P frees them
        await self.release(call.release_via, left, call.model)
        return WriteBackResult.RELEASED

    # -- handles -------------------------------------------------------------------------------
    def read_handle(self, handle: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
        return handles.read_handle(handle, seq_len=seq_len, block_size=block_size)

    def pin_id(self, handle: Handle) -> str:
        return handles.pin_id(handle)

    def pins_memory(self, handle: Handle) -> bool:
        return handles.pins_memory(handle)

    # -- the engine's own view -------------------------------------------------------------------
    async def health(self, base: str) -> bool:
        try:
            status, _ = await self.upstream.get(base, "/health")
        except UpstreamError:
            return False
        return status == 200

    async def info(self, base: str, role: str) -> EngineInfo | None:
        try:
            _, raw, headers = await self.upstream.probe(base, "/version")
            version = str(json.loads(raw).get("version"))
        except (UpstreamError, ValueError, AttributeError):
            return None
        return engine_info(version, headers.get(PLUGIN_HEADER, ""), base=base, decode=role == "decode")

    async def load(self, base: str) -> LoadSample | None:
        try:
            status, raw = await self.upstream.get(base, "/metrics")
        except UpstreamError:
            return None
        return load_sample(raw.decode("utf-8", "replace")) if status == 200 else None

    async def models(self, base: str) -> list[ModelCard] | None:
        status, raw = await self.upstream.get(base, "/v1/models")
        if status != 200:
            return None
        listed = json.loads(raw).get("data", [])  # vLLM lists max_model_len; OpenAI does not
        return [
            ModelCard(str(m["id"]), m["max_model_len"] if isinstance(m.get("max_model_len"), int) else None)
            for m in listed
        ]

    # -- passed through ----------------------------------------------------------------------------
    async def api_get(self, base: str, path: str) -> tuple[int, bytes]:
        return await self.upstream.get(base, path)

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        return await self.upstream.post_json("render", base, path, body, self._headers(meta))

    def _headers(self, meta: CallMeta) -> dict[str, str]:
        return self.upstream.headers(meta.request_id, meta.authorization)


@contextlib.asynccontextmanager
async def vllm_engine(settings: Settings) -> AsyncIterator[VllmEngine]:
    """A ``VllmEngine`` with its own aiohttp session (one per process, closed on exit)."""
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections, limit_per_host=0, keepalive_timeout=settings.engine_keep_alive_s
    )
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        yield VllmEngine(
            Upstream(session, settings.timeouts, settings.upstream_api_key),
            settings.block_size,
            allow_client_kv_transfer_params=settings.allow_client_kv_transfer_params,
        )


async def _first_output(resp: aiohttp.ClientResponse, base: str) -> tuple[bool, Handle | None]:
    """Read a completion stream up to its first event with output, and whatever else the engine has already
    sent: whether the request had finished by then, and the handle its final event carried (vLLM 0.33 puts
    the finished request's ``kv_transfer_params`` there). Raises on an error event or an end without output."""
    async for raw in resp.content:
        event = _event(raw, base)
        if event is None or not event.get("choices"):
            continue
        finished = event["choices"][0].get("finish_reason") is not None
        left = event.get("kv_transfer_params")
        for line in resp.content.read_nowait().split(b"\n"):  # sent already: the request may have ended
            later = _event(line, base, complete=False)
            if later and later.get("choices") and later["choices"][0].get("finish_reason") is not None:
                finished, left = True, later.get("kv_transfer_params")
        return finished, left if finished and isinstance(left, dict) else None
    raise UpstreamProtocolError("write-back: the stream ended without output", leg="prefill", instance=base)


def _event(raw: bytes, base: str, *, complete: bool = True) -> dict[str, Any] | None:
    """One SSE line's event (None: not an event, or, not ``complete``, a line cut short); an error event
    raises."""
    line = raw.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return None
    try:
        event = json.loads(line[5:])
    except ValueError:
        if not complete:
            return None
        raise UpstreamProtocolError("write-back: unreadable event", leg="prefill", instance=base) from None
    if not isinstance(event, dict) or "error" in event:
        raise UpstreamStatus(500, event if isinstance(event, dict) else None, leg="prefill", instance=base)
    return event


def _prompt_ids(data: Mapping[str, Any]) -> list[int] | None:
    """The prompt ids P's answer says with ``return_token_ids``: top-level on chat, in the choice on completions
    (None when it says none; each id is checked to be an int when the chain is built)."""
    ids = data.get("prompt_token_ids")
    if ids is None:
        choices = data.get("choices")
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    return ids if isinstance(ids, list) and ids else None
