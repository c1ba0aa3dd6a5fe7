"""Relays D's streamed answer to the client while CAPTURE's inputs are collected.

Pull-based: D's answer is read only when the client has taken what came before, so back-pressure
reaches D. Events before the first one that shows the client output are held back, and that first
output must come within the first-token deadline (renewed while D is busy: ``turn.deadline``). If D
fails before it (vLLM 0.26 can end such a stream with no error at all) or misses the deadline, the
turn is run again through P without the handle (on another D when there is one; a D that missed the
deadline is relieved of pins first), and the client never notices; a second failure becomes an SSE
error event. A failure after the first output becomes a final SSE error event too. Events that carry
only what turnkv asked D for (token ids) are not forwarded. Leaving (the client went away, the end,
or a shutdown past its drain) closes D's answer, so D aborts the request; a client that leaves while
the first token is awaited stops that read before anything else (the salvage) reads D's stream.
Transition: the relay → CAPTURE, before the stream's ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from turnkv.engine.base import DecodeStream, StreamBroken
from turnkv.errors import FirstTokenDeadline, GatewayError, ShuttingDown, UpstreamProtocolError, UpstreamTimeout
from turnkv.gateway.error_responses import sse_error_event
from turnkv.gateway.turn import capture
from turnkv.gateway.turn.deadline import Deadline
from turnkv.gateway.turn.results import Opened
from turnkv.gateway.turn.run import TurnRun
from turnkv.openai.sse import DONE, frame

log = logging.getLogger("turnkv.stream")
DRAIN_TIMEOUT_S = 1.0
DONE_FRAME = frame(DONE)  # the relay's last yield: RelayResponse ends the HTTP body with it, in one write
SALVAGE_S = 0.5
Restart = Callable[[TurnRun], Awaitable[None]]


class _Missed(Exception):
    """The first-token deadline passed."""


async def _head(run: TurnRun, stream: DecodeStream) -> bytes | None:
    """Read D's answer up to its first event that shows the client output; the bytes to send up to
    there (with what came in the same read), or None when the stream failed or ended before it."""
    held: list[bytes] = []
    while (pieces := await stream.read()) is not None:
        out: list[bytes] | None = None
        for body, visible, failed in pieces:
            if failed and out is None:
                return None  # failed before its first token: the caller may run the turn again
            if body is None:
                continue
            if out is not None:
                out.append(frame(body))
            elif visible:
                run.journal.first_token_at = time.perf_counter()
                out = [*held, frame(body)]
            else:
                held.append(frame(body))
        if out is not None:
            return b"".join(out)
        if stream.done:
            return None
    stream.collected.error = stream.collected.error or {"message": "decode stream ended before its first token"}
    return None


class _Silence:
    """Ends D's stream once it has shown output and then said nothing for ``timeouts.decode_idle_s``, unless
    D's engine computed something since it fell silent (busy, as for a first-token deadline: ``deadline``;
    then up to ``decode_read_s`` of silence in all); at once when the fleet finds D lost and it has said
    nothing since. One timer a stream, moved on only when it fires (a read just notes the time)."""

    def __init__(self, run: TurnRun, url: str, stream: DecodeStream) -> None:
        t = run.svc.settings.timeouts
        self.fleet, self.url, self.stream = run.svc.fleet, url, stream
        self.idle_s, self.cap_s = t.decode_idle_s, max(t.decode_idle_s, t.decode_read_s)
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # when D last sent something
        self.timer: asyncio.TimerHandle | None = self.loop.call_at(self.last + self.idle_s, self._check)
        self.unwatch = self.fleet.watch(url, self._lost)

    def heard(self) -> None:
        self.last = self.loop.time()

    def _silent_since(self) -> float:
        """When D fell silent, on the fleet's clock."""
        return self.fleet.now() - (self.loop.time() - self.last)

    def _check(self) -> None:
        now = self.loop.time()
        if now < self.last + self.idle_s:
            self.timer = self.loop.call_at(self.last + self.idle_s, self._check)
            return
        since = max(self._silent_since(), self.fleet.now() - self.idle_s)
        view = self.fleet.view(self.url)
        busy = view is not None and view.healthy and view.progressed_at > since
        if busy and now - self.last + self.idle_s <= self.cap_s:
            self.timer = self.loop.call_at(now + self.idle_s, self._check)
            return
        self.timer = None
        self._end()

    def _lost(self) -> None:
        if Deadline.lost(self.fleet.view(self.url), self.fleet.lost_since(self.url), self._silent_since()):
            self._end()

    def _end(self) -> None:
        silent_s = self.loop.time() - self.last
        log.warning("decode.silent decode=%s silent_s=%.1f", self.url, silent_s)
        self.stream.collected.error = {"message": f"the decode engine sent nothing for {silent_s:.0f} s"}
        self.stream.abort()  # the read waiting on it ends; the relay sends the error event
        self.stop()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.unwatch()


