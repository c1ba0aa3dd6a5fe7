"""LangChain + LangGraph: a prebuilt ReAct agent on ``ChatOpenAI`` (chat completions), streamed, with
a checkpointer keeping the thread's history.

LangGraph sends the whole thread every call and no id turnkv could use; turnkv finds the
conversation from it (``conversation=digest``). LangChain does not send the answer's reasoning back,
so with a template that keeps earlier reasoning turnkv reuses the history up to that answer (the
divergence ``client_dropped_reasoning``; at the default policy D computes the rest itself:
``decode_local``). Run: ``python examples/run.py langgraph``.
"""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import create_react_agent
from turnkv_report import API_KEY, BASE_URL, MODEL, SYSTEM, TASKS, Decisions, lookup_fact


@tool
def lookup(topic: str) -> str:
    """Look up facts about a place."""
    return lookup_fact(topic)


def main() -> None:
    decisions = Decisions()
    llm = ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key=API_KEY, streaming=True, max_tokens=200,
                     http_client=decisions.client())
    graph = create_react_agent(llm, [lookup], prompt=SYSTEM, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "trip"}, "recursion_limit": 12}
    for task in TASKS:
        print(f"user: {task}")
        last = None
        for chunk, _meta in graph.stream({"messages": [("user", task)]}, config, stream_mode="messages"):
            last = chunk
        print(f"agent: {str(getattr(last, 'content', ''))[:80]}...")
    decisions.done()


if __name__ == "__main__":
    main()
