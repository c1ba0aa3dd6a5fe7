"""Messages API <-> chat completions, as tables: the chat request each Messages request becomes, the content
blocks each chat answer becomes, and Anthropic's stream events adding up to the same blocks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnkv.gateway.messages import events, translate
from turnkv.gateway.messages.models import MessagesBody


def chat_of(**req: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 50, **req}
    return translate.chat_body(MessagesBody.model_validate(body))


USE = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"topic": "Lyon"}}
CALL = {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"topic": "Lyon"}'}}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}]),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "user", "content": "hi"}]),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}] * 2}],
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "a"}]}],
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                        {"type": "text", "text": "what is it?"},
                    ],
                }
            ],
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                        {"type": "text", "text": "what is it?"},
                    ],
                }
            ],
        ),
        (
            [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I should look.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "x"},
                        {"type": "text", "text": "Looking."},
                        USE,
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "ok"}]},
                        {"type": "text", "text": "and then?"},
                    ],
                },
            ],
            [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "Looking.", "reasoning": "I should look.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "ok"},
                {"role": "user", "content": "and then?"},
            ],
        ),
        (
            [
                {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
            ],
            [
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
            ],
        ),
    ],
)
def test_messages_become_the_chat_messages_the_engine_produced_and_reads(
    messages: list[Any], expected: list[Any]
) -> None:
    assert chat_of(messages=messages)["messages"] == expected


def test_request_settings_become_chat_settings() -> None:
    body = chat_of(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stop_sequences=["END"],
        temperature=0.2,
        top_p=0.9,
        top_k=5,
        tools=[{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        metadata={"user_id": "u"},
    )
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}, "description": "d"}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["END"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
    }
    named = chat_of(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "tool", "name": "lookup"})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}


def test_a_prefilled_answer_is_continued() -> None:
    body = chat_of(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}])
    assert body["messages"][-1] == {"role": "assistant", "content": "Well,"}
    assert body["add_generation_prompt"] is False and body["continue_final_message"] is True


@pytest.mark.parametrize(
    ("message", "blocks"),
    [
        ({"content": "Hello."}, [{"type": "text", "text": "Hello."}]),
        ({"content": None}, [{"type": "text", "text": ""}]),
        (
            {"content": "\n\n", "reasoning": "hmm", "tool_calls": [CALL]},
            [{"type": "thinking", "thinking": "hmm", "signature": ""}, USE],
        ),
        (
            {"content": "Let me look.", "tool_calls": [CALL]},
            [{"type": "text", "text": "Let me look."}, USE],
        ),
        (
            {"content": "", "tool_calls": [{**CALL, "function": {"name": "lookup", "arguments": "not json"}}]},
            [{**USE, "input": {"arguments": "not json"}}],
        ),
    ],
)
def test_answers_become_content_blocks(message: dict[str, Any], blocks: list[Any]) -> None:
    assert translate.content_blocks({"role": "assistant", **message}) == blocks


@pytest.mark.parametrize(
    ("finish", "matched", "calls", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("length", None, False, ("max_tokens", None)),
        ("tool_calls", None, True, ("tool_use", None)),
        ("stop", "END", False, ("stop_sequence", "END")),
        ("stop", 151645, False, ("end_turn", None)),  # a stop token id, not one of the client's sequences
        ("content_filter", None, False, ("refusal", None)),
    ],
)
def test_stop_reasons(finish: str, matched: Any, calls: bool, expected: tuple[str, str | None]) -> None:
    assert translate.stop_reason(finish, matched, ["END"], calls) == expected


def _chunks(message: dict[str, Any], finish: str) -> list[dict[str, Any]]:
    """A chat answer as a stream sends it: a few characters per chunk, tool calls by index."""
    out: list[dict[str, Any]] = []
    for key in ("reasoning", "content"):
        text = message.get(key) or ""
        out += [{"choices": [{"index": 0, "delta": {key: text[i : i + 3]}}]} for i in range(0, len(text), 3)]
    for i, c in enumerate(message.get("tool_calls") or []):
        head = {"index": i, "id": c["id"], "function": {"name": c["function"]["name"]}}
        out.append({"choices": [{"index": 0, "delta": {"tool_calls": [head]}}]})
        args = c["function"]["arguments"]
        for j in range(0, len(args), 4):
            part = {"index": i, "function": {"arguments": args[j : j + 4]}}
            out.append({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    out.append({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 9}})
    return out


def _blocks_of(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content a client assembles from Anthropic's events."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for e in evs:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text)
    return blocks


@pytest.mark.parametrize(
    ("message", "finish"),
    [
        ({"content": "Hello there."}, "stop"),
        ({"content": ""}, "stop"),
        (
            {"reasoning": "Think first.", "content": "\n\n", "tool_calls": [CALL, {**CALL, "id": "toolu_2"}]},
            "tool_calls",
        ),
        ({"reasoning": "Hmm.", "content": "Sure: let me look.", "tool_calls": [CALL]}, "tool_calls"),
    ],
)
def test_stream_events_add_up_to_the_whole_messages_blocks(message: dict[str, Any], finish: str) -> None:
    stream = events.MessageStream(translate.Reply("msg_1", "m"))
    evs = stream.start()
    for chunk in _chunks(message, finish):
        evs += stream.chunk(chunk)
    evs += stream.finish()
    kinds = [e["type"] for e in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    assert _blocks_of(evs) == translate.content_blocks({"role": "assistant", **message})
    delta = evs[-2]
    assert (
        delta["delta"]["stop_reason"] == translate.stop_reason(finish, None, None, bool(message.get("tool_calls")))[0]
    )
    assert delta["usage"] == {
        "input_tokens": 30,
        "output_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def test_a_failed_stream_ends_with_anthropics_error_event() -> None:
    stream = events.MessageStream(translate.Reply("msg_1", "m"))
    stream.chunk({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    failed = stream.chunk({"error": {"message": "decode failed", "type": "upstream_error", "code": None}})
    assert failed == [{"type": "error", "error": {"type": "api_error", "message": "decode failed"}}]
    overloaded = events.MessageStream(translate.Reply("msg_2", "m"))
    error = {"message": "shutting down", "type": "server_error", "code": "shutting_down"}
    assert overloaded.chunk({"error": error})[0]["error"]["type"] == "overloaded_error"
