"""Bad /v1/responses requests get a 400 naming the parameter, as OpenAI's Responses API does, before any
engine is involved; unknown and other tenants' response ids are not found."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from turnkv.config import Settings
from turnkv.gateway.app import create_app

from .test_bad_input import DOWN, assert_openai_error


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = Settings(prefill=[DOWN], decode=[DOWN], models=["m"], template_audit=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def body(**over: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **over}


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (body(input=42), "input"),
        (body(input=[]), "input"),
        (body(input=["hi"]), "input[0]"),
        (body(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
        (body(input=[{"role": "user", "content": 7}]), "input[0].content"),
        (body(input=[{"role": "user", "content": [{"type": "input_audio"}]}]), "input[0].content[0].type"),
        (
            body(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
            "input[0].content[0].image_url",
        ),
        (body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
        (body(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
        (body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
        (body(tools=[{"type": "web_search"}]), "tools[0].type"),
        (body(tools=[{"type": "function"}]), "tools[0].name"),
        (body(tool_choice={"type": "allowed_tools"}), "tool_choice"),
        (body(max_output_tokens=0), "max_output_tokens"),
        (body(temperature=5), "temperature"),
        (body(stream="yes"), "stream"),
        (body(store="no"), "store"),
        (body(text={"format": {"type": "grammar"}}), "text.format.type"),
        (body(background=True), "background"),
        (body(conversation="conv_1"), "conversation"),
        (body(prompt={"id": "pmpt_1"}), "prompt"),
        (body(metadata={"conversation_id": 7}), "metadata.conversation_id"),
        (body(prompt_cache_key=7), "prompt_cache_key"),
        (body(session_id="no spaces"), "session_id"),
        (body(kv_transfer_params={}), "kv_transfer_params"),
    ],
)
def test_bad_requests_name_the_parameter(client: TestClient, payload: dict[str, Any], param: str) -> None:
    assert_openai_error(client.post("/v1/responses", json=payload), 400, param)


def test_unknown_model(client: TestClient) -> None:
    assert_openai_error(client.post("/v1/responses", json=body(model="other")), 404, "model")


def test_unknown_previous_response(client: TestClient) -> None:
    err = assert_openai_error(
        client.post("/v1/responses", json=body(previous_response_id="resp_nope")), 400, "previous_response_id"
    )
    assert err["code"] == "previous_response_not_found"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ],
)
def test_unknown_response_is_not_found(client: TestClient, method: str, path: str) -> None:
    assert_openai_error(client.request(method, path), 404, "response_id")
