"""Relays D's SSE answer to the client while CAPTURE's inputs are collected.

Pull-based: a chunk is read from D only when the client has taken the last one, so back-pressure
reaches D. Chunks before the first one that shows the client output are held back, and that first
output must come within the first-token deadline. If D fails before it (vLLM 0.26 can end such a
stream with no error at all) or misses the deadline, the turn is run again through P without the
handle (on another D when there is one; a D that missed the deadline is relieved of pins first), and
the client never notices; a second failure becomes an SSE error event. A failure after the first
output becomes a final SSE error event too. Chunks that carry only what turnkv asked D for (token
ids) are not forwarded. Leaving (the client went away, the end, or a shutdown past its drain)
closes D's response, so D aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from turnkv.errors import FirstTokenDeadline, GatewayError, ShuttingDown, UpstreamProtocolError, UpstreamTimeout
from turnkv.gateway.errors import sse_error_event
from turnkv.gateway.sse import DONE, SSESplitter, frame
from turnkv.gateway.turn import capture
from turnkv.gateway.turn.context import TurnContext, until_aborted

DRAIN_TIMEOUT_S = 1.0
SALVAGE_S = 0.5


class _Missed(Exception):
    """The first-token deadline passed."""


async def _head(ctx: TurnContext, splitter: SSESplitter) -> bytes | None:
    """Read D's answer up to its first chunk that shows the client output; the bytes to send up to
    there (with what came in the same read), or None when the stream failed or ended before it."""
    resp = ctx.decode_response
    assert resp is not None
    held: list[bytes] = []
    async for data in resp.content.iter_any():
        out: list[bytes] | None = None
        for payload in splitter.feed(data):
            if payload == DONE:
                ctx.decode_done = True
                break
            body, visible = ctx.capture.chunk(payload)
            if ctx.capture.error is not None and out is None:
                return None  # failed before its first token: the caller may run the turn again
            if body is None:
                continue
            if out is not None:
                out.append(frame(body))
            elif visible:
                ctx.first_token_at = time.perf_counter()
                out = [*held, frame(body)]
            else:
                held.append(frame(body))
        if out is not None:
            return b"".join(out)
        if ctx.decode_done:
            return None
    ctx.capture.error = ctx.capture.error or {"message": "decode stream ended before its first token"}
    return None


async def _tail(ctx: TurnContext, splitter: SSESplitter) -> AsyncIterator[bytes]:
    """The rest of D's answer; everything one network read brought is written at once (under load D's
    chunks arrive in batches, and one write per batch instead of per chunk is most of a relay's cost)."""
    resp = ctx.decode_response
    assert resp is not None
    if ctx.decode_done:
        return
    async for data in resp.content.iter_any():
        out: list[bytes] = []
        for payload in splitter.feed(data):
            if payload == DONE:
                ctx.decode_done = True
                break
            body, _ = ctx.capture.chunk(payload)
            if body is not None:
                out.append(frame(body))
        if out:
            yield b"".join(out)
        if ctx.decode_done:
            return
    ctx.capture.error = ctx.capture.error or {"message": "decode stream ended without [DONE]"}


async def _await_head(ctx: TurnContext, splitter: SSESplitter) -> bytes | None:
    """``_head`` within the first-token deadline, counted from when the request went out (raises
    ``_Missed``; None when the turn was aborted)."""
    try:
        return await until_aborted(ctx, _head(ctx, splitter), ctx.decode_deadline, started=ctx.decode_sent)
    except FirstTokenDeadline:
        raise _Missed from None
    except ShuttingDown:
        return None


async def _salvage(ctx: TurnContext) -> None:
    """The client left before the end: read what D already sent (bounded), so that a handle on its final
    chunk is not lost (D pinned those blocks; capture releases them). D's answer still running is then
    closed and aborted."""
    resp = ctx.decode_response
    if resp is None or ctx.decode_done or ctx.capture.error is not None or ctx.aborted is not None:
        return
    splitter = SSESplitter()
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(SALVAGE_S):
            async for data in resp.content.iter_any():
                for payload in splitter.feed(data):
                    if payload == DONE:
                        ctx.decode_done = True
                        return
                    ctx.capture.chunk(payload)


