"""Streaming derender that scales: a decode engine's token ids to OpenAI deltas, never one render call per token.

Three ways, chosen per stream (``Derender.stream``):

* ``IncrementalDerender`` (turnkv's own; any render service version): the ids' text from a ``TextSource`` a
  short window at a time (``detok``), split into reasoning and content by turnkv's reading of the parsers'
  markup (``markup``), then one non-streaming derender at the end: that answer is the truth, and the last
  delta is what the stream still owes to add up to it (tool calls come whole, there). A render service's
  cost: that one call, plus one ``/detokenize`` per flush where the text comes from it.
* ``VllmStreamDerender`` (render services from vLLM 0.31, for parsers turnkv has no reading of): vLLM's
  streaming derender, which replays the whole output on every call, with the client carrying its state;
  batching keeps the calls few.
* ``FinalOnlyDerender``: nothing until the end, then the whole answer in one delta (a 0.26 render service
  with parsers turnkv cannot read).

``relay`` drives one: D's chunks are flushed to it in batches, by count (``FlushPolicy.max_tokens``) and by
time (``max_delay_s`` after the oldest waiting id); the first ids are flushed the moment they arrive, so
batching never delays the first token; and while a flush is in flight the ids that arrive meanwhile wait
for the next one (one call in flight per stream; D's next chunk is read meanwhile, later ones wait in the
connection's buffers).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnkv.derender.answer import Answer, Delta, Ending, Output, ToolCall, output_ids_for_text, reconcile
from turnkv.derender.client import RenderClient
from turnkv.derender.detok import IncrementalText
from turnkv.derender.markup import MarkupSplitter
from turnkv.errors import UpstreamProtocolError

Whole = Callable[[Output], Any]  # async: the final non-streaming derender of an output -> Answer


@dataclass(frozen=True)
class FlushPolicy:
    """When D's ids go to the derenderer: at once for the first, then by count or by age, whichever first."""

    max_tokens: int = 16
    max_delay_s: float = 0.05

    @classmethod
    def immediate(cls) -> FlushPolicy:
        """Every chunk as it comes (a derenderer whose flushes cost no call)."""
        return cls(max_tokens=1, max_delay_s=0.0)


class StreamDerenderer(abc.ABC):
    """One streamed answer's derendering: ids in, deltas out."""

    remote_flushes: bool = True  # a flush costs a render-service call (batching pays)

    def __init__(self) -> None:
        self.ids: list[int] = []

    @abc.abstractmethod
    async def feed(self, ids: Sequence[int]) -> Delta: ...

    @abc.abstractmethod
    async def finish(self, ids: Sequence[int], finish_reason: str, request_id: str) -> Ending: ...

    @property
    @abc.abstractmethod
    def calls(self) -> int:
        """Render-service calls made so far."""


class IncrementalDerender(StreamDerenderer):
    def __init__(self, text: IncrementalText, splitter: MarkupSplitter, whole: Whole, *, remote: bool) -> None:
        super().__init__()
        self.text = text
        self.splitter = splitter
        self.whole = whole
        self.remote_flushes = remote
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls + int(getattr(self.text.source, "calls", 0)) * int(self.remote_flushes)

    async def feed(self, ids: Sequence[int]) -> Delta:
        self.ids += ids
        split = self.splitter.feed(await self.text.push(ids))
        return Delta(split.reasoning, split.content)

    async def finish(self, ids: Sequence[int], finish_reason: str, request_id: str) -> Ending:
        self.ids += ids
        text_ids = output_ids_for_text(self.text.ids + list(ids), finish_reason)[len(self.text.ids) :]
        a = self.splitter.feed(await self.text.push(text_ids, final=True))
        b = self.splitter.finish()
        self._calls += 1
        answer: Answer = await self.whole(Output(request_id, self.ids, finish_reason))
        streamed = Delta(self.splitter.reasoning, self.splitter.content)
        rest, diverged = reconcile(streamed, answer)
        # what this flush released and the rest, in one delta
        last = Delta(a.reasoning + b.reasoning + rest.reasoning, a.content + b.content + rest.content, rest.tool_calls)
        return Ending(answer, last, diverged, self.calls)


class FinalOnlyDerender(StreamDerenderer):
    remote_flushes = False

    def __init__(self, whole: Whole) -> None:
        super().__init__()
        self.whole = whole
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls

    async def feed(self, ids: Sequence[int]) -> Delta:
        self.ids += ids
        return Delta()

    async def finish(self, ids: Sequence[int], finish_reason: str, request_id: str) -> Ending:
        self.ids += ids
        self._calls += 1
        answer: Answer = await self.whole(Output(request_id, self.ids, finish_reason))
        rest, _ = reconcile(Delta(), answer)
        return Ending(answer, rest, False, self._calls)


