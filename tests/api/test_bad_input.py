"""Bad requests get a clear 4xx in OpenAI's error shape, before any engine is involved.

In-process: the gateway app through Starlette's TestClient, its engines unreachable on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from turnkv.config import Settings
from turnkv.gateway.app import create_app

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Settings(prefill=[DOWN], decode=[DOWN], models=["m"], max_body_bytes=4096, template_audit=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


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
    ],
)
def test_bad_chat_fields(client: TestClient, body: dict[str, Any], param: str) -> None:
    err = assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_json(client: TestClient, raw: bytes) -> None:
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_oversized_body(client: TestClient) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    assert_openai_error(client.post("/v1/chat/completions", json=big), 413)
    # declared too large, even before a byte of it arrives
    r = client.post("/v1/chat/completions", content=json.dumps(chat()).encode(),
                    headers={"content-type": "application/json", "content-length": "999999"})
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
    assert_openai_error(client.get("/v1/embeddings"), 404)
    assert_openai_error(client.get("/v1/chat/completions"), 405)


def test_engines_down_is_a_503_not_a_crash(client: TestClient) -> None:
    for stream in (False, True):
        err = assert_openai_error(client.post("/v1/chat/completions", json=chat(stream=stream)), 503)
        assert err["code"] == "upstream_unavailable"
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False
