"""Routing by load and affinity together (``routing: load-affinity``), in process over the fake
engines: a later turn goes to the P that served its conversation (its prefix cache holds the history)
until that P's queue is longer than recomputing the whole prompt elsewhere; then to the other P, and back
once the queue is gone. Every answer is checked against a colocated engine's (``Chat``)."""

from __future__ import annotations

import asyncio

from tests.pipeline.harness import D0, D1, P0, P1, Chat, gateway
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


async def test_the_decode_leg_goes_to_the_d_the_turn_was_planned_or_admitted_to() -> None:
    # round-robin takes tied engines in turn at every pick. A turn's D is picked once: the decode leg goes
    # where the plan put it (a decode-local turn can go nowhere else), or, planned to none, where admission
    # reserved room for it. Picked again there, every new conversation landed on the same D, and a
    # decode-local turn could be handed another D than its own and fall back through P.
    engine = SimEngine([P0], [D0, D1])
    async with gateway(engine, decode=[D0, D1], routing="round-robin", policy={"name": "decode-local"}) as gw:
        chats = [Chat(gw, session=f"c{i}") for i in range(CONVERSATIONS)]
        for c in chats:
            assert (await c.say("Plan a trip.")).status == 200
        homes = [t["decode"] for t in gw.turns]
        assert homes == [D0, D1] * (CONVERSATIONS // 2)  # taken in turn
        for _ in range(2):
            for c, home in zip(chats, homes, strict=True):
                a = await c.say("And then?")
                t = gw.turns[-1]
                assert (a.action, t["decode"], t.get("retries")) == ("decode_local", home, None), t
