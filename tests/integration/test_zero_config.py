"""Zero configuration: conversations found without an id, and /v1/responses, end to end.

Real processes on loopback (simulated P, D and a colocated engine as ground truth), the real openai
SDK as client, no X-Session-ID anywhere. Every answer is compared with the colocated engine's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from turnkv import launch
from turnkv.gateway.responses.translate import input_messages

from .cluster import Cluster, Dialogue, start_cluster

pytestmark = pytest.mark.integration
EVENT = TypeAdapter(ResponseStreamEvent)
REUSED = ("full", "partial", "decode_local")
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look something up",
        "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}},
    }
]
INSTRUCTIONS = "You are a helpful agent."


@pytest.fixture
def procs() -> Iterator[list[launch.Running]]:
    running: list[launch.Running] = []
    yield running
    for p in reversed(running):
        p.stop()


def test_chat_without_an_id_reuses_in_many_conversations_at_once(procs: list[launch.Running], tmp_path: Path) -> None:
    cluster = start_cluster(procs, tmp_path, compat="0.33")

    def conversation(i: int) -> list[Any]:
        with Dialogue(cluster, session=None, stream=i % 2 == 0, tools=True) as d:
            d.messages[1]["content"] = f"Plan a short trip, number {i}."
            return [d.step() for _ in range(4)]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(conversation, range(6)))
    for turns in results:
        assert all(t.correct for t in turns)
        assert all(t.headers["x-turnkv-conversation"] == "digest" for t in turns)
        assert turns[0].reason == "no_record"
        assert [t.outcome for t in turns[1:]] == ["full"] * 3, [t.reason for t in turns]
    events = cluster.turn_events(24)
    assert {e["conversation_source"] for e in events} == {"digest"}


@pytest.mark.parametrize(
    ("field", "value", "source"),
    [
        ("prompt_cache_key", "trip planning, user 7", "prompt_cache_key"),
        ("metadata", {"conversation_id": "conv 7"}, "metadata"),
    ],
)
def test_ids_clients_already_send_are_honoured(
    procs: list[launch.Running], tmp_path: Path, field: str, value: Any, source: str
) -> None:
    """The engines get these OpenAI fields too (vLLM ignores what it does not know)."""
    cluster = start_cluster(procs, tmp_path, compat="0.33")
    client = cluster.client()
    messages: list[Any] = [{"role": "user", "content": "Plan a short trip."}]
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=messages, max_tokens=60, extra_body={field: value}
        )
        assert raw.headers["x-turnkv-conversation"] == source
        assert raw.headers["x-turnkv-outcome"] == ("none" if turn == 0 else "full")
        m = raw.parse().choices[0].message.model_dump()
        messages += [
            {"role": "assistant", "content": m["content"], "reasoning": m.get("reasoning")},
            {"role": "user", "content": f"And step {turn}?"},
        ]


def test_forks_of_one_history_each_go_on(procs: list[launch.Running], tmp_path: Path) -> None:
    """Two clients continuing the same history look up the same record: one reuses it, the other
    recomputes, and each then goes on with its own history."""
    cluster = start_cluster(procs, tmp_path, compat="0.33")
    with Dialogue(cluster, session=None, tools=True) as a:
        a.step()
        a.step()
        with Dialogue(cluster, session=None, tools=True) as b:
            b.messages = [dict(m) for m in a.messages]
            a.messages.append({"role": "user", "content": "Go on with A."})
            b.messages.append({"role": "user", "content": "Go on with B."})
            first_a, first_b = a.step(), b.step()
            assert first_a.correct and first_b.correct
            assert first_a.outcome == "full" and (first_b.outcome, first_b.reason) == ("none", "no_record")
            next_a, next_b = a.step(), b.step()
            assert next_a.correct and next_b.correct
            assert next_a.outcome == next_b.outcome == "full"


def _truth_answer(cluster: Cluster, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with cluster.truth_client() as truth:
        r = truth.chat.completions.create(
            model="sim-model",
            messages=messages,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],  # type: ignore[typeddict-item]
            max_tokens=120,
        )
    m = r.choices[0].message.model_dump()
    out = {"role": "assistant", "content": m.get("content") or ""}
    if m.get("reasoning"):
        out["reasoning"] = m["reasoning"]
    if m.get("tool_calls"):
        out["tool_calls"] = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
    return out


def _as_compared(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ]
    return out


def _respond(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[Response, dict[str, str]]:
    if not stream:
        raw = client.responses.with_raw_response.create(
            model="sim-model", instructions=INSTRUCTIONS, tools=TOOLS, max_output_tokens=120, **kw
        )
        return raw.parse(), dict(raw.headers)
    with client.responses.with_streaming_response.create(
        model="sim-model", instructions=INSTRUCTIONS, tools=TOOLS, max_output_tokens=120, stream=True, **kw
    ) as raw:
        events = list(raw.parse())
        headers = dict(raw.headers)
    for e in events:
        EVENT.validate_python(e.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    return Response.model_validate(final.model_dump()), headers


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_responses_api_multi_turn_with_reuse(procs: list[launch.Running], tmp_path: Path, compat: str) -> None:
    """previous_response_id chains, and a client sending the whole input back (the Agents SDK's default),
    both reuse D's KV; answers are the colocated engine's. vLLM 0.26 streams carry no handle (without
    turnkv's plugin), so there the turns are not streamed."""
    cluster = start_cluster(procs, tmp_path, compat=compat)
    client = cluster.client()
    history: list[Any] = [{"role": "user", "content": "Plan a short trip."}]
    new_items = list(history)
    previous: str | None = None
    for turn in range(6):
        stream = compat == "0.33" and turn % 2 == 1
        chained = previous is not None and turn % 3 != 2  # every third turn sends the whole input instead
        r, headers = _respond(
            client,
            stream,
            input=new_items if chained else history,
            **({"previous_response_id": previous} if chained else {}),
        )
        truth = _truth_answer(cluster, [{"role": "system", "content": INSTRUCTIONS}, *input_messages(history)])
        assert [_as_compared(m) for m in input_messages([o.model_dump() for o in r.output])] == [truth]
        assert headers["x-turnkv-conversation"] == ("response" if chained else "digest")
        if turn > 0:
            assert headers["x-turnkv-outcome"] == "full", headers
        calls = [o for o in r.output if o.type == "function_call"]
        new_items = [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"result {turn}"} for c in calls
        ] or [{"role": "user", "content": f"And step {turn}?"}]
        history = [*history, *[o.model_dump(exclude_none=True) for o in r.output], *new_items]
        previous = r.id
    assert previous is not None
    assert client.responses.retrieve(previous).id == previous


def test_responses_are_kept_per_tenant_and_store_false_keeps_none(procs: list[launch.Running], tmp_path: Path) -> None:
    cluster = start_cluster(procs, tmp_path, compat="0.33")
    mine, theirs = cluster.client("key-a"), cluster.client("key-b")
    kept, _ = _respond(mine, False, input="Plan a short trip.")
    assert mine.responses.retrieve(kept.id).output_text == kept.output_text
    for other_tenants_call in (theirs.responses.retrieve, theirs.responses.delete, theirs.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            other_tenants_call(kept.id)
    assert mine.responses.retrieve(kept.id).id == kept.id  # another tenant's delete found nothing
    with pytest.raises(openai.BadRequestError) as e:
        _respond(theirs, False, input="more", previous_response_id=kept.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unkept, _ = _respond(mine, False, input="Plan a short trip.", store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unkept.id)
