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

``relay`` drives one: D's chunks are flushed to it in batches, by count (``FlushPolicy.max_tokens``) and
by time (``max_delay_s`` after the oldest waiting id); until a flush has shown the client text, ids are
flushed the moment they arrive, so batching never delays the first visible token; and while a flush is in
flight the ids that arrive meanwhile wait for the next one (one call in flight per stream; a reader task
hands D's ids over, so D is read on).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
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
        """Every chunk as it comes."""
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


class _Batches:
    """D's ids as the reader hands them over, and when a flush is due (the first ids, a full batch, the
    oldest id's age, the end): ``due`` is set then, so the relay wakes once a flush, not once a chunk."""

    def __init__(self, policy: FlushPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.pending: list[int] = []
        self.oldest: float | None = None
        self.finish: str | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.first = True
        self.due = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.token_ids:
            if self.oldest is None:
                self.oldest = self.clock()
                if not self.first:
                    self._timer = asyncio.get_running_loop().call_later(self.policy.max_delay_s, self.due.set)
            self.pending += chunk.token_ids
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason
            self.ended = True
        if self.first or self.ended or len(self.pending) >= self.policy.max_tokens:
            self.due.set()

    def eager(self) -> None:
        """Flush at once again (nothing shown yet: the first visible text must not wait for a batch)."""
        self.first = True
        self.cancel_timer()
        if self.pending:
            self.due.set()

    def end(self, error: BaseException | None) -> None:
        self.ended = True
        self.error = error
        self.due.set()

    def take(self) -> tuple[list[int], float | None]:
        batch, oldest = self.pending, self.oldest
        self.pending, self.oldest, self.first = [], None, False
        self.cancel_timer()
        self.due.clear()
        return batch, oldest

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _read(chunks: AsyncIterator[Chunk], batches: _Batches) -> None:
    try:
        async for chunk in chunks:
            batches.add(chunk)
            if chunk.finish_reason is not None:
                return
        batches.end(UpstreamProtocolError("decode stream ended without a finish reason", leg="decode"))
    except Exception as exc:  # handed to the relay, which raises it where its caller reads
        batches.end(exc)


async def relay(
    chunks: AsyncIterator[Chunk],
    derenderer: StreamDerenderer,
    policy: FlushPolicy,
    *,
    request_id: str,
    stats: FlushStats | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncGenerator[Delta | Ending, None]:
    """Deltas as D's ids are flushed to ``derenderer``, then the ``Ending`` (see the module docstring).

    D is read on while a flush is in flight (its ids join the next flush). A stream that ends without a
    finish reason raises ``UpstreamProtocolError``; an error reading D is raised as it was."""
    stats = stats if stats is not None else FlushStats()
    if not derenderer.remote_flushes:
        async for x in _each_chunk(chunks, derenderer, request_id, stats):
            yield x
        return
    batches = _Batches(policy, clock)
    shown = False  # a delta with text went out: until then every flush is immediate
    reader = asyncio.ensure_future(_read(chunks, batches))
    try:
        while True:
            await batches.due.wait()
            if batches.error is not None:
                raise batches.error
            finish = batches.finish
            batch, oldest = batches.take()
            if stats.flushes == 0 and oldest is not None:
                stats.first_token_wait_s = clock() - oldest
            stats.flushes += 1
            if finish is not None:
                yield await derenderer.finish(batch, finish, request_id)
                return
            if batch:
                delta = await derenderer.feed(batch)
                if delta:
                    shown = True
                    yield delta
                elif not shown:
                    batches.eager()
    finally:
        batches.cancel_timer()
        if not reader.done():
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _each_chunk(
    chunks: AsyncIterator[Chunk], derenderer: StreamDerenderer, request_id: str, stats: FlushStats
) -> AsyncIterator[Delta | Ending]:
    """Every chunk as it comes: for a derenderer whose flushes cost nothing but its own work."""
    async for chunk in chunks:
        if stats.flushes == 0:
            stats.first_token_wait_s = 0.0
        stats.flushes += 1
        if chunk.finish_reason is not None:
            yield await derenderer.finish(chunk.token_ids, chunk.finish_reason, request_id)
            return
        delta = await derenderer.feed(chunk.token_ids)
        if delta:
            yield delta
    raise UpstreamProtocolError("decode stream ended without a finish reason", leg="decode")