async def _tail(stream: DecodeStream, silence: _Silence) -> AsyncIterator[bytes]:
    """The rest of D's answer; everything one network read brought is written at once (under load D's
    events arrive in batches, and one write per batch instead of per event is most of a relay's cost)."""
    while (out := await stream.read_relayed()) is not None:
        silence.heard()
        if out:
            yield out
    if not stream.done:
        stream.collected.error = stream.collected.error or {"message": "decode stream ended without [DONE]"}


async def _await_head(run: TurnRun, opened: Opened, stream: DecodeStream) -> bytes | None:
    """``_head`` within the first-token deadline, counted from when the request went out and renewed
    while D is busy (raises ``_Missed``; None when the turn was aborted). Given up on, the read is
    stopped before anything else reads D's stream."""
    try:
        return await run.until_aborted(_head(run, stream), opened.deadline, started=opened.sent)
    except FirstTokenDeadline:
        raise _Missed from None
    except ShuttingDown:
        return None


def missed_first_token(run: TurnRun, url: str) -> None:
    """D missed its first-token deadline: counted against it, its pins relieved, another D preferred."""
    svc = run.svc
    svc.metrics.deadline_misses.labels("decode").inc()
    run.retrying("decode", "first_token_deadline")
    svc.fleet.missed_deadline(url)
    svc.pins.urgent(url)
    run.journal.avoid_decode.add(url)


def _failure(run: TurnRun, missed: bool) -> GatewayError:
    if run.aborted is not None:
        return ShuttingDown("the gateway is shutting down; send the turn again")
    if missed:
        return UpstreamTimeout("the decode engine missed its first-token deadline", leg="decode")
    error = run.collected.error
    msg = error.get("message") if error else None
    return UpstreamProtocolError(str(msg or "decode failed"), leg="decode")


@dataclass(frozen=True)
class _Start:
    """How D's answer started for the client: its first output (with what came before it), or what ends the
    stream instead."""

    opened: Opened | None = None  # the answer that shows output
    stream: DecodeStream | None = None  # ... its stream
    head: bytes = b""  # ... its first bytes
    error: bytes | None = None  # no output: the SSE error event that ends the stream (None: an empty answer)
    again: bool = False  # D failed before any output (or missed its deadline): the turn may run again
    missed: bool = False  # ... it missed its first-token deadline


async def _attempt(run: TurnRun) -> _Start:
    """D's answer as opened now, read up to its first output."""
    opened = run.opened
    assert opened is not None and opened.stream is not None, "the relay reads an open stream"
    stream = opened.stream
    missed = False
    try:
        head = await _await_head(run, opened, stream)
    except _Missed:
        head, missed = None, True
        missed_first_token(run, opened.url)
    except StreamBroken as exc:
        head = None
        stream.collected.error = {"message": f"decode stream broke: {exc.cause}"}
    if head is not None:
        return _Start(opened, stream, head)
    run.close_answer()
    collected = stream.collected
    if collected.error is None and not missed and collected.finish_reason is not None:
        return _Start()  # finished with nothing to show (an empty answer): nothing failed
    run.svc.metrics.upstream_error("decode", "first_token_deadline" if missed else "empty_stream", opened.url)
    if run.aborted is not None:
        return _Start(error=sse_error_event(_failure(run, missed)))
    return _Start(again=True, missed=missed)


async def _start(run: TurnRun, restart: Restart) -> _Start:
    """The client's first output: D's answer, run again once, invisibly, when D fails before it."""
    first = await _attempt(run)
    if not first.again:
        return first
    try:
        await restart(run)
    except GatewayError as exc:
        return _Start(error=sse_error_event(exc))
    second = await _attempt(run)
    return _Start(error=sse_error_event(_failure(run, second.missed))) if second.again else second


