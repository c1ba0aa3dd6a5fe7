"""The state of one chat turn as it moves through its steps.

A turn goes RENDER → PLAN → PREFILL → DECODE → DONE (decode-local skips PREFILL; a turn without a
conversation, or whose render failed, goes straight to PREFILL with the client's messages).
Each step reads and fills this context and names the next state; the driver runs them.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from turnkv.errors import FirstTokenDeadline, ShuttingDown, UpstreamError, UpstreamUnavailable
from turnkv.gateway.identity import Conversation
from turnkv.gateway.services import Services
from turnkv.gateway.sse import DecodeCapture
from turnkv.gateway.upstream import is_retryable
from turnkv.reuse.assess import Assessment, Reason
from turnkv.reuse.chain import ChainBuilder
from turnkv.reuse.cost import Action
from turnkv.state.base import Claim

T = TypeVar("T")


class TurnState(enum.Enum):
    RENDER = "render"
    PLAN = "plan"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class TurnContext:
    svc: Services
    request_id: str
    body: dict[str, Any]  # the client's body, without the fields only turnkv reads
    stream: bool
    authorization: str | None
    conversation: Conversation | None
    turn_index: int
    path: str = "/v1/chat/completions"  # the client's endpoint; P and D get the same one
    started: float = field(default_factory=time.perf_counter)
    state: TurnState = TurnState.RENDER
    # render
    prompt_ids: list[int] | None = None
    prompt_chain: ChainBuilder | None = None
    claim: Claim | None = None
    claimed: bool = False  # the store holds our in-flight marker
    store_busy: bool = False  # the claim found every store connection busy (load, not an outage)
    render_s: float = 0.0  # render and claim, side by side
    direct: bool = False  # decode-local without a render (turn/direct.py)
    handle_spent: bool = False  # the claimed handle went to P: it cannot be put back
    # plan
    assessment: Assessment | None = None
    reason: Reason = Reason.NO_SESSION
    action: Action = Action.RECOMPUTE
    estimates: dict[str, float] = field(default_factory=dict)
    handle_for_prefill: dict[str, Any] | None = None
    planned_s: float = 0.0  # from the start of the turn to the end of PLAN: the gateway's own latency
    pull_tokens: int = 0
    expected_cached: int = 0  # prompt tokens P should not have to compute (its cache, plus the pull)
    prefill_url: str | None = None
    decode_url: str | None = None
    # prefill
    prefill_params: dict[str, Any] | None = None  # P's kv_transfer_params, for D
    prefill_cached: int | None = None
    prefill_prompt_tokens: int | None = None  # P's usage.prompt_tokens
    prefill_s: float = 0.0
    # decode
    decode_response: aiohttp.ClientResponse | None = None
    decode_body: dict[str, Any] | None = None
    capture: DecodeCapture = field(default_factory=lambda: DecodeCapture(keep_token_ids=False))
    first_token_at: float | None = None
    relay_started: bool = False
    decode_done: bool = False  # D's stream reached [DONE]
    capture_result: str = "none"
    retries: list[str] = field(default_factory=list)
    tried_decode: set[str] = field(default_factory=set)
    avoid_decode: set[str] = field(default_factory=set)  # missed a first-token deadline: another D if any
    decode_deadline: Deadline | None = None  # for D's first visible token (turn/stream.py)
    decode_sent: float = 0.0  # loop time the decode request went out
    aborted: str | None = None  # why the gateway ended the turn early ("shutdown")
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self, why: str) -> None:
        """End the turn early: its decode stream is closed (D aborts the request) and its steps stop."""
        self.aborted = why
        self.abort_event.set()
        if self.decode_response is not None:
            self.decode_response.close()

    def headers(self) -> dict[str, str]:
        return self.svc.upstream.headers(self.request_id, self.authorization)

    def failed(self, leg: str, url: str, exc: UpstreamError) -> None:
        """Count an engine call's failure; raise it again when no other attempt can help."""
        self.svc.metrics.upstream_errors.labels(leg, exc.kind).inc()
        if not is_retryable(exc):
            raise exc
        if isinstance(exc, UpstreamUnavailable):
            self.svc.registry.mark_failed(url)

    def retrying(self, leg: str, why: str) -> None:
        self.svc.metrics.retries.labels(leg, why).inc()
        self.retries.append(f"{leg}_{why}")

    @property
    def turn_is_stateful(self) -> bool:
        """D was asked for its handle: P's params went with the request."""
        return (self.conversation is not None and self.prefill_params is not None
                and self.action is not Action.DECODE_LOCAL)

    @property
    def outcome(self) -> str:
        if self.action is Action.DECODE_LOCAL:
            return "decode_local"
        if self.action is Action.PULL and self.assessment is not None:
            return self.assessment.outcome
        return "none" if self.conversation is not None else "stateless"


def _close_response(task: asyncio.Future[Any]) -> None:
    """A call given up on may still have opened a response: close it (the engine aborts the request)."""
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
        task.result().close()


@dataclass(frozen=True)
class Deadline:
    """How long an engine may take to start answering: ``first_s``, renewed while the engine shows
    progress on other work (its token counters moved within the last ``first_s``: it is busy, not
    stuck, and giving up would only add a retry to its queue), up to ``cap_s`` in all."""

    leg: str
    url: str
    first_s: float
    cap_s: float

    def extend(self, ctx: TurnContext, started: float, now: float) -> bool:
        inst = ctx.svc.registry.get(self.url)
        busy = inst is not None and time.monotonic() - inst.progressed_at < self.first_s
        return busy and now - started + self.first_s <= self.cap_s


async def until_aborted(ctx: TurnContext, call: Awaitable[T], deadline: Deadline | None = None, *,
                        started: float | None = None) -> T:
    """``call``, unless the turn is aborted (``ShuttingDown``) or ``deadline`` (counted from ``started``,
    a loop time; default now) passes first (``FirstTokenDeadline``); the call is cancelled then (an
    open response closed)."""
    if ctx.aborted is not None:
        if inspect.iscoroutine(call):
            call.close()
        raise ShuttingDown("the gateway is shutting down; send the turn again")
    loop = asyncio.get_running_loop()
    started = loop.time() if started is None else started
    until = started + deadline.first_s if deadline is not None else None
    task = asyncio.ensure_future(call)
    stop = asyncio.ensure_future(ctx.abort_event.wait())
    try:
        while True:
            timeout = None if until is None else max(0.0, until - loop.time())
            done, _ = await asyncio.wait({task, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if stop in done or deadline is None or not deadline.extend(ctx, started, loop.time()):
                break
            until = loop.time() + deadline.first_s
    finally:
        stop.cancel()
        if not task.done():  # given up on (or this turn was cancelled): stop it before anyone else reads
            task.add_done_callback(_close_response)
            task.cancel()
            await asyncio.wait({task})
    if ctx.aborted is not None:
        raise ShuttingDown("the gateway is shutting down; send the turn again")
    assert deadline is not None
    raise FirstTokenDeadline(f"the {deadline.leg} engine missed its first-token deadline", leg=deadline.leg,
                             instance=deadline.url)
