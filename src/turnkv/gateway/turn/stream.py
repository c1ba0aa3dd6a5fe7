"""Relays D's SSE answer to the client while CAPTURE's inputs are collected.

Pull-based: a chunk is read from D only when the client has taken the last one, so back-pressure
reaches D. Chunks before the first generated token are held back; if D fails before producing
one (vLLM 0.26 can end such a stream with no error at all), the turn is run again through P
without the handle and the client never notices. A failure after that becomes a final SSE error
event. Leaving (the client went away, or the end) closes D's response, so D aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from turnkv.errors import GatewayError, UpstreamProtocolError
from turnkv.gateway.errors import sse_error_event
from turnkv.gateway.sse import DONE, SSESplitter, frame
from turnkv.gateway.turn import capture
from turnkv.gateway.turn.context import TurnContext

DRAIN_TIMEOUT_S = 1.0


async def _read(ctx: TurnContext, held: list[bytes], released: bool) -> AsyncIterator[tuple[bytes, bool]]:
    """Yields (bytes for the client, whether they are now released) from D's open response.

    Everything one network read brought is written to the client at once: under load D's chunks
    arrive in batches, and one write per batch instead of per chunk is most of a relay's cost.
    """
    resp = ctx.decode_response
    assert resp is not None
    splitter = SSESplitter()
    async for data in resp.content.iter_any():
        out: list[bytes] = []
        for payload in splitter.feed(data):
            if payload == DONE:
                ctx.decode_done = True
                if out:
                    yield b"".join(out), released
                return
            body, visible = ctx.capture.chunk(payload)
            if ctx.capture.error is not None and not released:
                return  # failed before its first token: the caller may run the turn again
            f = frame(body)
            if released:
                out.append(f)
            elif visible:
                released = True
                ctx.first_token_at = time.perf_counter()
                out += held
                out.append(f)
                held.clear()
            else:
                held.append(f)
        if out:
            yield b"".join(out), released
    ctx.capture.error = ctx.capture.error or {"message": "decode stream ended without [DONE]"}


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


async def relay(ctx: TurnContext, restart: Callable[[TurnContext], Awaitable[None]]) -> AsyncIterator[bytes]:
    svc = ctx.svc
    held: list[bytes] = []
    released = False
    restarted = False
    finished = False
    ctx.relay_started = True
    try:
        while True:
            try:
                async for out, now_released in _read(ctx, held, released):
                    released = now_released
                    yield out
                if ctx.decode_done:
                    await _drain(ctx)
            except (aiohttp.ClientError, TimeoutError) as exc:
                ctx.capture.error = {"message": f"decode stream broke: {type(exc).__name__}"}
            finally:
                close(ctx)
            if ctx.capture.error is None and (released or ctx.capture.finish_reason is not None):
                break
            svc.metrics.upstream_errors.labels("decode", "stream" if released else "empty_stream").inc()
            if released or restarted:
                yield sse_error_event(UpstreamProtocolError(
                    str(ctx.capture.error.get("message") if ctx.capture.error else "decode failed"),
                    leg="decode", instance=ctx.decode_url))
                break
            restarted = True
            held.clear()
            try:
                await restart(ctx)
            except GatewayError as exc:
                yield sse_error_event(exc)
                break
        if held:
            yield b"".join(held)
        # Store the next record before the client sees [DONE]: an agent sends its next turn the moment
        # this one ends, and that turn must find the record, not this turn's claim.
        ok = ctx.capture.error is None and ctx.capture.finish_reason is not None
        finished = True
        await capture.end(ctx, ok=ok)
        yield frame(DONE)
    finally:
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
