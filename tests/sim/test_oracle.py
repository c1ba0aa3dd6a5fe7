"""The KV-content oracle across real P, D and colocated sims: a correct reuse gives exactly the
colocated answer, and a reuse of blocks computed for other tokens gives a different one.

Each conversation turn is driven the way vLLM's multi-turn proxy (``disagg_proxy_multiturn.py``) drives it:
P gets the turn with ``max_tokens: 1`` and, from turn 2, D's previous handle flipped to
``do_remote_decode``; D gets the client's request with P's params.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sim.conftest import StartSims
from tests.sim.helpers import (
    Sim,
    answer,
    chat_body,
    decode_body,
    external_tokens,
    metric,
    next_turn,
    prefill_body,
    stream_answer,
)

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a careful travel agent."}
QUESTIONS = [
    "Plan a trip to the mountains",
    "Somewhere warmer?",
    "What should I pack?",
    "And the budget?",
    "Summarise the plan",
]


def pd_turn(
    p: Sim, d: Sim, client: dict[str, Any], handle: dict[str, Any] | None, *, stream: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One turn through P then D; D's answer as a body, and D's handle (non-streamed 0.26 or final chunk 0.33)."""
    p_params = p.chat(prefill_body(client, handle))["kv_transfer_params"]
    if stream:
        return stream_answer(d.chat_stream(decode_body(client, p_params)))
    body = d.chat(decode_body(client, p_params))
    return body, body["kv_transfer_params"]


def sequence(body: dict[str, Any]) -> list[int]:
    """The tokens whose KV D computed: its prompt and its answer but the last sampled token."""
    answer: list[int] = body["choices"][0]["token_ids"][:-1]
    return list(body["prompt_token_ids"]) + answer


@pytest.mark.parametrize(("compat", "stream"), [("0.26", False), ("0.33", True)])
def test_correct_bidirectional_reuse_gives_exactly_the_colocated_answer(
    sims: StartSims,
    compat: str,
    stream: bool,
) -> None:
    flags = ("--vllm-compat", compat)
    p, d, c = sims(
        ("p", "prefill", *flags, "--kv-recompute-threshold", "1"), ("d", "decode", *flags), ("c", "colocated", *flags)
    )
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    handle = None
    for turn, question in enumerate([*QUESTIONS[1:], None]):
        client = chat_body(messages, max_tokens=300)
        p_text = p.metrics()
        pulled, hits = external_tokens(p_text), metric(p_text, "vllm:prefix_cache_hits_total")
        body, new_handle = pd_turn(p, d, client, handle, stream=stream)
        truth = c.chat(client)
        assert answer(body) == answer(truth), f"turn {turn + 1}"
        assert body["choices"][0]["finish_reason"] == "stop"
        if handle is not None:
            # P pulled what D had and P's own cache lacked: min(remote_num_tokens, prompt) - local hit
            p_text = p.metrics()
            local = metric(p_text, "vllm:prefix_cache_hits_total") - hits
            n = len(body["prompt_token_ids"])
            assert external_tokens(p_text) - pulled == min(handle["remote_num_tokens"], n) - local > 0
        assert new_handle is not None and new_handle["remote_num_tokens"] == len(sequence(body))
        handle = new_handle
        if question is None:
            break
        messages = next_turn(messages, truth, question, reasoning_key=("reasoning", "reasoning_content")[turn % 2])
        # the reuse is correct because the next prompt extends D's sequence token for token
        assert p.render(messages)[: len(sequence(body))] == sequence(body)


def blind_reuse(p: Sim, d: Sim, c: Sim) -> tuple[list[int], list[int], dict[str, Any], list[dict[str, Any]]]:
    """Turn 1 through P/D, then turn 2 with D's handle whatever the new prompt is.

    Returns the turn-2 answers (blind reuse, colocated truth), turn 1's body and turn 2's messages.
    """
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    first, handle = pd_turn(p, d, chat_body(messages, max_tokens=300), None, stream=False)
    assert handle is not None
    messages2 = next_turn(messages, first, QUESTIONS[1])
    client2 = chat_body(messages2, max_tokens=300)
    pulled = external_tokens(p.metrics())
    blind, _ = pd_turn(p, d, client2, handle, stream=False)
    assert external_tokens(p.metrics()) > pulled  # D's blocks were really read
    return answer(blind)[0], answer(c.chat(client2))[0], first, messages2


def test_blind_reuse_after_strip_template_dropped_reasoning_gives_a_different_answer(sims: StartSims) -> None:
    strip = ("--template", "strip")
    p, d, c = sims(
        ("p", "prefill", *strip, "--kv-recompute-threshold", "1"), ("d", "decode", *strip), ("c", "colocated", *strip)
    )
    blind, truth, first, messages2 = blind_reuse(p, d, c)
    assert p.render(messages2)[: len(sequence(first))] != sequence(first)  # the template rewrote history
    assert blind != truth

    # the wrong blocks P pulled are now in its prefix cache (as in vLLM): even a fresh turn is wrong
    client2 = chat_body(messages2, max_tokens=300)
    assert answer(pd_turn(p, d, client2, None, stream=False)[0])[0] != truth
    for sim in (p, d):
        sim.faults(reset_prefix_cache=True)
    assert answer(pd_turn(p, d, client2, None, stream=False)[0])[0] == truth


def test_blind_reuse_across_retokenization_drift_gives_a_different_answer(sims: StartSims) -> None:
    drift = ("--retokenize-drift",)
    p, d, c = sims(
        ("p", "prefill", *drift, "--kv-recompute-threshold", "1"), ("d", "decode", *drift), ("c", "colocated", *drift)
    )
    blind, truth, first, messages2 = blind_reuse(p, d, c)
    rendered = p.render(messages2)
    seq = sequence(first)
    assert len(rendered) > len(seq) and rendered[: len(seq)] != seq  # the answer re-tokenized differently
    assert blind != truth


def test_keep_template_without_drift_extends_the_sequence_also_with_tool_calls(sims: StartSims) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    p, d, c = sims(("p", "prefill", "--kv-recompute-threshold", "1"), ("d", "decode"), ("c", "colocated"))
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    client = chat_body(messages, tools=tools, tool_choice="required")
    first, handle = pd_turn(p, d, client, None, stream=False)
    (call,) = first["choices"][0]["message"]["tool_calls"]
    messages2 = [
        *next_turn(messages, first, "unused")[:-1],
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 25 degrees"},
    ]
    assert p.render(messages2, tools=tools)[: len(sequence(first))] == sequence(first)
    client2 = chat_body(messages2, tools=tools)
    second, _ = pd_turn(p, d, client2, handle, stream=False)
    assert answer(second) == answer(c.chat(client2))