class VllmStreamDerender(StreamDerenderer):
    """vLLM's streaming derender (0.31+): one call per flush, the state carried here."""

    def __init__(
        self,
        client: RenderClient,
        *,
        model: str | None,
        prompt_ids: Sequence[int],
        chat_request: Mapping[str, Any] | None,
        request_id: str,
    ) -> None:
        super().__init__()
        self.client = client
        self.model = model
        self.prompt_ids = list(prompt_ids)
        self.chat_request = dict(chat_request) if chat_request is not None else None
        self.request_id = request_id
        self.state: Any = None
        self._calls = 0
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.finish_reason: str | None = None

    @property
    def calls(self) -> int:
        return self._calls

    async def _call(self, ids: Sequence[int], finish_reason: str | None) -> Delta:
        body: dict[str, Any] = {
            "stream": True,
            "model": self.model,
            "generate_chunk": {
                "request_id": self.request_id,
                "choices": [{"index": 0, "token_ids": list(ids), "finish_reason": finish_reason}],
            },
            "stream_state": self.state,
            "prompt_token_ids": self.prompt_ids,
            "prompt_tokens": len(self.prompt_ids),
        }
        if self.chat_request is not None:
            body["chat_request"] = {**self.chat_request, "stream": True}
        self._calls += 1
        out = await self.client.derender_chat(body)
        self.state = out.get("stream_state")
        chunk = out.get("chunk")
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("choices"), list):
            raise UpstreamProtocolError("streaming derender answered no chunk", leg="derender")
        delta = Delta()
        for choice in chunk["choices"]:
            d = choice.get("delta") or {}
            calls = tuple(
                ToolCall(str(tc.get("id") or ""), str((tc.get("function") or {}).get("name") or ""), "")
                for tc in d.get("tool_calls") or []
                if tc.get("id")
            )
            args = "".join(str((tc.get("function") or {}).get("arguments") or "") for tc in d.get("tool_calls") or [])
            self._merge_args(calls, args)
            delta = Delta(delta.reasoning + (d.get("reasoning") or ""), delta.content + (d.get("content") or ""))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def _merge_args(self, new: tuple[ToolCall, ...], args: str) -> None:
        self.tool_calls += new
        if args and self.tool_calls:
            last = self.tool_calls[-1]
            self.tool_calls[-1] = ToolCall(last.id, last.name, last.arguments + args)

    async def feed(self, ids: Sequence[int]) -> Delta:
        self.ids += ids
        return await self._call(ids, None)

    async def finish(self, ids: Sequence[int], finish_reason: str, request_id: str) -> Ending:
        self.ids += ids
        last = await self._call(ids, finish_reason)
        calls = tuple(self.tool_calls)
        answer = Answer(self.content or None, self.reasoning or None, calls, self.finish_reason or finish_reason)
        return Ending(answer, Delta(last.reasoning, last.content, calls), False, self._calls)


# -- driving one ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One streamed generate chunk of D, as the relay needs it."""

    token_ids: Sequence[int]
    finish_reason: str | None = None


@dataclass
class FlushStats:
    flushes: int = 0
    first_token_wait_s: float | None = None  # from D's first ids to the start of their flush (batching's delay)


async def relay(
    chunks: AsyncIterator[Chunk],
    derenderer: StreamDerenderer,
    policy: FlushPolicy,
    *,
    request_id: str,
    stats: FlushStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncIterator[Delta | Ending]:
    """Deltas as D's ids are flushed to ``derenderer``, then the ``Ending`` (see the module docstring).

    D's next chunk is read while a flush is in flight (its ids join the next flush). A stream that ends
    without a finish reason raises ``UpstreamProtocolError``."""
    if not derenderer.remote_flushes:
        policy = FlushPolicy.immediate()
    stats = stats if stats is not None else FlushStats()
    it = aiter(chunks)
    pending: list[int] = []
    oldest: float | None = None
    first = True
    nxt: asyncio.Future[Chunk] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(anext(it))
            wait = None if oldest is None else max(0.0, oldest + policy.max_delay_s - clock())
            done, _ = await asyncio.wait({nxt}, timeout=wait)
            if nxt in done:
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    raise UpstreamProtocolError("decode stream ended without a finish reason", leg="decode") from None
                nxt = None
                if chunk.finish_reason is not None:
                    yield await derenderer.finish([*pending, *chunk.token_ids], chunk.finish_reason, request_id)
                    return
                if not chunk.token_ids:
                    continue
                pending += chunk.token_ids
                oldest = clock() if oldest is None else oldest
                if not (first or len(pending) >= policy.max_tokens or clock() - oldest >= policy.max_delay_s):
                    continue
            if first and stats.first_token_wait_s is None and oldest is not None:
                stats.first_token_wait_s = clock() - oldest
            first = False
            batch, pending, oldest = pending, [], None
            stats.flushes += 1
            if nxt is None:
                nxt = asyncio.ensure_future(anext(it))  # read D on while the flush is in flight
            delta = await derenderer.feed(batch)
            if delta:
                yield delta
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await nxt