async def _drain(ctx: TurnContext) -> None:
    """After [DONE], read the end of D's response so its connection can go back to the pool."""
    resp = ctx.decode_response
    if resp is not None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await asyncio.wait_for(resp.content.read(), DRAIN_TIMEOUT_S)


def close(ctx: TurnContext) -> None:
    """Give D's response up and its in-flight slot back: to the pool when D finished and the body was
    read to its end, else by closing the connection, which makes D abort the request."""
    resp, ctx.decode_response = ctx.decode_response, None
    if resp is not None:
        if ctx.decode_done and resp.content.at_eof():
            resp.release()
        else:
            resp.close()
        inst = ctx.svc.registry.get(ctx.decode_url)
        if inst is not None:
            inst.in_flight -= 1


def missed_first_token(ctx: TurnContext) -> None:
    """D missed its first-token deadline: counted against it, its pins relieved, another D preferred."""
    svc, url = ctx.svc, ctx.decode_url
    svc.metrics.deadline_misses.labels("decode").inc()
    ctx.retrying("decode", "first_token_deadline")
    if url is not None:
        svc.registry.missed_deadline(url)
        svc.pins.urgent(url)
        ctx.avoid_decode.add(url)


def _failure(ctx: TurnContext, missed: bool) -> GatewayError:
    if ctx.aborted is not None:
        return ShuttingDown("the gateway is shutting down; send the turn again")
    if missed:
        return UpstreamTimeout("the decode engine missed its first-token deadline", leg="decode")
    msg = ctx.capture.error.get("message") if ctx.capture.error else None
    return UpstreamProtocolError(str(msg or "decode failed"), leg="decode")


async def relay(ctx: TurnContext, restart: Callable[[TurnContext], Awaitable[None]]) -> AsyncIterator[bytes]:
    svc = ctx.svc
    restarted = False
    finished = False
    ctx.relay_started = True
    try:
        while True:
            splitter = SSESplitter()
            missed = False
            try:
                head = await _await_head(ctx, splitter)
            except _Missed:
                head, missed = None, True
                missed_first_token(ctx)
            except (aiohttp.ClientError, TimeoutError) as exc:
                head = None
                ctx.capture.error = {"message": f"decode stream broke: {type(exc).__name__}"}
            if head is not None:
                svc.registry.met_deadline(ctx.decode_url)
                yield head
                engine_error = ctx.capture.error is not None
                try:
                    async for out in _tail(ctx, splitter):
                        yield out
                        engine_error = ctx.capture.error is not None
                    if ctx.decode_done:
                        await _drain(ctx)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    ctx.capture.error = {"message": f"decode stream broke: {type(exc).__name__}"}
                finally:
                    close(ctx)
                if ctx.capture.error is not None or ctx.aborted is not None:
                    svc.metrics.upstream_errors.labels("decode", "stream").inc()
                    if not engine_error or ctx.aborted is not None:  # D's own error event was forwarded
                        yield sse_error_event(_failure(ctx, False))
                break
            close(ctx)
            if ctx.capture.error is None and not missed and ctx.capture.finish_reason is not None:
                break  # finished with nothing to show (an empty answer): nothing failed
            svc.metrics.upstream_errors.labels("decode", "first_token_deadline" if missed else "empty_stream").inc()
            if restarted or ctx.aborted is not None:
                yield sse_error_event(_failure(ctx, missed))
                break
            restarted = True
            try:
                await restart(ctx)
            except GatewayError as exc:
                yield sse_error_event(exc)
                break
        # Store the next record before the client sees [DONE]: an agent sends its next turn the moment
        # this one ends, and that turn must find the record, not this turn's claim.
        ok = ctx.capture.error is None and ctx.capture.finish_reason is not None and ctx.aborted is None
        finished = True
        await capture.end(ctx, ok=ok)
        yield frame(DONE)
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await _salvage(ctx)
        close(ctx)
        if not finished:
            await capture.end(ctx, ok=False)


class RelayResponse(StreamingResponse):
    """A streaming answer that cleans up even when the client left before the relay began."""

    def __init__(self, ctx: TurnContext, restart: Callable[[TurnContext], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(relay(ctx, restart), media_type="text/event-stream", headers=headers)
        self._ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._ctx.relay_started:
                close(self._ctx)
                await capture.end(self._ctx, ok=False)
