"""Anthropic's Messages API through the gateway, driven by the real ``anthropic`` SDK: a tool conversation
whose answers are a colocated engine's and whose later turns reuse D's KV, Anthropic's stream events,
``count_tokens``, and every error in Anthropic's shape (the SDK raises its own typed exception for each).

In process: the whole gateway over the simulator-backed engines (``tests.pipeline.harness``), the SDK's
HTTP client on an ASGI transport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import pytest

from tests.pipeline.harness import D0, Gateway, gateway
from tests.sim_engine import MODEL
from turnkv.gateway.app import EXPOSED_HEADERS
from turnkv.gateway.messages import translate
from turnkv.gateway.messages.models import MessagesBody

SYSTEM = "You are a travel agent. Call the lookup tool for facts, keep answers short."
TOOLS: list[Any] = [
    {
        "name": "lookup",
        "description": "Look something up",
        "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}}},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "description": "Look something up", "parameters": TOOLS[0]["input_schema"]},
    }
]


def sdk(gw: Gateway, api_key: str = "key-a") -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=gw.app)
    http = httpx2.AsyncClient(transport=transport, base_url="http://gateway.test")
    return anthropic.AsyncAnthropic(api_key=api_key, base_url="http://gateway.test", http_client=http, max_retries=0)


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    async with gateway(conversation_from_history=True) as g:
        yield g


def _as_chat(content: list[Any]) -> dict[str, Any]:
    """An Anthropic answer as the chat message a client of chat completions would have got."""
    m: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in content if b.type == "text")}
    thinking = "".join(b.thinking for b in content if b.type == "thinking")
    if thinking:
        m["reasoning"] = thinking
    calls = [(b.name, b.input) for b in content if b.type == "tool_use"]
    if calls:
        m["tool_calls"] = calls
    return m


def _compared(truth: dict[str, Any]) -> dict[str, Any]:
    m = {"role": "assistant", "content": truth.get("content") or ""}
    if truth.get("reasoning"):
        m["reasoning"] = truth["reasoning"]
    if truth.get("tool_calls"):
        m["content"] = m["content"] if m["content"].strip() else ""
        m["tool_calls"] = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in truth["tool_calls"]]
    return m


async def _ask(client: anthropic.AsyncAnthropic, messages: list[Any], stream: bool) -> tuple[Any, Any, list[str]]:
    """One call: the Message, the response headers and (streamed) the event types in order."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 120, "system": SYSTEM, "tools": TOOLS, "messages": messages}
    if not stream:
        raw = await client.messages.with_raw_response.create(**kw)
        return await raw.parse(), raw.headers, []
    kinds: list[str] = []
    async with client.messages.stream(**kw) as s:
        async for event in s:
            kinds.append(event.type)
        return await s.get_final_message(), s.response.headers, kinds


async def test_a_five_turn_tool_conversation_answers_as_colocated_and_reuses_ds_kv(gw: Gateway) -> None:
    client = sdk(gw)
    messages: list[Any] = [{"role": "user", "content": "Plan two days in Lyon."}]
    chat: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan two days in Lyon."}]
    for turn in range(5):
        stream = turn % 2 == 1
        truth = gw.engine.truth({"messages": chat, "tools": CHAT_TOOLS, "max_tokens": 120})
        message, headers, kinds = await _ask(client, messages, stream)
        assert _as_chat(message.content) == _compared(truth), turn
        assert message.content[0].type == "thinking"
        assert headers["x-turnkv-conversation"] == "digest" and headers["request-id"]
        assert {h for h in headers if h.startswith("x-turnkv-")} <= set(EXPOSED_HEADERS)  # a browser sees them all
        assert (headers["x-turnkv-outcome"], headers["x-turnkv-reason"]) == (
            ("none", "no_record") if turn == 0 else ("full", "full_match")
        )
        if stream:
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == ("tool_use" if uses else "end_turn")
        assert message.usage.output_tokens > 0
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        chat.append(
            {
                "role": "assistant",
                "content": "".join(b.text for b in message.content if b.type == "text"),
                "reasoning": "".join(b.thinking for b in message.content if b.type == "thinking"),
                "tool_calls": [
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                    for b in uses
                ],
            }
        )
        if uses:
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"fact {turn}"} for b in uses]
            messages.append({"role": "user", "content": results})
            chat += [{"role": "tool", "tool_call_id": b.id, "content": f"fact {turn}"} for b in uses]
        else:
            messages.append({"role": "user", "content": f"And step {turn}?"})
            chat.append({"role": "user", "content": f"And step {turn}?"})
    assert any(b["type"] == "tool_use" for m in messages for b in m["content"] if isinstance(b, dict))


async def test_count_tokens_is_the_rendered_prompt(gw: Gateway) -> None:
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Plan two days in Lyon."}]}]
    counted = await sdk(gw).messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS, messages=messages)
    body = translate.chat_body(MessagesBody.model_validate({"model": MODEL, "max_tokens": 1, "messages": messages}))
    rendered = gw.engine.tok.encode(
        gw.engine.template.render([{"role": "system", "content": SYSTEM}, *body["messages"]], tools=CHAT_TOOLS)
    )
    assert counted.input_tokens == len(rendered)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "messages.0.content.0.tool_use_id",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
        "messages.0.content.0.input",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
    ({"metadata": {"conversation_id": 7}}, "metadata.conversation_id"),
]


async def test_bad_requests_are_anthropic_400s_naming_the_field(gw: Gateway) -> None:
    client = sdk(gw)
    for over, param in BAD:
        body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **over}
        body = {k: v for k, v in body.items() if v is not None}
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.post("/v1/messages", body=body, cast_to=httpx2.Response)
        error = e.value.body["error"]  # type: ignore[index]
        assert e.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": error["message"]},
        }
        assert error["message"].startswith(param + ":"), (over, error)
    assert gw.engine[D0].calls == []  # refused before any engine work


async def test_errors_of_the_edge_the_store_of_models_and_the_engines_are_anthropic_shaped(gw: Gateway) -> None:
    client = sdk(gw)
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="not-served", max_tokens=10, messages=hi)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError) as batches:
        await client.post("/v1/messages/batches", body={}, cast_to=httpx2.Response)
    assert batches.value.status_code == 501 and batches.value.body["type"] == "error"  # type: ignore[index]
    # a refusal by the engine keeps the engine's words (this model takes no images)
    image: Any = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(model=MODEL, max_tokens=10, messages=[image])
    assert refused.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error",
        "message": "only text content parts are supported by this model",
    }


async def test_api_keys_are_read_from_x_api_key() -> None:
    async with gateway(conversation_from_history=True, api_keys=["right"]) as g:
        answer = await sdk(g, "right").messages.create(
            model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.role == "assistant"
        with pytest.raises(anthropic.AuthenticationError) as e:
            await sdk(g, "wrong").messages.create(
                model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi"}]
            )
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_a_stream_that_fails_after_its_first_event_ends_with_anthropics_error_event(gw: Gateway) -> None:
    gw.engine.faults(D0, drop=2, drop_after=3)  # the turn and its rerun through P: both cut mid-way
    with pytest.raises(anthropic.APIStatusError) as e:
        async with sdk(gw).messages.stream(
            model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Plan two days in Lyon."}]
        ) as s:
            async for _ in s:
                pass
    assert e.value.body["type"] == "error"  # type: ignore[index]
    assert e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
