"""Anthropic's stream events, made from a chat completion's SSE chunks as they are relayed.

One ``MessageStream`` per streamed message: ``message_start`` and a ``ping``; then a content block per
part of the answer, each ``content_block_start``, its deltas (``thinking_delta`` for reasoning,
``text_delta`` for content, ``input_json_delta`` for a tool call's arguments) and ``content_block_stop``;
at the end ``message_delta`` (the stop reason and the usage) and ``message_stop``. A failure after the
stream began is Anthropic's ``error`` event, the last one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from turnkv.gateway.error_responses import anthropic_from_openai
from turnkv.gateway.messages import translate
from turnkv.gateway.reframe import Event
from turnkv.openai.answer import reasoning_of


class MessageStream:
    def __init__(self, reply: translate.Reply) -> None:
        self.reply = reply
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type
        self.call_index = -1  # the open tool_use block's chat tool call
        self.shown = False  # a text or tool_use block was sent
        self.calls = False
        self.blank = ""  # blank content not yet shown: a template's newlines before a tool call
        self.finish_reason: str | None = None
        self.matched: Any = None  # vLLM's stop_reason: the stop string that ended the answer
        self.done = False

    def start(self) -> list[Event]:
        message = self.reply.message([], None, None)
        message["usage"] = {"input_tokens": 0, "output_tokens": 0}  # the whole usage comes at the end
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[Event]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        out = self._close()
        self.index += 1
        self.kind = str(block["type"])
        self.shown = self.shown or self.kind != "thinking"
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def chunk(self, obj: Mapping[str, Any]) -> list[Event]:
        """One chat completion chunk."""
        if self.done:
            return []
        if isinstance(obj.get("error"), Mapping) and "choices" not in obj:
            return self.fail(obj["error"])
        if isinstance(obj.get("usage"), Mapping):
            self.reply.usage = translate.usage(obj["usage"])
        out: list[Event] = []
        for choice in obj.get("choices") or []:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if isinstance(reasoning, str) and reasoning:
                if self.kind != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            content = delta.get("content")
            if isinstance(content, str) and content:
                out += self._text(content)
            for tc in delta.get("tool_calls") or []:
                if isinstance(tc, Mapping):
                    out += self._call(tc)
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
                self.matched = choice.get("stop_reason")
        return out

    def _text(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.kind != "text":
            if not (self.blank + text).strip():
                self.blank += text
                return []
            text, self.blank = self.blank + text, ""
            out += self._open({"type": "text", "text": ""})
        return [*out, self._delta({"type": "text_delta", "text": text})]

    def _call(self, tc: Mapping[str, Any]) -> list[Event]:
        fn = tc.get("function") or {}
        index = int(tc.get("index", 0))
        out: list[Event] = []
        if self.kind != "tool_use" or self.call_index != index:
            self.calls = True
            self.call_index = index
            call_id = str(tc.get("id") or translate.new_id("toolu"))
            out += self._open({"type": "tool_use", "id": call_id, "name": str(fn.get("name") or ""), "input": {}})
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def finish(self) -> list[Event]:
        """The end of the answer: the last block closed, the stop reason and usage, ``message_stop``."""
        out = self._close()
        if not self.shown:  # no text and no tool call: the (blank) text, as the whole message would show it
            out += self._open({"type": "text", "text": ""})
            if self.blank:
                out.append(self._delta({"type": "text_delta", "text": self.blank}))
            out += self._close()
        reason, sequence = translate.stop_reason(self.finish_reason, self.matched, self.reply.stops, self.calls)
        self.done = True
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        return [*out, {**delta, "usage": self.reply.usage}, {"type": "message_stop"}]

    def fail(self, error: Mapping[str, Any]) -> list[Event]:
        self.done = True
        return [anthropic_from_openai(error)]
