"""Classifies a model's chat template by how it renders history one turn later.

A probe conversation (reasoning and a tool call) is rendered as turn N, as turn N's answer, and as
turn N+1. If turn N+1 starts with turn N plus its answer, the template ``preserves`` history; if it
starts with that answer minus its reasoning, it ``drops_reasoning``; otherwise it
``rewrites_history``. This is advice for operators and for explaining refusals: the per-turn token
check stays the authority.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from turnkv.engine.base import CallMeta, TurnCalls
from turnkv.reuse.assess import TemplateClass

Render = Callable[[list[dict[str, Any]], bool], Awaitable[Sequence[int]]]

PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "The user wants the weather. I should call the tool.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny and 21 C in Paris.", "reasoning": "The tool answered."},
    {"role": "user", "content": "And tomorrow?"},
]
_PLAIN_HISTORY: list[dict[str, Any]] = [m for m in _HISTORY if m["role"] != "tool" and not m.get("tool_calls")]
_ANSWER = {"role": "assistant", "content": "Tomorrow looks similar.", "reasoning": "No new data; say so."}
_NEXT = {"role": "user", "content": "Thanks."}


def probe_history(tools: bool = True) -> list[dict[str, Any]]:
    """The audit's conversation up to turn N's generation prompt (with its tool call, or without)."""
    return list(_HISTORY if tools else _PLAIN_HISTORY)


def _starts(seq: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(seq) >= len(prefix) and list(seq[: len(prefix)]) == list(prefix)


async def classify(render: Render, *, tools: bool = True) -> tuple[TemplateClass, str]:
    """Classify with the probe conversation (with a tool call, or without for templates that lack tools)."""
    history = _HISTORY if tools else _PLAIN_HISTORY
    turn_n = await render(list(history), True)
    answered = await render([*history, _ANSWER], False)
    turn_next = await render([*history, _ANSWER, _NEXT], True)
    if not _starts(answered, turn_n):
        return TemplateClass.REWRITES_HISTORY, "the answer does not extend the generation prompt"
    if _starts(turn_next, answered):
        return TemplateClass.PRESERVES, "turn N+1 extends turn N and its answer token for token"
    bare = await render([*history, {k: v for k, v in _ANSWER.items() if k != "reasoning"}], False)
    if _starts(turn_next, bare):
        return TemplateClass.DROPS_REASONING, "turn N+1 drops the reasoning of turn N's answer"
    common = next(
        (i for i, (a, b) in enumerate(zip(turn_next, answered, strict=False)) if a != b),
        min(len(turn_next), len(answered)),
    )
    return TemplateClass.REWRITES_HISTORY, f"turn N+1 leaves turn N's tokens at position {common}"


def engine_renderer(engine: TurnCalls, base: str, model: str | None, *, tools: bool = True) -> Render:
    """A ``Render`` over an engine's own render."""

    async def render(messages: list[dict[str, Any]], generation: bool) -> Sequence[int]:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation}
        if tools:
            body["tools"] = PROBE_TOOLS
        if model:
            body["model"] = model
        return await engine.render(base, body, CallMeta())

    return render
