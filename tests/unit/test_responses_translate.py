"""Responses <-> chat translation, and the stream events, held against the official openai SDK's types."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from turnkv.gateway.responses import events, translate
from turnkv.gateway.responses.models import parse

EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look up",
        "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}},
    }
]
CHAT_ANSWER = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning": "I need facts.",
    "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": '{"topic": "Lyon"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "lookup", "arguments": '{"topic": "Paris"}'}},
    ],
}


def test_output_items_echoed_as_input_are_the_message_the_engine_produced() -> None:
    items = translate.output_items(CHAT_ANSWER, "tool_calls")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert translate.input_messages(items) == [CHAT_ANSWER]


def test_an_agent_history_becomes_chat_messages() -> None:
    answer = translate.output_items(CHAT_ANSWER, "tool_calls")
    history: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Plan a trip."}]},
        *answer,
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
        *translate.output_items({"role": "assistant", "content": "Go to Lyon.", "reasoning": "Sun wins."}, "stop"),
        {"type": "message", "role": "user", "content": "Thanks."},
    ]
    assert translate.input_messages(history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Plan a trip."},
        CHAT_ANSWER,
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "assistant", "content": "Go to Lyon.", "reasoning": "Sun wins."},
        {"role": "user", "content": "Thanks."},
    ]


def test_two_answers_in_a_row_stay_two_messages() -> None:
    a = translate.output_items({"role": "assistant", "content": "one", "reasoning": "r1"}, "stop")
    b = translate.output_items({"role": "assistant", "content": "two", "reasoning": "r2"}, "stop")
    msgs = translate.input_messages([*a, *b])
    assert [m["content"] for m in msgs] == ["one", "two"]


def test_chat_body() -> None:
    raw = {
        "model": "m",
        "input": "hi",
        "instructions": "Be brief.",
        "tools": TOOLS,
        "max_output_tokens": 50,
        "tool_choice": {"type": "function", "name": "lookup"},
        "reasoning": {"effort": "low"},
        "stream": True,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "store": False,
        "metadata": {"k": "v"},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    body = translate.chat_body(parse(raw), raw, translate.input_messages("hi"))
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "lookup", "description": "Look up", "parameters": TOOLS[0]["parameters"]},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "max_tokens": 50,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }


def test_response_object_is_an_sdk_response() -> None:
    req = parse({"model": "m", "input": "hi", "tools": TOOLS})
    usage = translate.usage(
        {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}
    )
    r = translate.response_object(
        "resp_1",
        req,
        output=translate.output_items(CHAT_ANSWER, "tool_calls"),
        status="completed",
        created_at=1.0,
        usage=usage,
    )
    parsed = Response.model_validate(r)
    assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == 8
    assert [o.type for o in parsed.output] == ["reasoning", "message", "function_call", "function_call"]
    assert parsed.output_text == "Let me check."


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "model": "sim", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def stream_of(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    s = events.EventStream("resp_1", parse({"model": "m", "input": "hi", "tools": TOOLS}))
    out = s.start()
    for c in chunks:
        out += s.chunk(c)
    last, r = s.finish()
    return out + last, r


TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning": "I need "}),
    chunk({"reasoning": "facts."}),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"topic": '},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Lyon"}'}}]}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"topic": "Paris"}'},
                }
            ]
        }
    ),
    chunk({}, "tool_calls"),
    {"id": "c", "model": "sim", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20}},
]


def test_stream_events_are_the_sdk_events_in_order() -> None:
    evs, r = stream_of(TOOL_STREAM)
    for e in evs:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = Response.model_validate(r)
    assert done.usage is not None and done.usage.total_tokens == 30
    # the streamed response is the same answer as the chat one, and goes back into history as it
    assert translate.input_messages(r["output"]) == [CHAT_ANSWER]
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]


@pytest.mark.parametrize(("finish", "status"), [("length", "incomplete"), ("stop", "completed")])
def test_stream_ends_by_finish_reason(finish: str, status: str) -> None:
    evs, r = stream_of([chunk({"content": "a"}), chunk({}, finish)])
    assert evs[-1]["type"] == f"response.{status}" and r["status"] == status
    EVENT.validate_python(evs[-1])


def test_a_failed_decode_ends_the_stream_as_failed() -> None:
    s = events.EventStream("resp_1", parse({"model": "m", "input": "hi"}))
    evs = s.start() + s.chunk(chunk({"content": "a"})) + s.chunk({"error": {"message": "decode broke"}})
    assert evs[-1]["type"] == "response.failed"
    assert evs[-1]["response"]["error"]["message"] == "decode broke"
    EVENT.validate_python(evs[-1])
    assert s.chunk(chunk({"content": "late"})) == []


def test_newlines_before_a_tool_call_open_no_message() -> None:
    call = {
        "tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        ]
    }
    evs, r = stream_of([chunk({"reasoning": "r"}), chunk({"content": "\n\n"}), chunk(call), chunk({}, "tool_calls")])
    assert [i["type"] for i in r["output"]] == ["reasoning", "function_call"]
    whole = translate.output_items(
        {
            "role": "assistant",
            "content": "\n\n",
            "reasoning": "r",
            "tool_calls": [{"id": "call_a", "function": {"name": "lookup", "arguments": "{}"}}],
        },
        "tool_calls",
    )
    assert [i["type"] for i in whole] == ["reasoning", "function_call"]
    _, only_blank = stream_of([chunk({"content": "\n"}), chunk({}, "stop")])
    assert [i["type"] for i in only_blank["output"]] == ["message"]
