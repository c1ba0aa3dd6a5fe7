"""Conversation identity and tenant scoping."""

from __future__ import annotations

import pytest

from turnkv.errors import ClientError
from turnkv.gateway.identity import conversation_of
from turnkv.openai.answer import answer_digest, echoed_answer

OPTS = {"session_headers": ["x-session-id", "x-agent-session"], "tenant": "anonymous", "max_length": 64}


def conv(headers: dict[str, str], body: dict[str, object], **opts: object) -> str | None:
    c = conversation_of(headers, body, **{**OPTS, **opts})  # type: ignore[arg-type]
    return None if c is None else c.session


@pytest.mark.parametrize(
    ("headers", "body", "session"),
    [
        ({}, {}, None),
        ({"x-session-id": "a"}, {"session_id": "b"}, "a"),
        ({"x-agent-session": "c"}, {}, "c"),
        ({}, {"session_id": "b", "conversation_id": "d"}, "b"),
        ({}, {"conversation_id": "d"}, "d"),
    ],
)
def test_where_the_id_comes_from(headers: dict[str, str], body: dict[str, object], session: str | None) -> None:
    assert conv(headers, body) == session


@pytest.mark.parametrize("bad", ["a b", "x" * 65, "semi;colon", "ünï", "a\n", "a\r\n", "\na"])
def test_bad_ids_are_client_errors(bad: str) -> None:
    with pytest.raises(ClientError):
        conv({"x-session-id": bad}, {})


@pytest.mark.parametrize("bad", [42, "", ["a"]])
def test_bad_body_ids(bad: object) -> None:
    with pytest.raises(ClientError):
        conv({}, {"session_id": bad})


def test_an_empty_header_names_no_conversation() -> None:
    assert conv({"x-session-id": ""}, {}) is None


def test_same_id_different_tenants_gets_different_keys() -> None:
    a = conversation_of({"x-session-id": "s"}, {}, **{**OPTS, "tenant": "k:1"})  # type: ignore[arg-type]
    b = conversation_of({"x-session-id": "s"}, {}, **{**OPTS, "tenant": "k:2"})  # type: ignore[arg-type]
    assert a is not None and b is not None
    assert a.tenant == "k:1" and a.key != b.key and a.session == b.session


def test_echoed_answer_is_the_last_assistant_before_the_new_messages() -> None:
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": " Hello \n", "reasoning_content": "why"},
        {"role": "tool", "content": "r"},
        {"role": "user", "content": "next"},
    ]
    e = echoed_answer(msgs)
    assert e is not None and e.has_reasoning
    assert e.answer_digest == answer_digest("Hello", [])
    assert echoed_answer([{"role": "user", "content": "q"}]) is None


def test_tool_call_arguments_compare_as_json() -> None:
    assert answer_digest(None, [("f", '{"a": 1, "b": 2}')]) == answer_digest("", [("f", '{"b":2,"a":1}')])
    assert answer_digest(None, [("f", '{"a": 1}')]) != answer_digest(None, [("f", '{"a": 2}')])
