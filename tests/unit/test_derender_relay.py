"""Batching of D's ids into derender flushes (``derender.stream.relay``): the first ids at once, then by count
or by age, one flush in flight at a time, D read on meanwhile, and an ending for every stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from turnkv.derender.answer import Answer, Delta, Ending
from turnkv.derender.stream import Chunk, FlushPolicy, FlushStats, StreamDerenderer, relay
from turnkv.errors import UpstreamProtocolError

WAIT_S = 10.0  # the deadline of every wait in these tests


class Recorder(StreamDerenderer):
    """A derenderer whose flushes cost a call: records each batch; ``gate`` holds a flush while it is clear."""

    def __init__(self, silent: int = 0) -> None:
        super().__init__()
        self.silent = silent  # the first feeds show no text (as a reasoning model's opening marker)
        self.batches: list[list[int]] = []
        self.fed = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    @property
    def calls(self) -> int:
        return len(self.batches)

    async def feed(self, ids: Sequence[int]) -> Delta:
        self.batches.append(list(ids))
        self.fed.set()
        await asyncio.wait_for(self.gate.wait(), WAIT_S)
        if len(self.batches) <= self.silent:
            return Delta()
        return Delta(content="".join(f"<{i}>" for i in ids))

    async def finish(self, ids: Sequence[int], finish_reason: str, request_id: str) -> Ending:
        self.batches.append(list(ids))
        text = "".join(f"<{i}>" for b in self.batches for i in b)
        return Ending(Answer(text, None, (), finish_reason), Delta(content="".join(f"<{i}>" for i in ids)))


async def from_queue(q: asyncio.Queue[Chunk | None]) -> AsyncIterator[Chunk]:
    while (item := await asyncio.wait_for(q.get(), WAIT_S)) is not None:
        yield item


async def listed(chunks: list[Chunk]) -> AsyncIterator[Chunk]:
    for c in chunks:
        yield c


async def run(chunks: list[Chunk], policy: FlushPolicy, d: StreamDerenderer) -> list[Delta | Ending]:
    return [x async for x in relay(listed(chunks), d, policy, request_id="r")]


async def test_first_ids_at_once_then_by_count() -> None:
    d, q = Recorder(), asyncio.Queue[Chunk | None]()
    out: list[Delta | Ending] = []

    async def consume() -> None:
        async for x in relay(from_queue(q), d, FlushPolicy(max_tokens=4, max_delay_s=WAIT_S), request_id="r"):
            out.append(x)

    task = asyncio.create_task(consume())
    for group in ([0], [1, 2, 3, 4, 5], [6, 7, 8, 9]):
        d.fed.clear()
        for i in group:
            q.put_nowait(Chunk([i]))
        await asyncio.wait_for(d.fed.wait(), WAIT_S)
    q.put_nowait(Chunk([10], "stop"))
    await asyncio.wait_for(task, WAIT_S)
    # the first id alone, at once; then a flush only once four wait (the age bound is far off), the rest at the end
    assert d.batches[0] == [0] and [i for b in d.batches for i in b] == list(range(11))
    assert all(len(b) >= 4 for b in d.batches[1:-1]) and len(d.batches) == 4
    assert isinstance(out[-1], Ending) and out[-1].answer.content == "".join(f"<{i}>" for i in range(11))
    streamed = "".join(x.content for x in out[:-1] if isinstance(x, Delta)) + out[-1].rest.content
    assert streamed == out[-1].answer.content


async def test_waiting_ids_are_flushed_by_age_without_more_chunks() -> None:
    d, q = Recorder(), asyncio.Queue[Chunk | None]()
    stats = FlushStats()
    out: list[Delta | Ending] = []

    policy = FlushPolicy(max_tokens=100, max_delay_s=0.01)

    async def consume() -> None:
        async for x in relay(from_queue(q), d, policy, request_id="r", stats=stats):
            out.append(x)

    task = asyncio.create_task(consume())
    q.put_nowait(Chunk([1]))
    await asyncio.wait_for(d.fed.wait(), WAIT_S)  # the first id, at once
    d.fed.clear()
    q.put_nowait(Chunk([2, 3]))
    await asyncio.wait_for(d.fed.wait(), WAIT_S)  # no more chunks come: the age bound flushes them
    assert d.batches == [[1], [2, 3]]
    q.put_nowait(Chunk([], "length"))
    await asyncio.wait_for(task, WAIT_S)
    assert stats.flushes == 3 and stats.first_token_wait_s is not None  # two feeds and the finish
    assert isinstance(out[-1], Ending) and out[-1].answer.finish_reason == "length"


async def test_ids_arriving_during_a_flush_join_the_next_one() -> None:
    d, q = Recorder(), asyncio.Queue[Chunk | None]()
    d.gate.clear()  # the first flush hangs until the test lets it go
    items: list[Delta | Ending] = []

    async def consume() -> None:
        async for x in relay(from_queue(q), d, FlushPolicy(max_tokens=2, max_delay_s=WAIT_S), request_id="r"):
            items.append(x)

    task = asyncio.create_task(consume())
    q.put_nowait(Chunk([1]))
    await asyncio.wait_for(d.fed.wait(), WAIT_S)
    for i in range(2, 7):
        q.put_nowait(Chunk([i]))
    assert d.batches == [[1]]  # one flush in flight
    d.gate.set()
    q.put_nowait(Chunk([7], "stop"))
    await asyncio.wait_for(task, WAIT_S)
    assert [i for b in d.batches for i in b] == list(range(1, 8))
    assert d.batches[1] == [2, 3]  # what came meanwhile went in count-sized flushes
    assert isinstance(items[-1], Ending)


async def test_a_stream_without_a_finish_reason_is_a_protocol_error() -> None:
    with pytest.raises(UpstreamProtocolError, match="without a finish reason"):
        await run([Chunk([1]), Chunk([2])], FlushPolicy(), Recorder())


async def test_a_one_chunk_answer_is_one_ending() -> None:
    d = Recorder()
    out = await run([Chunk([5, 6], "stop")], FlushPolicy(), d)
    assert d.batches == [[5, 6]] and len(out) == 1 and isinstance(out[0], Ending)


async def test_an_error_reading_d_is_raised_where_the_relay_is_read() -> None:
    async def broken() -> AsyncIterator[Chunk]:
        yield Chunk([1])
        raise ConnectionResetError("D went away")

    with pytest.raises(ConnectionResetError):
        async for _ in relay(broken(), Recorder(), FlushPolicy(), request_id="r"):
            pass


async def test_until_text_is_shown_every_flush_is_immediate() -> None:
    d, q = Recorder(silent=2), asyncio.Queue[Chunk | None]()
    policy = FlushPolicy(max_tokens=100, max_delay_s=WAIT_S)  # batches would wait for 100 ids otherwise

    async def consume() -> list[Delta | Ending]:
        return [x async for x in relay(from_queue(q), d, policy, request_id="r")]

    task = asyncio.create_task(consume())
    for i in range(3):  # two flushes without text, then the one that shows some: each at once
        d.fed.clear()
        q.put_nowait(Chunk([i]))
        await asyncio.wait_for(d.fed.wait(), WAIT_S)
    q.put_nowait(Chunk([3]))  # text was shown: this one waits for its batch, which the end flushes
    q.put_nowait(Chunk([4], "stop"))
    out = await asyncio.wait_for(task, WAIT_S)
    assert d.batches == [[0], [1], [2], [3, 4]]
    assert isinstance(out[-1], Ending)
