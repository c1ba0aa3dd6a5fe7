"""First-token deadlines, in process over the fake engine: renewed while the engine is busy (its token
counters move), missed when it is stuck, never past the leg's whole timeout; and a client that leaves
while its first token is awaited."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.asgi import chat_scope
from tests.pipeline.harness import D0, P0, Answer, Chat, Gateway, gateway
from tests.sim_engine import MODEL


async def conversation(gw: Gateway, *, stream: bool = False) -> Chat:
    chat = Chat(gw, session="c1", stream=stream)
    a = await chat.say("what is the weather like")
    assert a.status == 200, a.body
    return chat


async def waited_for(gw: Gateway, url: str, leg: str, turn: asyncio.Task[Answer]) -> Answer:
    """The turn waits behind ``url``'s other work past its deadline (renewed twice), then the work ends."""
    renewals = "turnkv_first_token_deadline_renewals_total"
    await gw.wait_for("the deadline renewed twice", lambda: gw.metric(renewals, leg=leg) >= 2)
    assert not turn.done()
    gw.engine.free(url)
    return await turn


async def test_a_busy_decode_engine_is_waited_for_past_its_deadline() -> None:
    async with gateway(timeouts={"decode_first_token_s": 0.25}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, busy=1)  # the stream opens; its first token waits behind D's other work
        a = await waited_for(gw, D0, "decode", asyncio.create_task(chat.say("go on")))
        assert a.done and a.error is None and (a.outcome, a.reason) == ("full", "full_match")
        t = gw.turns[-1]
        assert (t["reason"], t.get("retries")) == ("full_match", None)
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="decode") == 0


async def test_a_busy_prefill_engine_is_waited_for_past_its_deadline() -> None:
    async with gateway(timeouts={"prefill_first_token_s": 0.25}) as gw:
        chat = await conversation(gw)
        gw.engine.faults(P0, busy=1, leg="prefill")
        a = await waited_for(gw, P0, "prefill", asyncio.create_task(chat.say("go on")))
        assert a.status == 200 and (a.outcome, a.action, a.reason) == ("full", "pull", "full_match")
        assert gw.turns[-1].get("retries") is None
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="prefill") == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stuck_engine_misses_its_deadline(stream: bool) -> None:
    # computes nothing: its counters stand still (a stalled stream, a prefill that hangs), so the deadline
    # is not renewed past what the turn's own request computed
    leg = "decode" if stream else "prefill"
    async with gateway(timeouts={f"{leg}_first_token_s": 0.25}) as gw:
        chat = await conversation(gw, stream=stream)
        if stream:
            gw.engine.faults(D0, stall=1)
        else:
            gw.engine.faults(P0, hang=1, leg="prefill")
        a = await chat.say("go on")
        assert a.status == 200 and a.error is None
        t = gw.turns[-1]
        assert (t["outcome"], t["action"], t["reason"]) == ("none", "recompute", "first_token_deadline")
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg=leg) == 1
        assert gw.metric("turnkv_first_token_deadline_renewals_total", leg=leg) <= 1


async def test_a_busy_engine_is_given_up_on_at_the_legs_whole_timeout() -> None:
    # renewed while D is busy, but never past decode_read_s: then missed, and the turn runs again
    async with gateway(timeouts={"decode_first_token_s": 0.2, "decode_read_s": 0.5}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, busy=1)
        a = await chat.say("go on")
        assert a.done and a.error is None
        t = gw.turns[-1]
        assert (t["reason"], t["retries"]) == ("first_token_deadline", ["decode_first_token_deadline", "turn_rerun"])
        assert gw.metric("turnkv_first_token_deadline_renewals_total", leg="decode") == 1


async def leave_once_headers_are_sent(gw: Gateway, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A streamed turn whose client goes away as soon as the response starts, before any output; the
    ASGI messages the gateway sent. The app must return (bounded) without raising."""
    body = json.dumps({"model": MODEL, "stream": True, "messages": messages}).encode()
    sent: list[dict[str, Any]] = []
    started = asyncio.Event()
    request_read = False

    async def receive() -> dict[str, Any]:
        nonlocal request_read
        if not request_read:
            request_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await started.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            started.set()

    scope = chat_scope({"x-session-id": "c1"})
    await asyncio.wait_for(gw.app(scope, receive, send), 10)  # type: ignore[arg-type]
    return sent


@pytest.mark.parametrize("fault", [{"stall": 1}, {"busy": 1}], ids=["stuck", "busy"])
async def test_a_client_that_leaves_before_the_first_token_is_settled_cleanly(fault: dict[str, int]) -> None:
    # the relay is waiting for D's first token when the client goes: that wait's read is stopped before
    # anything else (the salvage) reads D's stream, and the turn is settled, its handle given back
    async with gateway(timeouts={"decode_first_token_s": 30.0}) as gw:
        chat = await conversation(gw)
        gw.engine.faults(D0, **fault)
        sent = await leave_once_headers_are_sent(gw, [*chat.messages, {"role": "user", "content": "go on"}])
        assert [m["type"] for m in sent] == ["http.response.start"]  # no output ever reached the client
        await gw.wait_for("the turn's log", lambda: len(gw.turns) == 2)
        t = gw.turns[-1]
        assert (t["capture"], t.get("retries")) == ("failed_kept_unpinned", None)  # P had pulled the handle
        await gw.wait_for("D's handles to be freed", lambda: not gw.engine[D0].pins)
        assert gw.engine[D0].behind == 0
