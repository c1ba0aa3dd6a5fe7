"""Error bodies as vLLM words them, and request fields that change what the engine computes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.sim.helpers import MODEL, P_KEYS_026, P_KEYS_033, asgi_client, chat_body, prefill_body, sse

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Plan a trip to the sea"}]


def error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["code"] == r.status_code
    return dict(body["error"])


@pytest.mark.parametrize("stream", [False, True])
async def test_schema_failures_are_400_bad_request(stream: bool) -> None:
    async with asgi_client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens="abc", stream=stream))
        missing = await c.post("/v1/chat/completions", json={"model": MODEL})
        not_json = await c.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    e = error(r)
    assert r.status_code == 400 and e["type"] == "Bad Request" and e["param"] == "body.max_tokens"
    assert e["message"].startswith("1 validation error:\n  {'type': 'int_parsing', 'loc': ('body', 'max_tokens')")
    assert error(missing)["param"] == "body.messages"
    assert not_json.status_code == 400 and error(not_json)["type"] == "Bad Request"


async def test_unknown_model_is_404() -> None:
    async with asgi_client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, model="foo"))
        no_model = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 404
    assert error(r) == {
        "message": "The model `foo` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert no_model.status_code == 200  # a missing model name is accepted


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 5000), ("max_completion_tokens", 4097)])
async def test_max_tokens_above_max_model_len(field: str, value: int) -> None:
    body = {"messages": MESSAGES, field: value}
    async with asgi_client(max_model_len=4096) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert error(r) == {
        "message": f"{field}={value} cannot be greater than max_model_len=max_total_tokens=4096. Please request "
        f"fewer output tokens. (parameter={field}, value={value})",
        "type": "BadRequestError",
        "param": field,
        "code": 400,
    }


@pytest.mark.parametrize("value", [0, -5])
async def test_max_tokens_below_one(value: int) -> None:
    async with asgi_client() as c:
        r = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=value))
    assert error(r) == {
        "message": f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }


async def test_prompt_too_long_for_a_text_prompt_says_at_least() -> None:
    async with asgi_client(max_model_len=64) as c:
        n = (await c.post("/tokenize", json={"messages": MESSAGES})).json()["count"]
        fits = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=64 - n))
        r = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=64 - n + 1, stream=True))
    assert fits.status_code == 200  # prompt + max_tokens == max_model_len is accepted
    max_input = n - 1
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert error(r) == {
        "message": f"This model's maximum context length is 64 tokens. However, you requested {64 - n + 1} output "
        f"tokens and your prompt contains at least {max_input + 1} input tokens, for a total of at least "
        f"{65} tokens. Please reduce the length of the input prompt or the number of requested output "
        f"tokens. (parameter=input_tokens, value={max_input + 1})",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }


async def test_prompt_too_long_for_token_ids_reports_the_exact_count() -> None:
    async with asgi_client(max_model_len=64) as c:
        r = await c.post("/v1/completions", json={"prompt": [300] * 70, "max_tokens": 10})
        unset = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 80}]})
    assert error(r)["message"].startswith(
        "This model's maximum context length is 64 tokens. However, you requested 10 output tokens and your "
        "prompt contains 70 input tokens, for a total of 80 tokens."
    )
    assert "you requested 0 output tokens and your prompt contains at least 65 input tokens" in error(unset)["message"]


async def test_out_of_vocabulary_ids_and_bad_tool_arguments_are_400() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    bad_history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "more"},
    ]
    async with asgi_client() as c:
        oov = await c.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2})
        args = await c.post("/v1/chat/completions", json=chat_body(bad_history))
    assert error(oov)["type"] == "BadRequestError"
    assert error(args)["type"] == "BadRequestError" and args.status_code == 400


@contextlib.asynccontextmanager
async def prefill_and_decode(compat: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with asgi_client(compat=compat, role="prefill") as p, asgi_client(compat=compat, role="decode") as d:
        yield p, d


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_transfer_params_in_the_stream_only_under_0_33(compat: str) -> None:
    client = chat_body(MESSAGES, stream=True, stream_options={"include_usage": True})
    async with prefill_and_decode(compat) as (p, d):
        p_body = (await p.post("/v1/chat/completions", json=prefill_body(client))).json()
        params = p_body["kv_transfer_params"]
        events = sse((await d.post("/v1/chat/completions", json={**client, "kv_transfer_params": params})).text)
    assert list(params) == (P_KEYS_033 if compat == "0.33" else P_KEYS_026)
    role, *tokens, finish, usage = events
    assert "kv_transfer_params" not in role and "kv_transfer_params" not in usage
    if compat == "0.26":
        assert all("kv_transfer_params" not in e for e in events)
        return
    assert all(list(e)[-1] == "kv_transfer_params" and e["kv_transfer_params"] is None for e in tokens)
    handle = finish["kv_transfer_params"]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert list(finish["choices"][0])[-1] == "weight_versions"
    assert list(handle) == P_KEYS_033
    assert handle["do_remote_decode"] is True and handle["do_remote_prefill"] is False
    assert handle["remote_num_tokens"] == usage["usage"]["total_tokens"] - 1


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_prompt_token_ids_in_transfer_params_are_honoured_from_0_33(compat: str) -> None:
    other = [{"role": "user", "content": "Something else entirely"}]
    async with asgi_client(compat=compat) as c:
        other_ids = (await c.post("/tokenize", json={"messages": other})).json()["tokens"]
        plain = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES))).json()
        other_answer = (await c.post("/v1/chat/completions", json=chat_body(other))).json()
        r = await c.post(
            "/v1/chat/completions", json=chat_body(MESSAGES, kv_transfer_params={"prompt_token_ids": other_ids})
        )
        bad = await c.post(
            "/v1/chat/completions", json=chat_body(MESSAGES, kv_transfer_params={"prompt_token_ids": []})
        )
    body = r.json()
    if compat == "0.26":
        assert body["prompt_token_ids"] == plain["prompt_token_ids"]  # ignored: it stays inside the params
        assert bad.status_code == 200
        return
    assert body["prompt_token_ids"] == other_ids
    assert body["choices"][0]["token_ids"] == other_answer["choices"][0]["token_ids"]
    assert bad.status_code == 400 and error(bad)["param"] == "kv_transfer_params"


async def test_fail_next_answers_500_then_recovers() -> None:
    async with asgi_client() as c:
        await c.post("/_sim/faults", json={"fail_next": 2})
        a = await c.post("/v1/chat/completions", json=chat_body(MESSAGES))
        b = await c.post("/v1/chat/completions", json=chat_body(MESSAGES, stream=True))
        ok = await c.post("/v1/chat/completions", json=chat_body(MESSAGES))
    for r in (a, b):
        assert error(r) == {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    assert ok.status_code == 200


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_a_failed_pull_before_the_first_token_in_a_stream(compat: str) -> None:
    """0.26 skips the empty output before checking for the error: no error event at all; 0.33 sends one."""
    dead = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": "gone",
        "remote_request_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        "remote_num_tokens": 20,
        "remote_blocks_expiry_time": None,
    }
    body = chat_body(MESSAGES, stream=True, kv_transfer_params=dead, stream_options={"include_usage": True})
    async with asgi_client(compat=compat, role="decode") as d:
        r = await d.post("/v1/chat/completions", json=body)
        plain = await d.post("/v1/chat/completions", json={**body, "stream": False})
    assert plain.status_code == 500 and error(plain)["message"] == "Internal server error"
    assert r.status_code == 200
    role, *rest = sse(r.text)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if compat == "0.26":
        assert [list(e) for e in rest] == [
            ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
        ]
    else:
        assert rest == [
            {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
        ]
        assert 'data: {"error":{"message":"Internal server error"' in r.text  # compact in 0.33
