"""A tool-using agent on the openai SDK's chat completions, streamed, with no conversation id.

The loop every hand-written agent has: send the history, stream the answer, run the tools it calls,
append everything, repeat. turnkv finds the conversation from the messages (``conversation=digest``).
Run: ``python examples/run.py openai_chat`` (or this file against a gateway at $TURNKV_URL).
"""

from __future__ import annotations

import json
from typing import Any

import openai
from turnkv_report import API_KEY, BASE_URL, MODEL, SYSTEM, TASKS, Decisions, lookup_fact

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up facts about a place",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}}}]
MAX_STEPS = 4  # model calls per task


def stream_answer(client: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    content, reasoning = "", ""
    calls: dict[int, dict[str, str]] = {}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            slot["name"] += (tc.get("function") or {}).get("name") or ""
            slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning": reasoning}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for _, c in sorted(calls.items())]
    return message


def main() -> None:
    decisions = Decisions()
    client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, http_client=decisions.client())
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for task in TASKS:
        print(f"user: {task}")
        messages.append({"role": "user", "content": task})
        for _ in range(MAX_STEPS):
            answer = stream_answer(client, messages)
            messages.append(answer)
            if not answer.get("tool_calls"):
                print(f"agent: {answer['content'][:80]}...")
                break
            for call in answer["tool_calls"]:
                topic = json.loads(call["function"]["arguments"] or "{}").get("topic", "?")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": lookup_fact(str(topic))})
    decisions.done()


if __name__ == "__main__":
    main()
