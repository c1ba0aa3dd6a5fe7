"""D's streamed generate, derendered into the chat completion chunks a client of vLLM's chat server gets.

``GenerateReader`` reads D's SSE (token ids, no text) and collects what the next turn needs: D's output ids,
its finish reason, an error event, and D's handle where a chunk carries it (turnkv's vLLM plugin puts it on
the finishing chunk; no vLLM version does). ``FourHopDecodeStream`` runs it through ``turnkv.derender.relay``
and hands the relay what it reads: a role chunk first, then a chunk per delta, then the last text, the tool
calls and the finish reason, a usage chunk where the client asked for one (cached tokens as this turn counts
them), and ``[DONE]``. ``ChatChunks`` writes them, compact, in vLLM's shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from turnkv.derender import Chunk, Delta, Ending, FlushPolicy, StreamDerenderer, relay
from turnkv.engine.base import DecodeStream, Gathered, Piece, StreamBroken
from turnkv.engine.vllm.http import let_go
from turnkv.errors import UpstreamError
from turnkv.openai.sse import DONE, SSESplitter


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class ChatChunks:
    """Chat completion chunks for one answer."""

    id: str
    model: str | None
    keep_token_ids: bool
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        c: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created}
        c["model"] = self.model
        c["choices"] = [] if choice is None else [choice]
        c.update(extra)
        return _dumps(c)

    def role(self, prompt_ids: Sequence[int]) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._chunk(choice, prompt_token_ids=list(prompt_ids) if self.keep_token_ids else None)

    def delta(self, d: Delta, ids: Sequence[int] | None = None, finish_reason: str | None = None) -> bytes:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning"] = d.reasoning
        if d.content or (d.tool_calls and d.content == ""):
            delta["content"] = d.content or None
        if d.tool_calls:
            delta["tool_calls"] = [tc.as_json(i) for i, tc in enumerate(d.tool_calls)]
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = list(ids) if self.keep_token_ids and ids is not None else None
        return self._chunk(choice)

    def usage(self, prompt: int, completion: int, cached: int | None) -> bytes:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
        usage["completion_tokens"] = completion
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return self._chunk(None, usage=usage)


class GenerateReader:
    """D's generate stream as ``Chunk``s; what it reads is collected into ``gathered``."""

    def __init__(self, resp: aiohttp.ClientResponse, gathered: Gathered) -> None:
        self.resp = resp
        self.gathered = gathered
        self.splitter = SSESplitter()
        self.done = False  # [DONE] read
        self.usage: dict[str, Any] | None = None

    def _event(self, payload: bytes) -> Chunk | None:
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            self.gathered.error = err if isinstance(err, dict) else {"message": str(err)}
            raise DecodeError(self.gathered.error)
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        kv = obj.get("kv_transfer_params")
        if isinstance(kv, dict):
            self.gathered.handle = kv
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            ids = [int(t) for t in choice.get("token_ids") or []]
            self.gathered.token_ids += ids
            finish = choice.get("finish_reason")
            if finish is not None:
                self.gathered.finish_reason = str(finish)
            return Chunk(ids, None if finish is None else str(finish))
        return None

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.done:
            try:
                data = await self.resp.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise StreamBroken(type(exc).__name__) from exc
            if not data:
                return
            for payload in self.splitter.feed(data):
                if payload == DONE:
                    self.done = True
                    break
                chunk = self._event(payload)
                if chunk is not None:
                    yield chunk


class DecodeError(Exception):
    """D ended its stream with an error event."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message")))
        self.error = error


@dataclass(frozen=True)
class StreamTerms:
    """What the client's stream looks like and how it is derendered."""

    chunks: ChatChunks
    policy: FlushPolicy
    include_usage: bool
    prompt_ids: Sequence[int]
    cached_tokens: int | None  # what usage says of cached prompt tokens (None: D's own figure, if any)


class FourHopDecodeStream(DecodeStream):
    """D's generate stream, derendered (see the module docstring)."""

    def __init__(
        self, resp: aiohttp.ClientResponse, derenderer: StreamDerenderer, terms: StreamTerms, gathered: Gathered
    ) -> None:
        self._resp = resp
        self._gathered = gathered
        self._reader = GenerateReader(resp, gathered)
        self._terms = terms
        self._relay = relay(self._reader.chunks(), derenderer, terms.policy, request_id=terms.chunks.id)
        self._started = False
        self.ending: Ending | None = None

    @property
    def collected(self) -> Gathered:
        return self._gathered

    async def read(self) -> list[Piece] | None:
        if self.done:
            return None
        t = self._terms
        if not self._started:
            self._started = True
            return [(t.chunks.role(t.prompt_ids), False, False)]
        try:
            item = await anext(self._relay)
        except StopAsyncIteration:
            self.done = True
            return None
        except DecodeError as exc:
            self.done = True
            return [(_dumps({"error": exc.error}), False, True)]
        except UpstreamError as exc:  # the final derender, or a refused streaming derender call
            self.done = True
            self._gathered.error = exc.body()["error"]
            return [(_dumps(exc.body()), False, True)]
        if isinstance(item, Delta):
            self._gathered.answer.delta(_delta_json(item))
            return [(t.chunks.delta(item), True, False)]
        return self._ending(item)

    def _ending(self, ending: Ending) -> list[Piece]:
        t = self._terms
        self.ending = ending
        self._gathered.answer.delta(_delta_json(ending.rest))
        finish = ending.answer.finish_reason
        self._gathered.finish_reason = finish
        out: list[Piece] = [(t.chunks.delta(ending.rest, finish_reason=finish), True, False)]
        if t.include_usage:
            completion = len(self._gathered.token_ids)
            cached = t.cached_tokens
            if cached is None and self._reader.usage:
                details = self._reader.usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
            out.append((t.chunks.usage(len(t.prompt_ids), completion, cached), False, False))
        self.done = True  # the relay ends the client's stream with [DONE] itself
        return out

    async def drain(self, timeout_s: float) -> None:
        if self._resp.content.at_eof():
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._resp.content.read()

    async def salvage(self, timeout_s: float) -> None:
        """The client left: D's handle may still come on its last chunk; read D to its end, derendering nothing."""
        await self._relay.aclose()
        if self._reader.done or self._gathered.error is not None:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, StreamBroken, DecodeError):
            async with asyncio.timeout(timeout_s):
                async for _ in self._reader.chunks():
                    pass

    def close(self) -> None:
        self.closed = True
        let_go(self._resp, read_to_end=self._reader.done)

    def abort(self) -> None:
        self.closed = True
        self._resp.close()


def _delta_json(d: Delta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.content:
        out["content"] = d.content
    if d.reasoning:
        out["reasoning"] = d.reasoning
    if d.tool_calls:
        out["tool_calls"] = [tc.as_json(i) for i, tc in enumerate(d.tool_calls)]
    return out
