"""A tool-using agent on the openai SDK's Responses API, streamed, chained by ``previous_response_id``.

Each request sends only what is new (tool results, the next task) and names the previous response;
the gateway keeps the responses it served and the conversation's KV with them
(``conversation=response``). Run: ``python examples/run.py openai_responses``.
"""

from __future__ import annotations

import json
from typing import Any

import openai
from turnkv_report import API_KEY, BASE_URL, MODEL, SYSTEM, TASKS, Decisions, lookup_fact

TOOLS: list[Any] = [{"type": "function", "name": "lookup", "description": "Look up facts about a place",
                     "parameters": {"type": "object", "properties": {"topic": {"type": "string"}},
                                    "required": ["topic"]}}]
MAX_STEPS = 4


def main() -> None:
    decisions = Decisions()
    client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, http_client=decisions.client())
    previous: str | None = None
    for task in TASKS:
        print(f"user: {task}")
        new_input: list[Any] = [{"role": "user", "content": task}]
        for _ in range(MAX_STEPS):
            response = None
            stream = client.responses.create(model=MODEL, instructions=SYSTEM, input=new_input, tools=TOOLS,
                                             previous_response_id=previous, max_output_tokens=200, stream=True)
            for event in stream:
                if event.type == "response.completed":
                    response = event.response
            assert response is not None, "the stream ended without response.completed"
            previous = response.id
            calls = [o for o in response.output if o.type == "function_call"]
            if not calls:
                print(f"agent: {response.output_text[:80]}...")
                break
            new_input = [{"type": "function_call_output", "call_id": c.call_id,
                          "output": lookup_fact(str(json.loads(c.arguments or "{}").get("topic", "?")))}
                         for c in calls]
    decisions.done()


if __name__ == "__main__":
    main()
