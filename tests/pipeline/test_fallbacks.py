"""Each way a turn falls back to plain P/D, engines replaced mid-turn, deadlines, aborts, a client that
leaves, and many conversations at once: in process over the fake engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.asgi import chat_scope
from tests.pipeline.harness import D0, D1, P0, P1, Chat, Gateway, gateway
from tests.sim_engine import MODEL, SimEngine


async def conversation(gw: Gateway, *, stream: bool = False, session: str = "c1") -> Chat:
    chat = Chat(gw, session=session, stream=stream)
    a = await chat.say("what is the weather like")
    assert a.status == 200, a.body
    return chat


async def test_decode_local_failing_runs_the_turn_through_p_and_releases_the_handle_there() -> None:
    async with gateway(policy={"name": "decode-local"}, decode_memory={"pin": "always"}) as gw:
        chat = await conversation(gw)
        pin = next(iter(gw.engine[D0].pins))
        gw.engine.faults(D0, fail=1, leg="decode")
        a = await chat.say("and then?")
        assert a.status == 200 and (a.outcome, a.action, a.reason) == ("none", "recompute", "decode_local")
        t = gw.turns[-1]
        assert t["retries"] == ["decode_status", "decode_local_failed"] and "direct" not in t
        assert pin in gw.engine[D0].released  # P freed the claimed handle on the way


async def test_a_non_streamed_answer_past_its_deadline_is_run_again() -> None:
    async with gateway(timeouts={"decode_first_token_s": 0.1, "decode_per_token_s": 0.001}) as gw:
        chat = await conversation(gw)
        gw.engine.faults(D0, hang=1, leg="decode")
        a = await chat.say("and then?", max_tokens=20)
        assert a.status == 200 and (a.outcome, a.reason) == ("none", "first_token_deadline")
        assert gw.turns[-1]["retries"] == ["decode_first_token_deadline", "turn_rerun"]


async def test_a_decode_engine_past_its_deadline_gives_way_to_another() -> None:
    engine = SimEngine([P0], [D0, D1])
    async with gateway(engine, decode=[D0, D1], timeouts={"decode_first_token_s": 0.5}) as gw:
        chat = await conversation(gw, stream=True)
        late = gw.turns[-1]["decode"]
        engine.faults(late, stall=1)
        a = await chat.say("and then?")
        assert a.done and a.error is None
        assert gw.turns[-1]["decode"] != late and gw.turns[-1]["reason"] == "first_token_deadline"


async def test_a_second_failure_before_output_is_an_error_event() -> None:
    async with gateway() as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, drop=2, drop_after=0)
        a = await chat.say("and then?")
        assert a.error is not None and a.error["code"] == "upstream_protocol_error"
        assert (
            gw.turns[-1]["capture"] == "failed_kept_unpinned"
        )  # P had pulled: the record goes back without the handle


async def test_an_unreachable_prefill_engine_is_replaced() -> None:
    engine = SimEngine([P0, P1], [D0])
    async with gateway(engine, prefill=[P0, P1], render=None) as gw:
        engine.faults(P0, unreachable=True)
        engine.faults(P1, unreachable=True)
        await gw.wait_for("both marked down", lambda: not any(v.healthy for v in gw.svc.fleet.views("prefill")))
        engine.faults(P1, unreachable=False)
        for i in range(4):  # whichever P a turn starts on, it ends on P1
            a = await Chat(gw).say(f"hello {i}")
            assert a.status == 200 and gw.turns[-1]["prefill"] == P1


async def test_a_single_prefill_engine_whose_connection_failed_is_tried_once_more() -> None:
    async with gateway() as gw:
        calls: list[str] = []
        real = gw.engine._enter

        async def flaky(base: str, leg: str, timeout_s: float | None = None, *, stream: bool = False) -> Any:
            calls.append(leg)
            if leg == "prefill" and calls.count("prefill") == 1:
                from turnkv.errors import UpstreamUnavailable

                raise UpstreamUnavailable("prefill engine unreachable: ConnectionResetError", leg=leg, instance=base)
            return await real(base, leg, timeout_s, stream=stream)

        gw.engine._enter = flaky  # type: ignore[method-assign]  # one connection reset, then fine
        a = await Chat(gw).say("hello")
        assert a.status == 200 and gw.turns[-1]["retries"] == ["prefill_connect"]


async def test_no_engine_left_is_an_openai_error() -> None:
    async with gateway() as gw:
        gw.engine.faults(D0, fail=10, leg="decode")
        a = await Chat(gw, session="c1").say("hello")
        assert a.status == 502 and set(a.body["error"]) == {"message", "type", "param", "code"}
        assert gw.turns[-1]["capture"] == "failed"


async def test_a_shutdown_past_its_drain_aborts_a_stream_in_flight() -> None:
    async with gateway(drain_s=0.0, timeouts={"decode_first_token_s": 30.0}) as gw:
        chat = await conversation(gw, stream=True)
        gw.engine.faults(D0, stall=1)
        task = asyncio.create_task(chat.say("and then?"))
        await gw.wait_for("the stream to be open", lambda: gw.engine[D0].running == 1)
        gw.svc.drain.bind(asyncio.get_running_loop())
        gw.svc.drain.begin()
        a = await task
        assert a.error is not None and a.error["code"] == "shutting_down"
        assert (
            gw.turns[-1]["capture"] == "failed_kept_unpinned"
        )  # P had pulled: the record goes back without the handle


@pytest.mark.parametrize("stream", [False, True])
async def test_a_shutdown_past_its_drain_aborts_a_turn_waiting_on_p(stream: bool) -> None:
    """The abort ends the wait for P's answer at once (its call cancelled), well before P's deadline."""
    async with gateway(drain_s=0.0, timeouts={"prefill_first_token_s": 30.0}) as gw:
        chat = await conversation(gw, stream=stream)
        gw.engine.faults(P0, hang=1, leg="prefill")
        before = gw.engine[P0].calls.count("prefill")
        task = asyncio.create_task(chat.say("and then?"))
        await gw.wait_for("P to have the call", lambda: gw.engine[P0].calls.count("prefill") == before + 1)
        gw.svc.drain.bind(asyncio.get_running_loop())
        gw.svc.drain.begin()
        await asyncio.wait({task}, timeout=10)  # not wait_for: cancelling the client would end the turn too
        assert task.done(), "the abort did not end the turn's wait on P"
        a = task.result()
        assert a.error is not None and a.error["code"] == "shutting_down"
        assert (
            gw.turns[-1]["capture"] == "failed_kept_unpinned"
        )  # P had pulled: the record goes back without the handle
        assert gw.engine[P0].hung == 0  # P's call was given up on, not left waiting


async def test_a_client_that_leaves_mid_stream_aborts_d_and_frees_its_handle() -> None:
    async with gateway() as gw:
        chat = await conversation(gw)
        body = json.dumps(
            {"model": MODEL, "stream": True, "messages": [*chat.messages, {"role": "user", "content": "a long answer"}]}
        ).encode()
        received: list[dict[str, Any]] = []
        left = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            received.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                left.set()  # the client stops reading after its first chunk, and goes away
                await asyncio.Event().wait()

        scope = chat_scope({"x-session-id": "c1"})
        await asyncio.wait_for(gw.app(scope, receive, send), 10)  # type: ignore[arg-type]
        await gw.wait_for("the turn's log", lambda: len(gw.turns) == 2)
        assert (
            gw.turns[-1]["capture"] == "failed_kept_unpinned"
        )  # P had pulled: the record goes back without the handle
        await gw.wait_for("D's handles to be freed", lambda: not gw.engine[D0].pins)
        assert gw.metric("turnkv_handle_releases_total", why="failed_turn") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_many_conversations_at_once_stay_correct(stream: bool) -> None:
    engine = SimEngine([P0, P1], [D0, D1], template="strip")
    async with gateway(engine, prefill=[P0, P1], decode=[D0, D1], policy={"name": "adaptive"}) as gw:

        async def talk(i: int) -> list[str]:
            chat = Chat(gw, session=f"conv-{i}", stream=stream)
            reasons = []
            for t in range(4):
                a = await chat.say(f"conversation {i} turn {t}")  # Chat checks each answer against the truth
                assert a.status == 200 and a.error is None
                reasons.append(a.reason)
            return reasons

        results = await asyncio.gather(*(talk(i) for i in range(24)))
        assert all(r[0] == "no_record" for r in results)
        assert len(gw.turns) == 24 * 4
