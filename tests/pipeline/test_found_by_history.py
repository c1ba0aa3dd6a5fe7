"""Conversations found from their history (no id) keep what a named one keeps: identical conversations
running at once each reuse (their records share a pool: one per answer), and a request answered before (a
regenerated answer, a retry after the first attempt ended) reuses that answer's record up to its last
message. In process over the simulator-backed engines; every answer is a colocated engine's."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest

from tests.pipeline.harness import D0, Chat, Gateway, gateway
from turnkv.state.base import POOL_SLOTS, ConversationStore
from turnkv.state.memory import MemoryStore
from turnkv.state.redis import RedisStore

TASK = "Plan two days in Lyon for me."


async def together(gw: Gateway, chats: list[Chat], text: str) -> list[str]:
    """One turn of every conversation, all in flight at once (D holds their first tokens until each has
    claimed its record); their outcomes."""
    gw.engine.faults(D0, busy=len(chats))
    turns = [asyncio.create_task(c.say(text)) for c in chats]
    await gw.wait_for("every turn at D", lambda: gw.engine[D0].behind == len(chats))
    gw.engine.free(D0)
    answers = await asyncio.gather(*turns)
    assert all(a.status == 200 and a.error is None for a in answers)
    gw.engine[D0].freed.clear()
    return [a.outcome for a in answers]


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_identical_conversations_running_at_once_each_reuse_their_own_history(store: str) -> None:
    s: ConversationStore = MemoryStore()
    if store == "redis":  # the pool's scripts
        s = RedisStore(fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True))
    async with gateway(conversation_from_history=True, store=s) as gw:
        chats = [Chat(gw, stream=i == 1) for i in range(3)]
        first = await together(gw, chats, TASK)
        assert first == ["none"] * 3
        for step in range(3):
            assert await together(gw, chats, f"And step {step}?") == ["full"] * 3
        assert {t["conversation_source"] for t in gw.turns} == {"digest"}
    await s.close()


async def test_a_regenerated_answer_reuses_the_history_up_to_the_last_message() -> None:
    async with gateway(conversation_from_history=True) as gw:
        chat = Chat(gw)
        for text in (TASK, "And the evening?"):
            assert (await chat.say(text)).status == 200
        chat.messages.pop()  # the client asks for the last answer again: the same request
        again = await chat.send()
        assert (again.outcome, again.reason) == ("partial", "prompt_shorter")
        prompt, matched = int(again.headers["x-turnkv-prompt-tokens"]), int(again.headers["x-turnkv-matched-tokens"])
        assert prompt - gw.svc.settings.block_size <= matched < prompt  # all of it but its last block
        assert (await chat.say("Thanks, and the morning?")).outcome == "full"  # the regenerated answer's record


async def test_a_full_pool_releases_the_handle_of_the_record_that_gives_way() -> None:
    """More identical conversations at once than a pool has slots: the last to store replaces an unclaimed
    record, whose handle nobody can claim now: it is released (``pool_full``), not left pinned on D."""
    async with gateway(conversation_from_history=True) as gw:
        chats = [Chat(gw) for _ in range(POOL_SLOTS + 1)]
        assert await together(gw, chats, TASK) == ["none"] * len(chats)
        await gw.wait_for("the release", lambda: gw.metric("turnkv_handle_releases_total", why="pool_full") == 1)
        assert sorted(t["capture"] for t in gw.turns) == ["stored"] * len(chats)
