"""What agents do, end to end with their real client libraries and no conversation id: the Anthropic
Messages API (the ``anthropic`` SDK) over real sockets.

One cluster for the module (simulated vLLM 0.33 P, D and a colocated engine as ground truth, Redis, the
gateway), each test's conversations its own; every answer is compared with the colocated engine's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from turnkv import launch
from turnkv.bench.redis_server import RedisServer

from .cluster import Cluster, start_cluster

pytestmark = pytest.mark.integration
SYSTEM = "You are a travel agent. Call the lookup tool for facts, keep answers short."
TOOLS: list[Any] = [
    {
        "name": "lookup",
        "description": "Look something up",
        "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Cluster]:
    procs: list[launch.Running] = []
    try:
        yield start_cluster(procs, tmp_path_factory.mktemp("agents"), compat="0.33", redis_url=redis_server.url)
    finally:
        for p in reversed(procs):
            p.stop()


def _truth(cluster: Cluster, chat: list[Any]) -> dict[str, Any]:
    """The colocated engine's answer to the same history on chat completions."""
    tool = TOOLS[0]
    fn = {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}
    tools: Any = [{"type": "function", "function": fn}]
    with cluster.truth_client() as truth:
        m = (
            truth.chat.completions.create(model="sim-model", messages=chat, tools=tools, max_tokens=120)
            .choices[0]
            .message.model_dump()
        )
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
    return {
        "reasoning": m.get("reasoning") or "",
        "text": (m.get("content") or "") if not calls else "",
        "calls": calls,
    }


def _seen(content: list[Any]) -> dict[str, Any]:
    calls = [(b.name, b.input) for b in content if b.type == "tool_use"]
    text = "".join(b.text for b in content if b.type == "text")
    return {"reasoning": "".join(b.thinking for b in content if b.type == "thinking"), "text": text, "calls": calls}


def test_the_anthropic_sdk_runs_a_streamed_tool_conversation_that_reuses_ds_kv(cluster: Cluster) -> None:
    client = anthropic.Anthropic(api_key="key-a", base_url=cluster.gateway.url, max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": "Plan two days in Lyon."}]
    chat: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Plan two days in Lyon."}]
    outcomes = []
    for turn in range(5):
        with client.messages.stream(
            model="sim-model", max_tokens=120, system=SYSTEM, tools=TOOLS, messages=messages
        ) as s:
            message = s.get_final_message()
            headers = s.response.headers
        seen = _seen(message.content)
        expected = _truth(cluster, chat)
        if seen["calls"]:
            seen["text"] = ""  # the text before a tool call: not compared (a template's blank lines)
        assert seen == expected, turn
        outcomes.append((headers["x-turnkv-outcome"], headers["x-turnkv-conversation"]))
        uses = [b for b in message.content if b.type == "tool_use"]
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        chat.append(
            {
                "role": "assistant",
                "content": "".join(b.text for b in message.content if b.type == "text"),
                "reasoning": seen["reasoning"],
                "tool_calls": [
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                    for b in uses
                ],
            }
        )
        if uses:
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "9-18"} for b in uses],
                }
            )
            chat += [{"role": "tool", "tool_call_id": b.id, "content": "9-18"} for b in uses]
        else:
            messages.append({"role": "user", "content": f"And step {turn}?"})
            chat.append({"role": "user", "content": f"And step {turn}?"})
    assert outcomes == [("none", "digest")] + [("full", "digest")] * 4
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="sim-model", max_tokens=100_000, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_a_request_d_refuses_after_p_pulled_keeps_the_record_for_its_resend(cluster: Cluster) -> None:
    """Under always-pull P pulls D's KV before D sees the request; D then refuses it (min_tokens above
    max_tokens: P got neither). The resend still finds the conversation's record."""
    client = cluster.client()
    messages: list[Any] = [{"role": "user", "content": "Plan a weekend in Porto."}]
    first = client.chat.completions.create(model="sim-model", messages=messages, max_tokens=60)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And Sunday?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="sim-model", messages=messages, max_tokens=10, extra_body={"min_tokens": 50}
        )
    assert "min_tokens" in refused.value.message  # the engine's words, the client's numbers
    raw = client.chat.completions.with_raw_response.create(model="sim-model", messages=messages, max_tokens=60)
    assert (raw.headers["x-turnkv-outcome"], raw.headers["x-turnkv-reason"]) == ("none", "handle_spent")


def test_a_prompt_too_long_for_the_model_is_refused_with_the_clients_own_numbers(cluster: Cluster) -> None:
    """P refuses the one-token prefill turnkv sends it; the client hears the engine's reason with the output
    length it asked for, on chat completions and on the Messages API (in each API's shape)."""
    long = "lorem ipsum dolor sit amet " * 1600  # 43,200 tokens: past the model's 40,960
    with pytest.raises(openai.BadRequestError) as chat:
        cluster.client().chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": long}], max_tokens=60
        )
    said = chat.value.message
    assert "maximum context length is 40960 tokens" in said and "you requested 60 output tokens" in said, said
    client = anthropic.Anthropic(api_key="key-a", base_url=cluster.gateway.url, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as messages:
        client.messages.create(model="sim-model", max_tokens=70, messages=[{"role": "user", "content": long}])
    error = messages.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and "you requested 70 output tokens" in error["message"]
