"""Only a turn that completed replaces a conversation's record: a turn an engine refused, one the client
left, one a drain aborted (with Redis: across the restart too) puts back the record it claimed, so its retry
finds the history. Under always-pull P has already pulled the handle by then: the record goes back without
it (``failed_kept_unpinned``) and the retry says so (``handle_spent``), not ``no_record``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import fakeredis

from tests.asgi import chat_scope
from tests.pipeline.harness import D0, Chat, Gateway, gateway
from tests.sim_engine import MODEL, SimEngine
from turnkv.state.redis import RedisStore


async def two_turns(gw: Gateway, **chat: Any) -> Chat:
    c = Chat(gw, **chat)
    for text in ("Plan a short trip.", "And the second day?"):
        a = await c.say(text)
        assert a.status == 200, a.body
    return c


async def retried(c: Chat, failed: Any) -> Any:
    """The same request again, once the failed attempt is settled: its answer is the colocated engine's."""
    assert failed.status >= 400 or failed.error is not None
    c.messages.pop()  # the client sends its last message again
    return await c.say("Now the third day?")


async def test_a_request_d_refuses_after_p_pulled_keeps_the_record_for_its_resend() -> None:
    async with gateway(conversation_from_history=True) as gw:
        c = await two_turns(gw)
        gw.engine.faults(D0, refuse=1, leg="decode")
        refused = await c.say("Now the third day?")
        assert refused.status == 400 and refused.error == {
            "message": "fake engine refusal",
            "type": "BadRequestError",
            "code": 400,
        }
        assert gw.turns[-1]["capture"] == "failed_kept_unpinned"
        again = await retried(c, refused)
        assert (again.outcome, again.reason) == ("none", "handle_spent")
        assert gw.turns[-1]["conversation_source"] == "digest"
        assert (await c.say("And the fourth?")).reason == "full_match"  # the retry stored the next record


async def test_a_stream_the_client_left_keeps_the_record_for_the_retry() -> None:
    async with gateway(conversation_from_history=True) as gw:
        c = await two_turns(gw, stream=True)
        body = {
            "model": MODEL,
            "stream": True,
            "messages": [*c.messages, {"role": "user", "content": "Now the third day?"}],
        }
        left = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                left.set()  # the client stops reading after its first chunk, and goes away
                await asyncio.Event().wait()

        await asyncio.wait_for(gw.app(chat_scope({}), receive, send), 10)  # type: ignore[arg-type]
        await gw.wait_for("the turn to be settled", lambda: len(gw.turns) == 3)
        assert gw.turns[-1]["capture"] == "failed_kept_unpinned"
        again = await c.say("Now the third day?")
        assert (again.outcome, again.reason) == ("none", "handle_spent")


async def test_turns_a_drain_aborted_keep_their_records_across_a_restart() -> None:
    server = fakeredis.FakeServer()

    def store() -> RedisStore:
        return RedisStore(fakeredis.aioredis.FakeRedis(server=server, decode_responses=True))

    engine = SimEngine(["http://p0.fake"], [D0])
    first = store()
    async with gateway(engine, store=first, conversation_from_history=True, drain_s=0.0) as gw:
        chats = [await two_turns(gw, session=f"c{i}", stream=True) for i in range(2)]
        gw.engine.faults(D0, stall=2)
        tasks = [asyncio.create_task(c.say("Now the third day?")) for c in chats]
        await gw.wait_for("both streams open", lambda: gw.engine[D0].running == 2)
        gw.svc.drain.bind(asyncio.get_running_loop())
        gw.svc.drain.begin()
        aborted = await asyncio.gather(*tasks)
        assert all(a.error is not None and a.error["code"] == "shutting_down" for a in aborted)
        assert [t["capture"] for t in gw.turns[-2:]] == ["failed_kept_unpinned"] * 2
    await first.close()
    engine.faults(D0, stall=0)
    again = store()
    async with gateway(engine, store=again, conversation_from_history=True) as gw:  # the restarted gateway
        for c in chats:
            c.gw = gw
            c.messages.pop()
            a = await c.say("Now the third day?")
            assert (a.outcome, a.reason) == ("none", "handle_spent")
    await again.close()
