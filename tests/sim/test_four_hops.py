"""The KV-content oracle on four hops: render, tokens-only P, tokens-only D, derender, as real processes.

A correct bidirectional reuse through ``/inference/v1/generate`` gives exactly the colocated engine's
answer on every turn, with either KV-param placement; a reuse of D's blocks for a prompt that does not
extend D's sequence (a template that dropped the reasoning) gives a different one; and a streamed
generate hands D's handle back only with turnkv's plugin.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import StartSims
from tests.sim.four_hops import FourHops, Turn, generate_stream, prefill_request, with_kv
from tests.sim.helpers import Sim, chat_body, external_tokens

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a careful travel agent."}
QUESTIONS = ["Plan a trip to the mountains", "Somewhere warmer?", "What should I pack?", "And the budget?"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def truth_of(c: Sim, client: dict[str, Any]) -> dict[str, Any]:
    return dict(c.chat({**client, "return_token_ids": True})["choices"][0])


def same_answer(turn: Turn, truth: dict[str, Any]) -> None:
    msg = truth["message"]
    assert turn.output_ids == truth["token_ids"]
    assert (turn.message["content"], turn.message["reasoning"]) == (msg["content"], msg["reasoning"])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in turn.message.get("tool_calls") or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


def next_messages(messages: list[dict[str, Any]], turn: Turn, question: str) -> list[dict[str, Any]]:
    m = turn.message
    assistant: dict[str, Any] = {"role": "assistant", "content": m["content"], "reasoning": m["reasoning"]}
    if m.get("tool_calls"):
        assistant["tool_calls"] = m["tool_calls"]
        call = m["tool_calls"][0]
        return [*messages, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 25 degrees"}]
    return [*messages, assistant, {"role": "user", "content": question}]


@pytest.mark.parametrize(("compat", "stream"), [("0.26", False), ("0.33", False), ("0.26", True), ("0.33", True)])
def test_correct_reuse_on_four_hops_gives_exactly_the_colocated_answer(
    sims: StartSims, compat: str, stream: bool
) -> None:
    flags = ("--vllm-compat", compat)
    plugin = ("--turnkv-plugin",) if stream else ()
    r, p, d, c = sims(
        ("r", "render", *flags),
        ("p", "prefill", *flags, "--tokens-only", "--kv-recompute-threshold", "1"),
        ("d", "decode", *flags, "--tokens-only", *plugin),
        ("c", "colocated", *flags),
    )
    hops = FourHops(r, p, d, compat)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    handle = None
    for n, question in enumerate([*QUESTIONS[1:], None]):
        client = chat_body(messages, max_tokens=300, tools=TOOLS)
        pulled = external_tokens(p.metrics())
        turn = hops.turn(client, handle, stream=stream)
        same_answer(turn, truth_of(c, client))
        if handle is not None:
            assert external_tokens(p.metrics()) > pulled, f"turn {n + 1} pulled nothing from D"
        assert turn.handle is not None and turn.handle["remote_num_tokens"] == len(turn.sequence)
        handle = turn.handle
        if question is None:
            break
        messages = next_messages(messages, turn, question)
        # render's ids are the truth: the next prompt extends D's sequence token for token
        assert r.render(messages, tools=TOOLS)[: len(turn.sequence)] == turn.sequence


def test_blind_reuse_after_the_template_dropped_reasoning_gives_a_different_answer(sims: StartSims) -> None:
    strip = ("--template", "strip")
    r, p, d, c = sims(
        ("r", "render", *strip),
        ("p", "prefill", *strip, "--tokens-only", "--kv-recompute-threshold", "1"),
        ("d", "decode", *strip, "--tokens-only"),
        ("c", "colocated", *strip),
    )
    hops = FourHops(r, p, d, "0.26")
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    first = hops.turn(chat_body(messages, max_tokens=300), None)
    messages2 = next_messages(messages, first, QUESTIONS[1])
    assert r.render(messages2)[: len(first.sequence)] != first.sequence  # the template rewrote history
    client2 = chat_body(messages2, max_tokens=300)
    pulled = external_tokens(p.metrics())
    blind = hops.turn(client2, first.handle)
    assert external_tokens(p.metrics()) > pulled  # D's blocks were really read
    truth = truth_of(c, client2)
    assert blind.output_ids != truth["token_ids"]


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
def test_params_where_the_version_does_not_read_them_are_ignored(sims: StartSims, compat: str) -> None:
    """0.26 reads KV params on generate only inside ``extra_args``; a top-level ``do_remote_decode`` there
    is a plain request (no handle back). 0.33 reads both, the top level winning."""
    flags = ("--vllm-compat", compat)
    r, p = sims(("r", "render", *flags), ("p", "prefill", *flags, "--tokens-only"))
    gen = r.post("/v1/chat/completions/render", chat_body([{"role": "user", "content": "Hi"}])).json()
    top = {**prefill_request(gen, None, "0.33"), "kv_transfer_params": {"do_remote_decode": True}}
    got = p.post("/inference/v1/generate", top).json()["kv_transfer_params"]
    assert (got is None) == (compat == "0.26")
    nested = prefill_request(gen, None, "0.26")
    assert p.post("/inference/v1/generate", nested).json()["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize("plugin", [False, True])
def test_a_streamed_generate_carries_d_handle_only_with_the_plugin(sims: StartSims, plugin: bool) -> None:
    r, p, d = sims(
        ("r", "render"),
        ("p", "prefill", "--tokens-only"),
        ("d", "decode", "--tokens-only", *(("--turnkv-plugin",) if plugin else ())),
    )
    gen = r.post("/v1/chat/completions/render", chat_body([{"role": "user", "content": "Hi"}])).json()
    p_params = p.post("/inference/v1/generate", prefill_request(gen, None, "0.26")).json()["kv_transfer_params"]
    chunks = generate_stream(d.http, d.url, with_kv(gen, p_params, "0.26"))
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "stop"
    if plugin:
        assert final["kv_transfer_params"]["do_remote_decode"] is True
        assert all(c["kv_transfer_params"] is None for c in chunks[:-1])
        assert d.http.get(d.url + "/version").headers["x-turnkv-plugin"] == "sim; streams=generate"
    else:
        assert all("kv_transfer_params" not in c for c in chunks)
        assert "x-turnkv-plugin" not in d.http.get(d.url + "/version").headers
    # D pins its blocks either way: without the handle nobody can use or free them before their TTL
    assert d.state()["pins"] == 1
