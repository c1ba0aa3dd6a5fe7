"""The Responses API's stream events, made from a chat completion's SSE chunks as they are relayed.

One ``EventStream`` per streamed response. It opens with ``response.created`` and
``response.in_progress``; reasoning deltas become a reasoning item (``response.reasoning_text.*``),
content deltas a message item (``response.content_part.*``, ``response.output_text.*``), each tool
call a function_call item (``response.function_call_arguments.*``), each item framed by
``response.output_item.added`` / ``.done``; the end is ``response.completed`` (or
``response.incomplete`` when the answer hit ``max_output_tokens``, ``response.failed`` when the
decode failed mid-stream) with the whole Response. Every event carries its ``sequence_number``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turnkv.gateway.reframe import Event
from turnkv.gateway.responses import translate
from turnkv.gateway.responses.models import ResponsesBody
from turnkv.openai.answer import reasoning_of


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # reasoning, message, function_call
    index: int  # output_index
    item_id: str
    text: list[str] = field(default_factory=list)
    call_index: int = -1  # the chat tool call's index
    call_id: str = ""
    name: str = ""


class EventStream:
    def __init__(self, resp_id: str, req: ResponsesBody) -> None:
        self.resp_id = resp_id
        self.req = req
        self.created_at = time.time()
        self.model: str | None = None
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: _Open | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.blank = ""  # whitespace-only content not yet shown
        self.done = False

    def _event(self, kind: str, **fields: Any) -> Event:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return translate.response_object(
            self.resp_id,
            self.req,
            output=list(self.output),
            status=status,
            created_at=self.created_at,
            usage=self.usage,
            error=error,
            model=self.model,
        )

    def start(self) -> list[Event]:
        r = self.response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    # items

    def _close(self) -> list[Event]:
        o, self.open = self.open, None
        if o is None:
            return []
        text = "".join(o.text)
        at = {"item_id": o.item_id, "output_index": o.index}
        if o.kind == "reasoning":
            item = translate.reasoning_item(text, o.item_id)
            part = {"type": "reasoning_text", "text": text}
            out = [
                self._event("response.reasoning_text.done", **at, content_index=0, text=text),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        elif o.kind == "message":
            status = "incomplete" if self.finish_reason == "length" else "completed"
            item = translate.message_item(text, o.item_id, status=status)
            out = [
                self._event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **at, content_index=0, part=item["content"][0]),
            ]
        else:
            item = translate.call_item(o.call_id, o.name, text, o.item_id)
            out = [self._event("response.function_call_arguments.done", **at, arguments=text, name=o.name)]
        self.output.append(item)
        return [*out, self._event("response.output_item.done", output_index=o.index, item=item)]

    def _open(self, kind: str, **call: Any) -> list[Event]:
        out = self._close()
        index = len(self.output)
        if kind == "reasoning":
            o = _Open(kind, index, translate.new_id("rs"))
            item = {**translate.reasoning_item("", o.item_id, status="in_progress")}
            part: dict[str, Any] | None = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            o = _Open(kind, index, translate.new_id("msg"))
            item = {**translate.message_item("", o.item_id, status="in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            o = _Open(kind, index, translate.new_id("fc"), **call)
            item = translate.call_item(o.call_id, o.name, "", o.item_id, status="in_progress")
            part = None
        self.open = o
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            out.append(
                self._event(
                    "response.content_part.added", item_id=o.item_id, output_index=index, content_index=0, part=part
                )
            )
        return out

    # input

    def chunk(self, obj: Mapping[str, Any]) -> list[Event]:
        """One chat completion chunk."""
        if self.done:
            return []
        if isinstance(obj.get("error"), Mapping) and "choices" not in obj:
            return self.fail(str(obj["error"].get("message") or "decode failed"))
        if isinstance(obj.get("model"), str):
            self.model = obj["model"]
        if isinstance(obj.get("usage"), Mapping):
            self.usage = translate.usage(obj["usage"])
        out: list[Event] = []
        for choice in obj.get("choices") or []:
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                out += self._choice(choice)
        return out

    def _choice(self, choice: Mapping[str, Any]) -> list[Event]:
        """The first choice of a chunk: its reasoning, its text, its tool calls, in that order; its finish."""
        delta = choice.get("delta") or {}
        out = self._reasoning(reasoning_of(delta))
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._content(content)
        for tc in delta.get("tool_calls") or []:
            if isinstance(tc, Mapping):
                out += self._tool_call(tc)
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
        return out

    def _reasoning(self, reasoning: Any) -> list[Event]:
        if not isinstance(reasoning, str) or not reasoning:
            return []
        out = self._open("reasoning") if self.open is None or self.open.kind != "reasoning" else []
        return out + self._delta("response.reasoning_text.delta", reasoning, content_index=0)

    def _tool_call(self, tc: Mapping[str, Any]) -> list[Event]:
        """A tool call's piece: a new call opens its function_call item, a later piece adds to its name and
        arguments."""
        fn = tc.get("function") or {}
        index = int(tc.get("index", 0))
        out: list[Event] = []
        if self.open is None or self.open.kind != "function_call" or self.open.call_index != index:
            call_id = str(tc.get("id") or translate.new_id("call"))
            out += self._open("function_call", call_index=index, call_id=call_id, name=str(fn.get("name") or ""))
        elif isinstance(fn.get("name"), str):
            self.open.name += fn["name"]
        if isinstance(fn.get("arguments"), str) and fn["arguments"]:
            out += self._delta("response.function_call_arguments.delta", fn["arguments"])
        return out

    def _content(self, text: str) -> list[Event]:
        """Answer text; whitespace alone (a template's newlines before a tool call) opens no message."""
        out: list[Event] = []
        if self.open is None or self.open.kind != "message":
            if not (self.blank + text).strip():
                self.blank += text
                return []
            text, self.blank = self.blank + text, ""
            out += self._open("message")
        return out + self._delta("response.output_text.delta", text, content_index=0, logprobs=[])

    def _delta(self, kind: str, text: str, **fields: Any) -> list[Event]:
        o = self.open
        assert o is not None
        o.text.append(text)
        return [self._event(kind, item_id=o.item_id, output_index=o.index, delta=text, **fields)]

    def finish(self) -> tuple[list[Event], dict[str, Any]]:
        """The end of the answer: the last events and the finished Response."""
        out = self._close()
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            out += (
                self._open("message")
                + self._delta("response.output_text.delta", self.blank, content_index=0, logprobs=[])
                + self._close()
            )
        status = "incomplete" if self.finish_reason == "length" else "completed"
        r = self.response(status)
        self.done = True
        out.append(self._event(f"response.{status}", response=r))
        return out, r

    def fail(self, message: str) -> list[Event]:
        self.open = None
        self.done = True
        r = self.response("failed", error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=r)]
