"""Conversations found without an id: precedence of the ids clients send, and the history digest."""

from __future__ import annotations

from typing import Any

import pytest

from turnkv.errors import ClientError
from turnkv.gateway.identity import Conversation, conversation_of, history_keys

OPTS: dict[str, Any] = {"session_headers": ["x-session-id"], "max_length": 64}
SYSTEM = {"role": "system", "content": "You are an agent."}
USER = {"role": "user", "content": "Plan a trip."}
CALL: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "reasoning": "I should look it up",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"place": "Lyon", "days": 2}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "Lyon: open daily"}


def conv(headers: dict[str, str], body: dict[str, Any], **kw: Any) -> Conversation | None:
    tenant = kw.pop("tenant", headers.get("authorization", "anonymous"))  # as auth.py names it: per key
    return conversation_of(headers, body, tenant=tenant, **{**OPTS, **kw})


@pytest.mark.parametrize(
    ("headers", "body", "kw", "source", "session"),
    [
        ({"x-session-id": "h"}, {"session_id": "b", "prompt_cache_key": "p"}, {"response_key": "r"}, "header", "h"),
        ({}, {"conversation_id": "b", "prompt_cache_key": "p"}, {"response_key": "r"}, "body", "b"),
        ({}, {"prompt_cache_key": "p", "metadata": {"conversation_id": "m"}}, {"response_key": "r"}, "response", "r"),
        ({}, {"prompt_cache_key": "p", "metadata": {"conversation_id": "m"}}, {}, "prompt_cache_key", "p"),
        ({}, {"metadata": {"session_id": "s", "conversation_id": "m"}}, {}, "metadata", "m"),
        ({}, {"metadata": {"session_id": "s"}}, {}, "metadata", "s"),
        ({}, {"prompt_cache_key": "", "metadata": {"other": "x"}}, {}, "digest", None),
    ],
)
def test_precedence(
    headers: dict[str, str], body: dict[str, Any], kw: dict[str, Any], source: str, session: str | None
) -> None:
    c = conv(headers, {"messages": [SYSTEM, USER], **body}, **kw)
    assert c is not None and c.source == source
    if session is not None:
        assert c.session == session


def test_named_conversations_store_where_they_claim() -> None:
    c = conv({}, {"messages": [USER], "prompt_cache_key": "a key with spaces, which OpenAI allows"})
    assert c is not None and c.store_key == c.key


def test_a_previous_response_claims_its_key_and_stores_under_the_request_digest() -> None:
    c = conv({}, {}, messages=[USER, CALL, RESULT], response_key="stored-key")
    assert c is not None and c.key == "stored-key"
    assert c.store_key == history_keys(c.tenant, [USER, CALL, RESULT])[1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"metadata": "conv-1"}, "metadata"),
        ({"metadata": {"conversation_id": 7}}, "metadata.conversation_id"),
    ],
)
def test_wrong_types_are_client_errors(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ClientError) as e:
        conv({}, {"messages": [USER], **body})
    assert e.value.param == param


def test_no_messages_or_detection_off_is_stateless() -> None:
    assert conv({}, {}) is None
    assert conv({}, {"messages": [USER]}, from_history=False) is None


def test_the_next_request_finds_what_this_one_stored() -> None:
    first = conv({}, {"messages": [SYSTEM, USER]})
    second = conv({}, {"messages": [SYSTEM, USER, CALL, RESULT]})
    assert first is not None and second is not None and first.source == second.source == "digest"
    assert second.key == first.store_key
    assert second.store_key not in (second.key, first.key)


@pytest.mark.parametrize(
    "echo",
    [
        {
            "role": "assistant",
            "content": None,  # reasoning dropped, new ids, arguments re-serialized
            "tool_calls": [
                {
                    "id": "other",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"days":2,"place":"Lyon"}'},
                }
            ],
        },
        {"role": "assistant", "content": "Calling tools:\n[{'name': 'lookup'}]"},  # smolagents: calls as text
        {"role": "assistant", "content": [{"type": "text", "text": "anything"}], "reasoning_content": "x"},
    ],
)
def test_the_answer_as_the_client_echoes_it_does_not_matter(echo: dict[str, Any]) -> None:
    """The key is the request the answer was for; the token check judges the answer."""
    before = conv({}, {"messages": [SYSTEM, USER]})
    after = conv({}, {"messages": [SYSTEM, USER, echo, RESULT]})
    assert before is not None and after is not None and after.key == before.store_key


def test_history_is_normalized_for_how_frameworks_echo_it() -> None:
    as_sent = [SYSTEM, USER, CALL, RESULT, {"role": "assistant", "content": "done"}]
    echoed = [
        {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]},  # parts, not a string
        {"role": "user", "content": " Plan a trip.\n", "name": "alice"},  # whitespace, a name
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [  # no reasoning, other ids, other JSON layout
                {
                    "id": "x9",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": {"days": 2, "place": "Lyon"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "x9", "content": "Lyon: open daily"},
        {"role": "assistant", "content": "done"},
    ]
    assert history_keys("t", as_sent) == history_keys("t", echoed)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m[1].update(content="Plan a longer trip."),
        lambda m: m[2]["tool_calls"][0]["function"].update(arguments='{"place": "Paris", "days": 2}'),
        lambda m: m[2]["tool_calls"][0]["function"].update(name="search"),
        lambda m: m[3].update(content="Lyon: closed"),
        lambda m: m[0].update(role="user"),
    ],
)
def test_a_changed_history_is_another_conversation(change: Any) -> None:
    msgs = [
        dict(SYSTEM),
        dict(USER),
        {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": dict(CALL["tool_calls"][0]["function"])}]},
        dict(RESULT),
    ]
    before = history_keys("t", msgs)
    change(msgs)
    assert history_keys("t", msgs)[1] != before[1]


def test_tenants_never_share_a_digest() -> None:
    a = conv({"authorization": "Bearer k1"}, {"messages": [SYSTEM, USER, CALL, RESULT]})
    b = conv({"authorization": "Bearer k2"}, {"messages": [SYSTEM, USER, CALL, RESULT]})
    assert a is not None and b is not None and a.tenant != b.tenant
    assert a.key != b.key and a.store_key != b.store_key


def test_forks_claim_the_same_key_and_store_apart() -> None:
    a = conv({}, {"messages": [SYSTEM, USER, CALL, RESULT, {"role": "user", "content": "go on"}]})
    b = conv({}, {"messages": [SYSTEM, USER, CALL, RESULT, {"role": "user", "content": "stop"}]})
    assert a is not None and b is not None
    assert a.key == b.key and a.store_key != b.store_key


def test_a_first_turn_claims_a_key_nothing_is_stored_under() -> None:
    tenant = "t"
    first_claim = history_keys(tenant, [SYSTEM, USER])[0]
    stored = {history_keys(tenant, m)[1] for m in ([SYSTEM], [USER], [SYSTEM, USER], [CALL], [SYSTEM, USER, CALL])}
    assert first_claim not in stored
