"""Bad requests get a clear 4xx in OpenAI's error shape, before any engine is involved.

In-process: the gateway app through Starlette's TestClient, its engines unreachable on purpose.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from turnkv.config import Settings
from turnkv.gateway.app import create_app

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.fixture(params=[4096], ids=["max_body_4k"])
def client(caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    settings = Settings(prefill=[DOWN], decode=[DOWN], models=["m"], max_body_bytes=request.param, template_audit=False)
    with caplog.at_level(logging.DEBUG), TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c
    # no bad input ends in a traceback (or any error) in the log
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def chat(**over: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **over}


def assert_openai_error(r: Any, status: int, param: str | None = "-") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "-":
        assert err["param"] == param
    return dict(err)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages="hi"), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
        (chat(messages=[{"content": "x"}]), "messages.0.role"),
        (chat(max_tokens="abc"), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=-5), "max_tokens"),
        (chat(stream="yes"), "stream"),
        (chat(temperature=7), "temperature"),
        (chat(n=0), "n"),
        (chat(stream_options={"include_usage": "sure"}), "stream_options.include_usage"),
        (chat(session_id=42), "session_id"),
        (chat(session_id="no spaces please"), "session_id"),
        (chat(kv_transfer_params={"do_remote_decode": True}), "kv_transfer_params"),
        # strict types where OpenAI says integer or number: no "40", no true, no 40.0
        (chat(max_tokens="40"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(max_tokens=40.0), "max_tokens"),
        (chat(max_completion_tokens="40"), "max_completion_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(n="1"), "n"),
        (chat(min_tokens="2"), "min_tokens"),
        (chat(seed="7"), "seed"),
        (chat(temperature="0.5"), "temperature"),
        (chat(temperature=True), "temperature"),
        (chat(top_p="1"), "top_p"),
        (chat(top_logprobs="2"), "top_logprobs"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(cache_salt=7), "cache_salt"),
        (chat(cache_salt=""), "cache_salt"),
        (chat(session_id="conv-1\n"), "session_id"),
        (chat(session_id="conv-1\r\n"), "session_id"),
        # an assistant's tool calls, as an engine would fail on them
        (chat(messages=[{"role": "assistant", "tool_calls": "x"}]), "messages.0.tool_calls"),
        (chat(messages=[{"role": "assistant", "tool_calls": [{}]}]), "messages.0.tool_calls.0.id"),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            ),
            "messages.0.tool_calls.0.type",
        ),
        (
            chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]),
            "messages.0.tool_calls.0.function",
        ),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            ),
            "messages.0.tool_calls.0.id",
        ),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": None, "arguments": "{}"}}],
                    }
                ]
            ),
            "messages.0.tool_calls.0.function.name",
        ),
        (
            chat(
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
                        ],
                    }
                ]
            ),
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_chat_fields(client: TestClient, body: dict[str, Any], param: str) -> None:
    err = assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def nested(depth: int) -> bytes:
    """A body nested ``depth`` levels deep in a field open to any JSON (vLLM's chat_template_kwargs)."""
    inner = b'{"x": ' * depth + b"1" + b"}" * depth
    return b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ' + inner + b"}"


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        b"\xff\xfe",
        # lone surrogates: escaped, in a key, and as their (invalid) UTF-8 bytes, which json.loads lets through
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi", "\\ud83d": 1}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        nested(200),  # past max_json_depth (64), below json's own recursion limit
    ],
)
def test_malformed_json(client: TestClient, raw: bytes) -> None:
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("client", [1 << 20], indirect=True, ids=["max_body_1m"])
def test_json_past_the_parsers_recursion_limit(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=nested(100_000), headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 a pair is one character"}]}',
        nested(60),
    ],
)
def test_what_looks_close_is_accepted(client: TestClient, raw: bytes) -> None:
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 503)  # past every check: the engines (down on purpose) are the next step


def test_oversized_body(client: TestClient) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    assert_openai_error(client.post("/v1/chat/completions", json=big), 413)
    # declared too large, even before a byte of it arrives
    r = client.post(
        "/v1/chat/completions",
        content=json.dumps(chat()).encode(),
        headers={"content-type": "application/json", "content-length": "999999"},
    )
    assert r.status_code in (400, 413)


def test_unknown_model(client: TestClient) -> None:
    err = assert_openai_error(client.post("/v1/chat/completions", json=chat(model="gpt-9")), 404, "model")
    assert err["code"] == "model_not_found"


def test_bad_session_header(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat(), headers={"X-Session-ID": "a" * 300})
    assert_openai_error(r, 400, "x-session-id")


def test_bad_completions_prompt(client: TestClient) -> None:
    assert_openai_error(client.post("/v1/completions", json={"model": "m", "prompt": {"a": 1}}), 400, "prompt")


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/embeddings"), 405)
    assert_openai_error(client.get("/v1/chat/completions"), 405)


def test_engines_down_is_a_503_not_a_crash(client: TestClient) -> None:
    for stream in (False, True):
        err = assert_openai_error(client.post("/v1/chat/completions", json=chat(stream=stream)), 503)
        assert err["code"] == "upstream_unavailable"
        assert "127.0.0.1" not in err["message"]  # engine URLs are logged, never told to clients
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False


def test_kv_transfer_params_pass_where_the_settings_allow_them() -> None:
    """The vLLM engine's own rule (``VllmEngine.check_request``), as the settings set it."""
    settings = Settings(
        prefill=[DOWN], decode=[DOWN], models=["m"], template_audit=False, allow_client_kv_transfer_params=True
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json=chat(kv_transfer_params={"do_remote_decode": True}))
        assert_openai_error(r, 503)  # past every check: the engines (down on purpose) are the next step