def _ended_badly(run: TurnRun, opened: Opened, stream: DecodeStream, engine_error: bool) -> bytes | None:
    """After the client's first output: the SSE error event that ends a stream that failed (None: it did not,
    or D's own error event was forwarded)."""
    if stream.collected.error is None and run.aborted is None:
        return None
    run.svc.metrics.upstream_error("decode", "stream", opened.url)
    if engine_error and run.aborted is None:
        return None  # D's own error event was forwarded
    return sse_error_event(_failure(run, False))


async def relay(run: TurnRun, restart: Restart, started: Callable[[], None]) -> AsyncGenerator[bytes, None]:
    """The client's stream: D's answer (run again once, invisibly, when D fails before its first output),
    then ``[DONE]`` once the next turn's record is stored."""
    finished = False
    started()
    try:
        start = await _start(run, restart)
        if start.opened is not None and start.stream is not None:
            opened, stream = start.opened, start.stream
            opened.slot.prefilled()  # a decode-local turn's prefill is done on D
            run.svc.fleet.met_deadline(opened.url)
            yield start.head
            engine_error = stream.collected.error is not None
            silence = _Silence(run, opened.url, stream)
            try:
                async for out in _tail(stream, silence):
                    yield out
                    engine_error = stream.collected.error is not None
                if stream.done:
                    await stream.drain(DRAIN_TIMEOUT_S)
            except StreamBroken as exc:
                stream.collected.error = stream.collected.error or {"message": f"decode stream broke: {exc.cause}"}
            finally:
                silence.stop()
                run.close_answer()
            end = _ended_badly(run, opened, stream, engine_error)
        else:
            end = start.error
        if end is not None:
            yield end
        # Store the next record before the client sees [DONE]: an agent sends its next turn the moment
        # this one ends, and that turn must find the record, not this turn's claim.
        c = run.collected
        finished = True
        await capture.end(run, ok=c.error is None and c.finish_reason is not None and run.aborted is None)
        yield DONE_FRAME
    finally:
        if not finished:
            await _salvage(run)
        run.close_answer()
        if not finished:
            await capture.end(run, ok=False)


async def _salvage(run: TurnRun) -> None:
    """The client's stream ended before the next record was stored (the client left): what D already sent is
    read, bounded and shielded, so a handle on its final event is not lost (D's answer is closed after)."""
    opened = run.opened
    if opened is not None and opened.stream is not None and not opened.stream.closed and run.aborted is None:
        with anyio.CancelScope(shield=True):
            await opened.stream.salvage(SALVAGE_S)


class RelayResponse(StreamingResponse):
    """A streaming answer that cleans up when the response ends, however it ends: a relay the client left
    mid-way is closed then (its own clean-up runs at once, not whenever the generator is collected), and
    one the client left before it began is settled here.

    The client's leaving is watched as Starlette does (uvicorn's ``receive`` returns ``http.disconnect``),
    but by one plain asyncio task that cancels the relaying task, instead of Starlette's anyio task group
    per response: the same outcome for a fraction of the CPU a turn costs."""

    def __init__(self, run: TurnRun, restart: Restart, headers: dict[str, str]) -> None:
        self._run = run
        self._started = False
        self._relay = relay(run, restart, self._start)
        super().__init__(self._relay, media_type="text/event-stream", headers=headers)

    def _start(self) -> None:
        self._started = True

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but ``[DONE]`` goes out with the end of the body (one write, not two). The body is
        ``body_iterator``: the relay, or what a front end made of it (the Responses API's events)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            last = chunk is DONE_FRAME
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_until_left(self, receive: Receive, send: Send) -> None:
        relaying = asyncio.current_task()
        assert relaying is not None
        state = {"done": False, "left": False}

        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # the server's receive failed: it ends the request itself
                return
            if not state["done"]:
                state["left"] = True
                relaying.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["left"] or relaying.uncancel() > 0:
                raise  # cancelled from outside too (a shutdown): not ours to swallow
        finally:
            state["done"] = True
            watcher.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream_until_left(receive, send)
        finally:
            if self._started:
                with anyio.CancelScope(shield=True):
                    outer = self.body_iterator
                    if outer is not self._relay and hasattr(outer, "aclose"):
                        await outer.aclose()  # a front end's translation of the relay: it closes the relay too
                    await self._relay.aclose()  # bounded: its clean-up is (salvage, capture)
            else:
                self._run.close_answer()
                await capture.end(self._run, ok=False)
