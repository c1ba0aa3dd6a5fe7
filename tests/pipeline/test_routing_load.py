"""Routing by load and affinity together (``routing: load-affinity``), in process over the fake
engines: a later turn goes to the P that served its conversation (its prefix cache holds the history)
until that P's queue is longer than recomputing the whole prompt elsewhere; then to the other P, and back
once the queue is gone. Every answer is checked against a colocated engine's (``Chat``)."""

from __future__ import annotations

import asyncio

from tests.pipeline.harness import D0, P0, P1, Chat, gateway
from tests.sim_engine import SimEngine

HISTORY = "Tell me everything about the weather in every town you know, in detail. " * 40
CONVERSATIONS = 4


async def test_a_long_queue_at_the_conversations_p_sends_its_turns_to_the_other_p() -> None:
    engine = SimEngine([P0, P1], [D0])
    async with gateway(engine, prefill=[P0, P1], routing="load-affinity", policy={"name": "never-pull"}) as gw:
        chats = [Chat(gw, session=f"c{i}") for i in range(CONVERSATIONS)]

        async def turn(chat: Chat, text: str) -> str:
            a = await chat.say(text)
            assert a.status == 200, a.body
            return a.headers["x-request-id"]

        async def all_turns(text: str, *, one_at_a_time: bool = False) -> dict[str, str]:
            if one_at_a_time:
                ids = [await turn(c, f"{text} {HISTORY}") for c in chats]
            else:
                ids = await asyncio.gather(*(turn(c, f"{text} {HISTORY}") for c in chats))
            by_id = {t["request_id"]: t for t in gw.turns}
            return {str(c.session): str(by_id[i]["prefill"]) for c, i in zip(chats, ids, strict=True)}

        home = await all_turns("first")
        assert set(home.values()) == {P0, P1}  # first turns spread over the shorter queues
        # idle Ps: each conversation back to the P that caches it
        assert await all_turns("second", one_at_a_time=True) == home

        # the P of the first conversations gets seconds of prefill work in flight (an 8k-token first turn
        # of someone else's, as prefill.run reports one): their turns now wait least on the other P
        busy = home["c0"]
        other = P1 if busy == P0 else P0
        held = gw.svc.fleet.hold(busy, work_s=5.0, tokens=200_000)
        moved = await all_turns("third")
        assert set(moved.values()) == {other}
        held.release()
        # P's queue gone: the P that now holds each conversation's prefix is the one it last used (one
        # at a time: sent together, the last ones wait behind the first ones' prefills, measured in wall
        # time, and may be sent back to the idle P that holds an older prefix)
        assert await all_turns("fourth", one_at_a_time=True) == moved
