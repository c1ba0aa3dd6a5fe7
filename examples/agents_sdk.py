"""The OpenAI Agents SDK with its defaults: the Responses API, a session holding the history, streamed.

The SDK sends the whole history every turn and no id turnkv could use; turnkv finds the conversation
from it (``conversation=digest``). Only the client's base URL points at the gateway.
Run: ``python examples/run.py agents_sdk``.
"""

from __future__ import annotations

import asyncio

from agents import (
    Agent,
    ModelSettings,
    Runner,
    SQLiteSession,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from turnkv_report import API_KEY, BASE_URL, MODEL, SYSTEM, TASKS, Decisions, lookup_fact

MAX_TURNS = 6  # model calls per task


@function_tool
def lookup(topic: str) -> str:
    """Look up facts about a place."""
    return lookup_fact(topic)


async def main() -> None:
    decisions = Decisions()
    set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
    set_default_openai_client(AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY, http_client=decisions.async_client()))
    agent = Agent(name="planner", instructions=SYSTEM, model=MODEL, tools=[lookup],
                  model_settings=ModelSettings(max_tokens=200))
    session = SQLiteSession("trip")  # in memory
    for task in TASKS:
        print(f"user: {task}")
        result = Runner.run_streamed(agent, task, session=session, max_turns=MAX_TURNS)
        async for _ in result.stream_events():
            pass
        print(f"agent: {str(result.final_output)[:80]}...")
    decisions.done()


if __name__ == "__main__":
    asyncio.run(main())
