"""What agents do without a conversation id, through the real ``openai`` SDK: the same task started several
times at once, an answer asked for again (a regenerate), and a request the SDK retries itself after the
gateway's 502. Each reuses what it should, says why, and every answer is a colocated engine's.

In process: the whole gateway over the simulator-backed engines (``tests.pipeline.harness``) at the
default policy, the SDK's HTTP client on an ASGI transport."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx2
import openai
import pytest

from tests.pipeline.harness import D0, Gateway, gateway
from tests.sim_engine import MODEL

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up",
            "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}},
        },
    }
]
TASK = [
    {"role": "system", "content": "You are a travel agent. Call the lookup tool for facts."},
    {"role": "user", "content": "Plan two days in Lyon for me."},
]
REUSED = ("full", "partial", "decode_local")


def sdk(gw: Gateway, max_retries: int = 0) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), base_url="http://gateway.test")
    return openai.AsyncOpenAI(
        api_key="key-a", base_url="http://gateway.test/v1", http_client=http, max_retries=max_retries
    )


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with gateway(conversation_from_history=True, policy={"name": "adaptive"}) as g:
        yield g


class Agent:
    """A tool-calling loop as agents write it: the answer goes back as the SDK returned it, a tool result
    after each call, a user message when it answers in text."""

    def __init__(self, gw: Gateway, client: openai.AsyncOpenAI) -> None:
        self.gw, self.client = gw, client
        self.messages: list[dict[str, Any]] = [dict(m) for m in TASK]
        self.headers: list[httpx2.Headers] = []
        self.sent: list[int] = []  # the history's length as each request was sent

    async def step(self) -> httpx2.Headers:
        self.sent.append(len(self.messages))
        truth = self.gw.engine.truth({"messages": self.messages, "tools": TOOLS, "max_tokens": 60})
        raw = await self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=cast(Any, self.messages), tools=TOOLS, max_tokens=60
        )
        m = raw.parse().choices[0].message.model_dump(exclude_none=True)
        assert _compared(m) == _compared(truth), "the answer differs from a colocated engine's"
        self.messages.append(m)
        for call in m.get("tool_calls") or ():
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C."})
        if not m.get("tool_calls"):
            self.messages.append({"role": "user", "content": f"And then? ({len(self.messages)})"})
        self.headers.append(raw.headers)
        return raw.headers


def _compared(m: dict[str, Any]) -> dict[str, Any]:
    """What a client sees of an answer, tool call ids left out (engines make them up)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    return {"content": m.get("content") or None, "reasoning": m.get("reasoning") or None, "calls": calls}


async def test_the_same_task_started_at_once_reuses_in_every_run(gw: Gateway) -> None:
    """Four identical runs of one task at once: each keeps its own record (their key's pool holds one per
    run), so none blocks another's reuse."""
    client = sdk(gw)
    agents = [Agent(gw, client) for _ in range(4)]
    for _ in range(5):
        await asyncio.gather(*(a.step() for a in agents))
    later = [h for a in agents for h in a.headers[1:]]
    reused = [h["x-turnkv-outcome"] in REUSED for h in later]
    assert sum(reused) / len(reused) >= 0.85, [(h["x-turnkv-outcome"], h["x-turnkv-reason"]) for h in later]
    assert {h["x-turnkv-conversation"] for a in agents for h in a.headers} == {"digest"}
    assert "concurrent_turn" not in {t["reason"] for t in gw.turns}


async def test_a_regenerated_answer_reuses_the_history_and_the_conversation_goes_on(gw: Gateway) -> None:
    agent = Agent(gw, sdk(gw))
    for _ in range(3):
        await agent.step()
    agent.messages = agent.messages[: agent.sent[-1]]  # the request that produced the last answer
    again = await agent.step()  # the same request as the one before: the client asks for its answer again
    assert (again["x-turnkv-outcome"], again["x-turnkv-reason"]) in {
        ("partial", "prompt_shorter"),
        ("decode_local", "decode_local"),
    }
    assert int(again["x-turnkv-matched-tokens"]) > 0
    assert (await agent.step())["x-turnkv-outcome"] in REUSED  # the regenerated answer's own record


async def test_a_request_the_sdk_retries_after_a_502_reuses_the_record_its_failed_attempt_put_back(
    gw: Gateway,
) -> None:
    """Two runs of one task: one's request fails (D fails it three times: a 502) and the SDK sends it again.
    The failed attempt put back the record it claimed, in its slot of the pool: the retry reuses it, and the
    other run's record beside it is untouched."""
    client = sdk(gw, max_retries=2)
    one, other = Agent(gw, client), Agent(gw, client)
    for _ in range(2):
        await asyncio.gather(one.step(), other.step())
    gw.engine.faults(D0, fail=3, leg="decode")  # D-local, plain P/D and the gateway's rerun: a 502
    retried = await one.step()  # the SDK's own retry, on the request as it was
    failed = gw.turns[-2]
    assert (failed["reason"], failed["capture"]) == ("decode_failed", "failed_kept_previous"), failed
    assert (retried["x-turnkv-outcome"], retried["x-turnkv-reason"]) == ("decode_local", "decode_local")
    assert (await other.step())["x-turnkv-outcome"] == "decode_local"
