"""What of a request reaches the engines (gateway/fields.py) and how each field's type is checked
(gateway/requests.py), in process: the gateway app through Starlette's TestClient, its engines unreachable
on purpose, so a request that passes every check ends in the engines' 503 (``upstream_unavailable``) and
one that does not in the check's own 4xx. Then body shapes fuzzed with hypothesis: none gives a 500."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from turnkv.config import Settings
from turnkv.gateway.app import create_app
from turnkv.gateway.fields import CHAT, COMPLETIONS, DROPPED, ENGINE_PRIVATE, SHOWN_CHARS, UNSERVED

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens
PASSED = 503  # every check passed: the (unreachable) engines answer


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(gateway_settings()), raise_server_exceptions=False) as c:
        yield c


def gateway_settings(**over: Any) -> Settings:
    return Settings(**{"prefill": [DOWN], "decode": [DOWN], "models": ["m"], "template_audit": False, **over})


def chat(**over: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **over}


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


def test_a_field_outside_the_list_is_refused_by_name(client: TestClient) -> None:
    for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", {"model": "m", "prompt": "hi"})):
        err = error_of(client.post(path, json={**body, "temprature": 0.5}), 400)
        assert err["message"] == "Unrecognized request argument supplied: temprature"
        assert err["param"] == "temprature" and err["type"] == "invalid_request_error"
    # a chat field is not a completions field, nor the other way round
    error_of(client.post("/v1/completions", json={"model": "m", "prompt": "hi", "tools": []}), 400)
    error_of(client.post("/v1/chat/completions", json=chat(prompt="hi")), 400)


@pytest.mark.parametrize("field", sorted(ENGINE_PRIVATE))
def test_engine_private_fields_are_refused_unless_configured(field: str) -> None:
    value: Any = {"priority": -10, "request_id": "mine", "logits_processors": ["x.y"]}.get(field, {"k": "v"})
    with TestClient(create_app(gateway_settings()), raise_server_exceptions=False) as c:
        err = error_of(c.post("/v1/chat/completions", json=chat(**{field: value})), 400)
        assert err["param"] == field and "clients" in err["message"]
        responses = c.post("/v1/responses", json={"model": "m", "input": "hi", field: value})
        assert error_of(responses, 400)["param"] == field
    allowing = (
        {"allow_client_kv_transfer_params": True} if field == "kv_transfer_params" else {"engine_fields": [field]}
    )
    with TestClient(create_app(gateway_settings(**allowing)), raise_server_exceptions=False) as c:
        assert error_of(c.post("/v1/chat/completions", json=chat(**{field: value})), PASSED)


@pytest.mark.parametrize("field", sorted(UNSERVED))
def test_features_the_engines_cannot_serve_are_refused(client: TestClient, field: str) -> None:
    assert error_of(client.post("/v1/chat/completions", json=chat(**{field: {"x": 1}})), 400)["param"] == field


def test_fields_openai_clients_send_as_a_matter_of_course_are_dropped(client: TestClient) -> None:
    sent = {"store": True, "service_tier": "auto", "safety_identifier": "u1", "prompt_cache_retention": "24h"}
    sent |= {"verbosity": "low", "prediction": {"type": "content", "content": "x"}, "modalities": ["text"]}
    assert set(sent) == DROPPED
    assert error_of(client.post("/v1/chat/completions", json=chat(**sent)), PASSED)
    assert error_of(client.post("/v1/chat/completions", json=chat(modalities=["text", "audio"])), 400)


# one wrong-typed value for every forwarded field (each must be refused before any engine call)
WRONG: dict[str, Any] = {
    "model": 7,
    "frequency_penalty": "0",
    "presence_penalty": 2.5,
    "logit_bias": {"5": "high"},
    "logprobs": "yes",
    "top_logprobs": 21,
    "max_tokens": 1.5,
    "n": 0,
    "seed": 1 << 64,
    "stop": [1, 2],
    "stream": "true",
    "stream_options": {"include_usage": 1},
    "temperature": "hot",
    "top_p": 2,
    "user": ["u"],
    "response_format": {"type": 1},
    "use_beam_search": "no",
    "top_k": -2,
    "min_p": 1.5,
    "repetition_penalty": 0,
    "length_penalty": "1",
    "stop_token_ids": ["1"],
    "include_stop_str_in_output": 0,
    "ignore_eos": "false",
    "min_tokens": -1,
    "skip_special_tokens": "x",
    "spaces_between_special_tokens": 1,
    "truncate_prompt_tokens": -5,
    "prompt_logprobs": "3",
    "allowed_token_ids": [1.5],
    "bad_words": "word",
    "structured_outputs": "json",
    "guided_json": 5,
    "guided_regex": [],
    "guided_choice": "a",
    "guided_grammar": {},
    "guided_decoding_backend": 1,
    "guided_whitespace_pattern": 1,
    "return_tokens_as_token_ids": "1",
    "return_token_ids": 1,
    "add_special_tokens": "no",
    "cache_salt": "",
    "messages": [{"role": "user", "content": 5}],
    "max_completion_tokens": "8",
    "tools": [{"type": "function", "function": {"parameters": {}}}],
    "tool_choice": "sometimes",
    "parallel_tool_calls": "yes",
    "reasoning_effort": 3,
    "include_reasoning": "no",
    "thinking_token_budget": "100",
    "echo": 1,
    "add_generation_prompt": "yes",
    "continue_final_message": "no",
    "documents": {"title": "t"},
    "chat_template": ["{{ x }}"],
    "chat_template_kwargs": ["enable_thinking"],
    "mm_processor_kwargs": 1,
    "media_io_kwargs": "x",
    "prompt": {"a": 1},
    "best_of": "2",
    "suffix": 1,
    "prompt_embeds": 3,
}


@pytest.mark.parametrize("field", sorted(CHAT | COMPLETIONS))
def test_every_forwarded_field_is_type_checked(client: TestClient, field: str) -> None:
    assert field in WRONG, "a forwarded field without a wrong value here"
    chat_field = field in CHAT
    path = "/v1/chat/completions" if chat_field else "/v1/completions"
    body = chat() if chat_field else {"model": "m", "prompt": "hi"}
    err = error_of(client.post(path, json={**body, field: WRONG[field]}), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field, err


def test_names_and_values_a_client_chose_are_not_echoed_whole(client: TestClient) -> None:
    huge = "m" * 60_000  # a URL (/v1/models/{id}) holds 64 kB at most
    for r in (
        client.post("/v1/chat/completions", json=chat(model=huge)),
        client.get("/v1/models/" + huge),
        client.post("/v1/chat/completions", json=chat(**{huge: 1})),
        client.post("/v1/chat/completions", json=chat(logit_bias={huge: "x"})),
        client.post("/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": huge}),
    ):
        assert r.status_code in (400, 404), r.text
        assert len(r.content) < 2 * SHOWN_CHARS + 400 and " characters)" in r.text


def test_bodies_that_are_not_utf8_text_say_so(client: TestClient) -> None:
    raw = json.dumps(chat()).encode()
    gz = client.post("/v1/chat/completions", content=gzip.compress(raw), headers={"content-type": "application/json"})
    assert "gzip-compressed" in error_of(gz, 400)["message"]
    declared = client.post(
        "/v1/chat/completions",
        content=gzip.compress(raw),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert "Content-Encoding 'gzip' is not supported" in error_of(declared, 400)["message"]
    latin1 = raw.replace(b'"hi"', b'"caf\xe9"')
    err = error_of(
        client.post("/v1/chat/completions", content=latin1, headers={"content-type": "application/json"}), 400
    )
    assert err["message"].startswith("request body is not valid UTF-8 (byte ") and "surrogate" not in err["message"]


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [70, 900, 5000, 200_000])
def test_deeply_nested_tool_call_arguments_are_not_a_500(client: TestClient, depth: int) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(depth)}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    # found from its history (no id), and named (a session id)
    for headers in ({}, {"x-session-id": "conv-1"}):
        error_of(client.post("/v1/chat/completions", json=chat(messages=history), headers=headers), PASSED)
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep(depth)},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    error_of(client.post("/v1/responses", json={"model": "m", "input": items}), PASSED)


# -- fuzzed body shapes ---------------------------------------------------------------------------------------
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
NAMES = st.sampled_from(sorted(CHAT | COMPLETIONS | set(ENGINE_PRIVATE) | DROPPED)) | st.text(max_size=8)
ARGUMENTS = st.sampled_from([0, 70, 900, 5000]).map(deep) | VALUES.map(json.dumps) | st.text(max_size=8)
CALLS = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=4),
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=4), "arguments": ARGUMENTS}),
    }
)
# mostly messages that pass the checks, so that what comes after them (finding the conversation, digests of
# tool calls, the responses translation) runs too; some of any shape
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": st.text(max_size=8)})
    | st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none() | st.text(max_size=8)},
        optional={"tool_calls": st.lists(CALLS, max_size=2), "reasoning": st.text(max_size=8)},
    )
    | st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"])},
        optional={"content": VALUES, "tool_calls": st.lists(CALLS, max_size=2) | VALUES, "reasoning": VALUES},
    )
    | VALUES,
    min_size=1,
    max_size=4,
)
EXTRA: st.SearchStrategy[dict[str, Any]] = st.just({}) | st.dictionaries(
    NAMES, VALUES, max_size=4
)  # often none: a body that may pass the checks


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies for ``path``: the endpoint's own main field (messages, prompt or input) and other fields."""
    mains: dict[str, dict[str, st.SearchStrategy[Any]]] = {
        "/v1/chat/completions": {"messages": MESSAGES},
        "/v1/completions": {"prompt": VALUES | st.text(max_size=8)},
        "/v1/responses": {"input": MESSAGES | VALUES},
    }
    main = mains[path]
    base = st.fixed_dictionaries({"model": st.just("m") | VALUES, **main}, optional={"stream": st.booleans()})
    return st.tuples(base, EXTRA).map(lambda b: {**b[1], **b[0]})


FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same bodies on every run: CI never fails on a body it never tried before
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=st.data(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]))
def test_no_body_gives_a_500(
    client: TestClient, caplog: pytest.LogCaptureFixture, data: st.DataObject, path: str
) -> None:
    body = data.draw(bodies(path))
    with caplog.at_level(logging.ERROR):
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code != 500 and 400 <= r.status_code < 600, r.text
    error_of(r, r.status_code)
    assert not [x for x in caplog.records if x.exc_info], "a body ended in a traceback"
