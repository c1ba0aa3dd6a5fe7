"""What derender gives: a whole answer (``Answer``), a streamed piece of one (``Delta``), and the end of a stream
(``Ending``: the authoritative answer and what the stream still owes the client so that it adds up to it).

Also the one non-streaming derender call, in each vLLM version's shape (``derender_request``,
``answer_of``): 0.26 takes the prompt as a count (``prompt_tokens``), 0.27+ as ids (``prompt_token_ids``,
which it decodes in context); both need the client's chat request when the render service runs a reasoning or
tool parser. 0.26 also keeps the engine's finish reason where a tool was called, and decodes the stop token
with the output; turnkv drops that token first (as 0.33 does itself) and says ``tool_calls`` (as vLLM's own
chat server does), so every version gives a client the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkv.errors import UpstreamProtocolError


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed answer."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class Answer:
    """A whole answer as a render service's non-streaming derender says it."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str


@dataclass(frozen=True)
class Ending:
    """The end of a streamed answer."""

    answer: Answer  # what the answer is
    rest: Delta  # what the stream still owes the client, so that it adds up to ``answer``
    diverged: bool = False  # the stream already gave text that is not a prefix of ``answer`` (counted, logged)
    calls: int = 0  # render-service calls the stream made, the final derender included


@dataclass(frozen=True)
class Output:
    """A tokens-only engine's answer, as derender needs it."""

    request_id: str
    token_ids: Sequence[int]
    finish_reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)  # usage, kv_transfer_params, passed as they are


def output_ids_for_text(ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The ids whose text is the answer: a ``stop`` ends on the stop token (no stop strings reach a tokens-only
    engine), which a client never sees."""
    return list(ids[:-1]) if finish_reason == "stop" and ids else list(ids)


def derender_request(
    version: tuple[int, int],
    model: str | None,
    out: Output,
    *,
    prompt_ids: Sequence[int],
    chat_request: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One non-streaming ``/v1/chat/completions/derender`` body for a render service of ``version``."""
    ids = output_ids_for_text(out.token_ids, out.finish_reason)
    if not ids:
        ids = list(out.token_ids)  # only the stop token: derender refuses an empty list, and it decodes to ""
    generate = {
        "request_id": out.request_id,
        "choices": [{"index": 0, "finish_reason": out.finish_reason, "token_ids": ids}],
        **out.extra,
    }
    body: dict[str, Any] = {"model": model, "generate_response": generate, "prompt_tokens": len(prompt_ids)}
    if version >= (0, 27):
        body["prompt_token_ids"] = list(prompt_ids)
    if chat_request is not None:
        body["chat_request"] = dict(chat_request)
    return body


def _tool_calls(raw: Any, where: str) -> tuple[ToolCall, ...]:
    calls: list[ToolCall] = []
    for tc in raw or []:
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise UpstreamProtocolError(f"derender answered a tool call without a name ({where})", leg="derender")
        args = fn.get("arguments")
        calls.append(ToolCall(str(tc.get("id") or ""), fn["name"], args if isinstance(args, str) else ""))
    return tuple(calls)


def answer_of(body: Mapping[str, Any], *, tool_choice: Any = None) -> Answer:
    """The answer of a non-streaming derender body, with vLLM chat's ``finish_reason`` (``tool_calls`` when a
    call was made and the choice was not a named function)."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamProtocolError("derender answered no choice", leg="derender")
    choice = choices[0]
    msg = choice.get("message")
    if not isinstance(msg, Mapping):
        raise UpstreamProtocolError("derender answered a choice without a message", leg="derender")
    calls = _tool_calls(msg.get("tool_calls"), "message")
    finish = str(choice.get("finish_reason") or "stop")
    if calls and finish == "stop" and not isinstance(tool_choice, Mapping):
        finish = "tool_calls"
    content, reasoning = msg.get("content"), msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    return Answer(
        content if isinstance(content, str) else None,
        reasoning if isinstance(reasoning, str) else None,
        calls,
        finish,
    )


def reconcile(streamed: Delta, answer: Answer, calls_sent: int = 0) -> tuple[Delta, bool]:
    """What a stream that gave ``streamed`` (its text, and ``calls_sent`` tool calls) still owes to add up to
    ``answer``, and whether what it gave is not a prefix of it (then the rest is what follows the longest
    common prefix: the client's text is wrong already, and the ending says so)."""
    diverged = False
    rest: list[str] = []
    for given, want in ((streamed.reasoning, answer.reasoning or ""), (streamed.content, answer.content or "")):
        if want.startswith(given):
            rest.append(want[len(given) :])
            continue
        diverged = True
        n = 0
        for a, b in zip(given, want, strict=False):
            if a != b:
                break
            n += 1
        rest.append(want[n:])
    return Delta(rest[0], rest[1], answer.tool_calls[calls_sent:]), diverged
