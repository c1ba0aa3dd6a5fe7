"""smolagents: a ``ToolCallingAgent`` on ``OpenAIServerModel`` (chat completions), streamed.

smolagents sends its memory back as text (tool calls as "Calling tools: ...", results as
"Observation: ..."), not as the answer the model gave; turnkv still finds the conversation, since
the key is the request an answer was for, and reuses the history up to that answer (the divergence
``answer_as_text``; at the default policy D computes the rest itself: ``decode_local``). Run:
``python examples/run.py smolagents``.
"""

from __future__ import annotations

from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from turnkv_report import API_KEY, BASE_URL, MODEL, TASKS, Decisions, lookup_fact


@tool
def lookup(topic: str) -> str:
    """Look up facts about a place.

    Args:
        topic: the place or thing to look up
    """
    return lookup_fact(topic)


def main() -> None:
    decisions = Decisions()
    model = OpenAIServerModel(MODEL, api_base=BASE_URL, api_key=API_KEY, max_tokens=200,
                              client_kwargs={"http_client": decisions.client()})
    agent = ToolCallingAgent(tools=[lookup], model=model, max_steps=6, stream_outputs=True, verbosity_level=-1)
    for i, task in enumerate(TASKS[:3]):
        print(f"user: {task}")
        answer = agent.run(task, reset=i == 0)
        print(f"agent: {str(answer)[:80]}...")
    decisions.done()


if __name__ == "__main__":
    main()
