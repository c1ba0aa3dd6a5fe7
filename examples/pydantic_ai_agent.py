"""pydantic-ai on the Responses API (``OpenAIResponsesModel``), streamed, with its message history.

pydantic-ai sends the whole history each run and no id turnkv could use; turnkv finds the
conversation from it (``conversation=digest``). Run: ``python examples/run.py pydantic_ai``.
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits
from turnkv_report import API_KEY, BASE_URL, MODEL, SYSTEM, TASKS, Decisions, lookup_fact


async def main() -> None:
    decisions = Decisions()
    client = AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY, http_client=decisions.async_client())
    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=SYSTEM, model_settings=ModelSettings(max_tokens=200))

    @agent.tool_plain
    def lookup(topic: str) -> str:
        """Look up facts about a place."""
        return lookup_fact(topic)

    history = None
    for task in TASKS:
        print(f"user: {task}")
        async with agent.run_stream(task, message_history=history,
                                    usage_limits=UsageLimits(request_limit=6)) as run:
            text = await run.get_output()
        history = run.all_messages()
        print(f"agent: {str(text)[:80]}...")
    decisions.done()


if __name__ == "__main__":
    asyncio.run(main())
