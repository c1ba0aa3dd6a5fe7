"""An OpenAI chat answer: its text collected from stream deltas or a whole message, and digests of it,
as streamed and as a client sends it back, to explain a refusal.

The token chain decides whether KV may be reused; these digests only say why it may not: the
client edited the answer, dropped its reasoning, or sent the same text that now tokenizes
differently. Whitespace at the ends and JSON formatting of tool arguments are normalised away.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def text_digest(text: str | None) -> str:
    return hashlib.blake2b((text or "").encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class EchoedAnswer:
    """The previous answer as the client sent it back (digests of its stripped text)."""

    answer_digest: str
    has_reasoning: bool
    reasoning_digest: str | None
    calls: int = 0  # tool calls it carries


ARGUMENTS_DEPTH = 64  # tool-call arguments nested deeper are compared as text (a JSON encoder's recursion)


def _nested_within(value: Any, depth: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > depth:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def _json_arguments(args: Any) -> tuple[bool, Any]:
    """(True, the JSON value) of a tool call's arguments, or (False, their text, stripped) when they are not
    JSON or are nested deeper than ``ARGUMENTS_DEPTH``: clients send any string there."""
    if not isinstance(args, str):
        return (True, args) if _nested_within(args, ARGUMENTS_DEPTH) else (False, str(args))
    try:
        value = json.loads(args)
    except (ValueError, RecursionError):
        return False, args.strip()
    return (True, value) if _nested_within(value, ARGUMENTS_DEPTH) else (False, args.strip())


def tool_arguments(args: Any) -> Any:
    """A tool call's arguments as compared across turns: the JSON value they hold, else their text."""
    return _json_arguments(args)[1]


def _canonical_args(args: Any) -> str:
    is_json, value = _json_arguments(args)
    return json.dumps(value, sort_keys=True, ensure_ascii=False) if is_json else str(value)


def answer_digest(content: str | None, tool_calls: Iterable[tuple[str, Any]]) -> str:
    parts = [(content or "").strip()]
    parts += [f"{name}\x00{_canonical_args(args)}" for name, args in tool_calls]
    return text_digest("\x01".join(parts))


def reasoning_digest(reasoning: str | None) -> str | None:
    r = (reasoning or "").strip()
    return text_digest(r) if r else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, Mapping) else None
        if isinstance(fn, Mapping):
            out.append((str(fn.get("name", "")), fn.get("arguments")))
    return out


def reasoning_of(m: Mapping[str, Any]) -> Any:
    """A message's (or a delta's) reasoning: ``reasoning``, or ``reasoning_content`` as older vLLM and
    some clients name it."""
    return m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content")


# Which message is "the last answer" depends on the question, so both rules live here, side by side:
def last_assistant(messages: Sequence[Any]) -> int | None:
    """Index of the last assistant message, whatever follows it; None when there is none (a
    conversation's first turn)."""
    i = len(messages) - 1
    while i >= 0 and not (isinstance(messages[i], Mapping) and messages[i].get("role") == "assistant"):
        i -= 1
    return i if i >= 0 else None


def echoed_answer(messages: Sequence[Any]) -> EchoedAnswer | None:
    """The answer the client continues, as digests: the assistant message right before the trailing
    user and tool messages (None when anything else comes between: then it is not the answer D's
    record ends with)."""
    i = len(messages) - 1
    while i >= 0 and isinstance(messages[i], Mapping) and messages[i].get("role") in ("user", "tool"):
        i -= 1
    if i < 0 or not isinstance(messages[i], Mapping) or messages[i].get("role") != "assistant":
        return None
    m = messages[i]
    reasoning = reasoning_of(m)
    rd = reasoning_digest(reasoning if isinstance(reasoning, str) else None)
    calls = _calls(m)
    return EchoedAnswer(answer_digest(_text(m.get("content")), calls), rd is not None, rd, len(calls))


@dataclass
class AnswerAccumulator:
    """Collects an answer's text from stream deltas or a full message."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [name, arguments]

    def delta(self, d: Mapping[str, Any]) -> None:
        if isinstance(d.get("content"), str):
            self.content.append(d["content"])
        r = reasoning_of(d)
        if isinstance(r, str):
            self.reasoning.append(r)
        for tc in d.get("tool_calls") or []:
            if not isinstance(tc, Mapping):
                continue
            slot = self.calls.setdefault(int(tc.get("index", 0)), ["", ""])
            fn = tc.get("function") or {}
            if isinstance(fn.get("name"), str):
                slot[0] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot[1] += fn["arguments"]

    def message(self, m: Mapping[str, Any]) -> None:
        self.content.append(_text(m.get("content")))
        r = reasoning_of(m)
        if isinstance(r, str):
            self.reasoning.append(r)
        for i, (name, args) in enumerate(_calls(m)):
            self.calls[i] = [name, args if isinstance(args, str) else json.dumps(args)]

    def digests(self) -> tuple[str, str | None]:
        calls = [(n, a) for _, (n, a) in sorted(self.calls.items())]
        return answer_digest("".join(self.content), calls), reasoning_digest("".join(self.reasoning))
