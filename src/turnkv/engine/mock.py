"""``MockEngine``: an engine family whose calls a handler function answers, for tests that need scripted
answers only (as httpx's ``MockTransport`` answers requests with a handler).

The handler gets each turn call as a value (``Render``, ``Prefill``, ``Decode``, ``Release``,
``WriteBackCall``) and returns what the call returns: the prompt's token ids, a ``PrefillResult``, a ``Reply``
(D's answer, streamed or whole as the call asks), None for a release, a ``WriteBackResult`` or None (cached)
for a write-back; or it raises an ``UpstreamError``. It may be async. A
handle is a dict with a ``pin`` (its pin id) and the ``tokens`` it holds. Everything else is
``EngineDefaults``' (healthy, no version, no load, nothing passed through), but ``models``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnkv.engine.base import (
    CallMeta,
    DecodeAnswer,
    DecodeCall,
    DecodeStream,
    EngineDefaults,
    Gathered,
    Handle,
    HandleFacts,
    HandleProblem,
    ModelCard,
    Piece,
    PrefillCall,
    PrefillResult,
    WriteBack,
    WriteBackResult,
)


@dataclass(frozen=True)
class Render:
    base: str
    body: Mapping[str, Any]


@dataclass(frozen=True)
class Prefill:
    base: str
    call: PrefillCall


@dataclass(frozen=True)
class Decode:
    base: str
    call: DecodeCall


@dataclass(frozen=True)
class Release:
    base: str
    handle: Handle


@dataclass(frozen=True)
class WriteBackCall:
    base: str
    call: WriteBack


Call = Render | Prefill | Decode | Release | WriteBackCall


@dataclass(frozen=True)
class Reply:
    """D's answer to a ``Decode``: its text, and what it says for the next turn when the call tracks it."""

    content: str = ""
    finish_reason: str = "stop"
    token_ids: Sequence[int] = ()  # the answer's ids
    prompt_ids: Sequence[int] | None = None  # D's prompt ids
    handle: Handle | None = None  # D's handle, on the answer's last event

    def events(self, chat: bool, usage: Mapping[str, Any] | None) -> list[bytes]:
        """The answer as a client of the plain engine streams it (a chat or a completion)."""
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: dict[str, Any] | None, **extra: Any) -> bytes:
            choices = [] if piece is None else [{"index": 0, **piece}]
            return json.dumps({"id": "mock", "object": kind, "choices": choices, **extra}).encode()

        def text(t: str, finish: str | None = None) -> dict[str, Any]:
            return ({"delta": {"content": t}} if chat else {"text": t}) | {"finish_reason": finish}

        out = [chunk(text(self.content)), chunk(text("", self.finish_reason))]
        return out + ([chunk(None, usage=dict(usage))] if usage is not None else [])


def _collected(reply: Reply, call: DecodeCall) -> Gathered:
    c = Gathered(finish_reason=reply.finish_reason, handle=reply.handle)
    c.answer.message({"content": reply.content})
    if call.track:
        c.token_ids = list(reply.token_ids)
        c.prompt_token_ids = None if reply.prompt_ids is None else list(reply.prompt_ids)
    return c


class ScriptedStream(DecodeStream):
    """A streamed answer known in advance: its events in one read, what they show collected."""

    def __init__(self, events: list[bytes], collected: Gathered) -> None:
        self._events = events
        self._collected = collected

    @property
    def collected(self) -> Gathered:
        return self._collected

    async def read(self) -> list[Piece] | None:
        if self.done or self.closed:
            return None
        self.done = True
        return [(e, True, False) for e in self._events]

    async def drain(self, timeout_s: float) -> None:
        return None

    async def salvage(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class MockEngine(EngineDefaults):
    name = "mock"

    def __init__(self, handler: Callable[[Call], Any], *, model: str = "mock-model", max_model_len: int = 8192):
        self.handler = handler
        self.model = model
        self.max_model_len = max_model_len
        self.calls: list[Call] = []  # every call the handler answered, in order

    async def _answer(self, call: Call) -> Any:
        self.calls.append(call)
        out = self.handler(call)
        return await out if inspect.isawaitable(out) else out

    async def render(self, base: str, body: Mapping[str, Any], meta: CallMeta) -> list[int]:
        return list(await self._answer(Render(base, body)))

    async def prefill(self, base: str, call: PrefillCall, meta: CallMeta) -> PrefillResult:
        result = await self._answer(Prefill(base, call))
        assert isinstance(result, PrefillResult), "the handler answers a Prefill with a PrefillResult"
        return result

    async def _reply(self, base: str, call: DecodeCall) -> Reply:
        reply = await self._answer(Decode(base, call))
        assert isinstance(reply, Reply), "the handler answers a Decode with a Reply"
        return reply

    def _usage(self, reply: Reply, call: DecodeCall) -> dict[str, Any]:
        prompt, out = len(reply.prompt_ids or ()), len(reply.token_ids)
        cached = {"cached_tokens": call.cached_tokens or 0}
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out} | {
            "prompt_tokens_details": cached
        }

    async def open_decode(self, base: str, call: DecodeCall, meta: CallMeta) -> ScriptedStream:
        reply = await self._reply(base, call)
        opts = call.body.get("stream_options")
        usage = self._usage(reply, call) if isinstance(opts, Mapping) and opts.get("include_usage") else None
        return ScriptedStream(reply.events(call.path.endswith("/chat/completions"), usage), _collected(reply, call))

    async def decode_json(self, base: str, call: DecodeCall, meta: CallMeta, timeout_s: float) -> DecodeAnswer:
        reply = await self._reply(base, call)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason}
        if call.path.endswith("/chat/completions"):
            choice["message"] = {"role": "assistant", "content": reply.content}
        else:
            choice["text"] = reply.content
        body = {"id": "mock", "model": self.model, "choices": [choice], "usage": self._usage(reply, call)}
        return DecodeAnswer(body, _collected(reply, call))

    async def release(self, base: str, handle: Handle, model: str | None) -> None:
        await self._answer(Release(base, handle))

    async def write_back(self, base: str, call: WriteBack) -> WriteBackResult:
        result = await self._answer(WriteBackCall(base, call))
        return WriteBackResult.CACHED if result is None else WriteBackResult(result)

    def read_handle(self, handle: Handle, *, seq_len: int, block_size: int) -> HandleFacts | HandleProblem:
        tokens = handle.get("tokens")
        if not isinstance(tokens, int) or "pin" not in handle:
            return HandleProblem.NOT_A_DECODE_HANDLE
        if not 0 < tokens <= seq_len:
            return HandleProblem.INCONSISTENT
        return HandleFacts(tokens=tokens, engine_id=str(handle.get("engine", self.name)))

    def pin_id(self, handle: Handle) -> str:
        return str(handle["pin"])

    def pins_memory(self, handle: Handle) -> bool:
        return "pin" in handle

    async def models(self, base: str) -> list[ModelCard] | None:
        return [ModelCard(self.model, self.max_model_len)]


__all__ = ["Call", "Decode", "MockEngine", "Prefill", "Release", "Render", "Reply", "ScriptedStream", "WriteBackCall"]
