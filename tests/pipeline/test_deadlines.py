"""First-token deadlines, in process over the fake engine: renewed while the engine is busy (its token
counters move), missed when it is stuck, never past the leg's whole timeout; and a client that leaves
while its first token is awaited."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.asgi import chat_scope
from tests.pipeline.harness import D0, D1, P0, P1, Answer, Chat, Gateway, gateway
from tests.sim_engine import MODEL


async def conversation(gw: Gateway, *, stream: bool = False) -> Chat:
    chat = Chat(gw, session="c1", stream=stream)
    a = await chat.say("what is the weather like")
    assert a.status == 200, a.body
    return chat


# A busy engine's deadline is renewed only if the gateway read its counters moving within the last deadline:
# one long enough that a pause of the whole test process on a loaded machine (a garbage collection, a busy core)
# cannot outlast it between two readings.
BUSY_DEADLINE_S = 1.0


async def waited_for(gw: Gateway, url: str, leg: str, turn: asyncio.Task[Answer]) -> Answer:
    """The turn waits behind ``url``'s other work past its deadline (renewed twice), then the work ends."""
    renewals = "turnkv_first_token_deadline_renewals_total"
    await gw.wait_for("the deadline renewed twice", lambda: gw.metric(renewals, leg=leg) >= 2)
    assert not turn.done()
    gw.engine.free(url)
    return await turn


async def test_a_busy_decode_engine_is_waited_for_past_its_deadline() -> None:
    async with gateway(timeouts={"decode_first_token_s": BUSY_DEADLINE_S}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, busy=1)  # the stream opens; its first token waits behind D's other work
        a = await waited_for(gw, D0, "decode", asyncio.create_task(chat.say("go on")))
        assert a.done and a.error is None and (a.outcome, a.reason) == ("full", "full_match")
        t = gw.turns[-1]
        assert (t["reason"], t.get("retries")) == ("full_match", None)
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="decode") == 0


async def test_a_busy_prefill_engine_is_waited_for_past_its_deadline() -> None:
    async with gateway(timeouts={"prefill_first_token_s": BUSY_DEADLINE_S}) as gw:
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


async def test_progress_seen_before_the_wait_does_not_renew_its_deadline() -> None:
    # D computed the last turn's answer just before it takes the next turn and hangs: that is no sign it is busy
    # with this turn (an engine that froze, or went unreachable, had moved its counters just before)
    async with gateway(timeouts={"decode_first_token_s": 1.0}) as gw:
        chat = await conversation(gw, stream=True)
        d = gw.engine.instances[D0]
        await gw.wait_for("D's metrics read", lambda: d.reads > 0)
        assert (await chat.say("and?")).done  # D computes more: its counters move from one reading to the next
        read = d.reads
        await gw.wait_for("D's progress read, and read again", lambda: d.reads >= read + 2)
        assert (v := gw.svc.fleet.view(D0)) is not None and v.progressed_at > 0
        gw.engine.faults(D0, hang=1, leg="decode")  # takes the request, computes nothing, never answers
        a = await chat.say("go on")
        assert a.done and a.error is None and gw.turns[-1]["reason"] == "first_token_deadline"
        assert gw.metric("turnkv_first_token_deadline_renewals_total", leg="decode") == 0
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="decode") == 1


@pytest.mark.parametrize("decode", [[D0, D1], [D0]], ids=["another_d", "one_d"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_wait_on_an_engine_that_stops_answering_is_given_up_at_once(decode: list[str], stream: bool) -> None:
    # D takes the turn and goes silent, its health probes failing (a host gone, a blackholed network): the
    # turn gives up as soon as the fleet finds D lost, not at a deadline minutes away, and runs on another D
    async with gateway(decode=decode, timeouts={"decode_first_token_s": 600.0, "decode_per_token_s": 10.0}) as gw:
        chat = await conversation(gw, stream=stream)
        lost = gw.turns[-1]["decode"]
        gw.engine.faults(lost, hang=1, leg="decode")
        turn = asyncio.create_task(chat.say("go on"))
        await gw.wait_for("the turn to wait on D", lambda: gw.engine.instances[lost].calls.count("decode") == 2)
        gw.engine.faults(lost, unreachable=True)
        a = await asyncio.wait_for(turn, 10)
        if len(decode) == 2:
            assert (a.status, a.error) == (200, None) and gw.turns[-1]["decode"] != lost
        else:
            assert a.error is not None and a.error["code"] in ("first_token_deadline", "upstream_unavailable")
        assert "decode_first_token_deadline" in gw.turns[-1]["retries"]


async def test_a_stream_that_falls_silent_ends_with_an_error_event_and_the_conversation_goes_on() -> None:
    async with gateway(timeouts={"decode_idle_s": 0.2}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, freeze=1, drop_after=2)  # two events with output, then nothing, the stream open
        a = await chat.say("go on")
        assert a.status == 200 and a.done and a.error is not None
        assert "sent nothing" in a.error["message"]
        b = await chat.say("and then?")
        assert b.done and b.error is None
        # the silent turn put back the record it claimed (P had taken its handle): the next turn still finds it
        assert gw.turns[-2]["capture"] == "failed_kept_unpinned" and gw.turns[-1]["reason"] == "handle_spent"


@pytest.mark.parametrize("session", ["c1", None], ids=["conversation", "stateless"])
@pytest.mark.parametrize(("failures", "served"), [(1, True), (2, False)])
async def test_a_single_prefill_engine_that_fails_is_asked_once_more(
    session: str | None, failures: int, served: bool
) -> None:
    async with gateway() as gw:
        gw.engine.faults(P0, fail=failures, leg="prefill")
        a = await Chat(gw, session=session).say("what is the weather like")
        assert (a.status == 200) is served, a.body
        assert gw.engine.instances[P0].calls.count("prefill") == min(failures + 1, 2)


@pytest.mark.parametrize("prefill", [[P0, P1], [P0]], ids=["another_p", "one_p"])
async def test_a_wait_on_a_prefill_engine_that_stops_answering_is_given_up_at_once(prefill: list[str]) -> None:
    # P takes the prefill and goes silent, its health probes failing: the turn gives up on it as soon as the
    # fleet finds P lost, not at its first-token deadline, and runs on the other P (or ends with an error)
    async with gateway(prefill=prefill, timeouts={"prefill_first_token_s": 600.0}) as gw:
        chat = await conversation(gw)
        lost = gw.turns[-1]["prefill"]
        gw.engine.faults(lost, hang=1, leg="prefill")
        turn = asyncio.create_task(chat.say("go on"))
        await gw.wait_for("the turn to wait on P", lambda: gw.engine.instances[lost].calls.count("prefill") == 2)
        gw.engine.faults(lost, unreachable=True)
        a = await asyncio.wait_for(turn, 10)
        if len(prefill) == 2:
            assert (a.status, a.error) == (200, None) and gw.turns[-1]["prefill"] != lost
        else:
            assert a.status >= 500 and a.error is not None
        assert gw.metric("turnkv_first_token_deadline_misses_total", leg="prefill") == 1
