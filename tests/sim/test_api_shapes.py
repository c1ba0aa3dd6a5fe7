"""Response shapes of the simulated engine, key for key, against vLLM's, in process."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.sim.helpers import MODEL, asgi_client, chat_body, metric, sse

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan a trip to the sea"}]
CHAT_TOP = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
]
MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]
HEAD = ["id", "object", "created", "model", "choices"]


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_chat_non_streaming_body(compat: str) -> None:
    async with asgi_client(compat=compat) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(MESSAGES), headers={"x-request-id": "abc"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert ": " not in r.text and ", " not in r.text.split('"content"')[0]  # compact JSON
    body = r.json()
    assert list(body) == CHAT_TOP
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["system_fingerprint"].startswith(f"vllm-{compat}.0-")
    (choice,) = body["choices"]
    assert list(choice) == (CHOICE + ["weight_versions"] if compat == "0.33" else CHOICE)
    assert list(choice["message"]) == MESSAGE
    msg = choice["message"]
    assert msg["reasoning"].startswith("\n") and msg["reasoning"].endswith("\n")
    assert msg["content"].startswith("\n\n")
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["token_ids"][-1] == 2  # <|im_end|>
    usage = body["usage"]
    assert list(usage) == (USAGE + ["completion_tokens_details"] if compat == "0.33" else USAGE)
    assert usage["prompt_tokens"] == len(body["prompt_token_ids"])
    assert usage["completion_tokens"] == len(choice["token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if compat == "0.33":
        assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    assert body["kv_transfer_params"] is None and body["prompt_text"] is None


async def test_without_return_token_ids_the_id_fields_are_null() -> None:
    async with asgi_client() as c:
        body = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES, return_token_ids=None))).json()
    assert body["prompt_token_ids"] is None and body["choices"][0]["token_ids"] is None


async def test_prompt_tokens_details_when_enabled() -> None:
    async with asgi_client(details=True) as c:
        first = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES))).json()
        again = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES))).json()
    assert first["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((n - 1) // 16)


def stream_request(**extra: Any) -> dict[str, Any]:
    return chat_body(MESSAGES, stream=True, **extra)


@pytest.mark.parametrize("ids", [False, True])
async def test_chat_stream_chunks(ids: bool) -> None:
    async with asgi_client() as c:
        r = await c.post(
            "/v1/chat/completions", json=stream_request(return_token_ids=ids, stream_options={"include_usage": True})
        )
        full = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES))).json()
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse(r.text)
    role, *tokens, finish, usage = events
    assert len({(e["id"], e["created"]) for e in events}) == 1
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    # a) the role chunk
    assert list(role) == [*HEAD, "prompt_token_ids", "prompt_text"]
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert role["prompt_token_ids"] == (full["prompt_token_ids"] if ids else None)
    assert role["prompt_text"] is None
    # b) token chunks: token_ids is always set, null unless asked for; no stop_reason
    for e in tokens:
        assert list(e) == HEAD
        (ch,) = e["choices"]
        assert list(ch) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
        assert ch["finish_reason"] is None
        assert set(ch["delta"]) <= {"content", "reasoning"} and (ch["delta"] or ids)
        assert (ch["token_ids"] is None) is not ids
    # d) the finish chunk sets stop_reason; with a usage chunk to follow it has no fingerprint
    assert list(finish) == HEAD
    assert list(finish["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["stop_reason"] is None
    # e) the usage chunk
    assert list(usage) == [*HEAD, "usage", "system_fingerprint"] and usage["choices"] == []
    assert usage["usage"] == {k: full["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
    # the stream says what the full body says
    deltas = [e["choices"][0]["delta"] for e in [*tokens, finish]]
    assert "".join(d.get("reasoning", "") for d in deltas) == full["choices"][0]["message"]["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == full["choices"][0]["message"]["content"]
    if ids:
        streamed = [t for e in [*tokens, finish] for t in e["choices"][0]["token_ids"]]
        assert streamed == full["choices"][0]["token_ids"]


async def test_chat_stream_without_usage_puts_the_fingerprint_on_the_finish_chunk() -> None:
    async with asgi_client() as c:
        events = sse((await c.post("/v1/chat/completions", json=stream_request(max_tokens=5))).text)
    assert list(events[-1]) == [*HEAD, "system_fingerprint"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)


async def test_continuous_usage_is_on_every_chunk() -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    async with asgi_client() as c:
        events = sse((await c.post("/v1/chat/completions", json=stream_request(stream_options=opts))).text)
    assert list(events[0]) == [*HEAD, "usage", "prompt_token_ids", "prompt_text"]
    assert events[0]["usage"]["completion_tokens"] == 0
    counts = [e["usage"]["completion_tokens"] for e in events[1:-1]]
    assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_completions_non_streaming(compat: str) -> None:
    async with asgi_client(compat=compat) as c:
        ids = (await c.post("/tokenize", json={"prompt": "Bada kesi lomu"})).json()["tokens"]
        body = (
            await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5, "return_token_ids": True}
            )
        ).json()
        text_body = (await c.post("/v1/completions", json={"prompt": "Bada kesi lomu", "max_tokens": 5})).json()
    top = [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert list(body) == top
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert list(choice) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    assert choice["finish_reason"] == "length"
    assert text_body["choices"][0]["text"] == choice["text"]  # a text prompt is the same prompt
    assert ("completion_tokens_details" in body["usage"]) is (compat == "0.33")


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_completions_stream(compat: str) -> None:
    async with asgi_client(compat=compat) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": "Bada kesi",
                "max_tokens": 4,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            },
        )
    *chunks, usage = sse(r.text)
    assert len(chunks) == 4  # no role chunk
    keys = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
    for i, e in enumerate(chunks):
        assert list(e["choices"][0]) == (keys + ["weight_versions"] if compat == "0.33" else keys)
        assert (e["choices"][0]["prompt_token_ids"] is not None) is (i == 0)
        assert list(e) == ([*HEAD, "kv_transfer_params"] if compat == "0.33" else HEAD)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert list(usage) == [*HEAD, "usage", "system_fingerprint"]
    assert usage["usage"]["completion_tokens"] == 4


async def test_render_matches_tokenize_and_generation() -> None:
    body = chat_body(MESSAGES, max_tokens=64)
    async with asgi_client() as c:
        render = (await c.post("/v1/chat/completions/render", json=body)).json()
        tok = (await c.post("/tokenize", json={"messages": MESSAGES})).json()
        gen = (await c.post("/v1/chat/completions", json=body)).json()
    assert list(render) == [
        "request_id",
        "token_ids",
        "assistant_tokens_mask",
        "token_offsets",
        "features",
        "sampling_params",
        "model",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
        "ec_transfer_params",
    ]
    assert render["token_ids"] == tok["tokens"] == gen["prompt_token_ids"]
    assert render["request_id"].startswith("chatcmpl-") and len(render["request_id"]) == len("chatcmpl-") + 16
    assert render["sampling_params"] == {  # as recorded from vLLM 0.26 (tests/fixtures/vllm)
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        "max_tokens": 64,
        "output_kind": 2,
        "skip_clone": True,
        "bad_words": [],
        "skip_reading_prefix_cache": False,
    }
    assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"] and tok["count"] == len(tok["tokens"])


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_render_sampling_params_and_transfer_params(compat: str) -> None:
    kv = {"do_remote_decode": True}
    async with asgi_client(compat=compat, max_model_len=1000) as c:
        render = (
            await c.post(
                "/v1/chat/completions/render",
                json={"messages": MESSAGES, "max_tokens": 16, "stream": True, "kv_transfer_params": kv},
            )
        ).json()
        default = (await c.post("/v1/chat/completions/render", json={"messages": MESSAGES})).json()
    sp = render["sampling_params"]
    assert "max_tokens" not in sp and sp["output_kind"] == 1  # 16 is the default; streams are DELTA
    assert render["stream_options"] is None and render["stream"] is True
    if compat == "0.26":
        assert sp["extra_args"] == {"kv_transfer_params": kv} and render["kv_transfer_params"] is None
    else:
        assert "extra_args" not in sp and render["kv_transfer_params"] == kv
    assert default["sampling_params"]["max_tokens"] == 1000 - len(default["token_ids"])


async def test_models_version_health_and_detokenize() -> None:
    async with asgi_client(max_model_len=4096) as c:
        models = (await c.get("/v1/models")).json()
        version = await c.get("/version")
        health = await c.get("/health")
        ids = (await c.post("/tokenize", json={"prompt": "Hé <think>"})).json()["tokens"]
        detok = (await c.post("/detokenize", json={"tokens": ids})).json()
    assert list(models) == ["object", "data"]
    (card,) = models["data"]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
    assert card["id"] == MODEL and card["max_model_len"] == 4096 and card["owned_by"] == "vllm"
    assert list(card["permission"][0]) == [
        "id",
        "object",
        "created",
        "allow_create_engine",
        "allow_sampling",
        "allow_logprobs",
        "allow_search_indices",
        "allow_view",
        "allow_fine_tuning",
        "organization",
        "group",
        "is_blocking",
    ]
    assert version.json() == {"version": "0.26.0"}
    assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
    assert detok == {"prompt": "Hé <think>"}


async def test_metrics_expose_the_names_a_gateway_reads() -> None:
    async with asgi_client() as c:
        await c.post("/v1/chat/completions", json=chat_body(MESSAGES))
        await c.post("/v1/chat/completions", json=chat_body(MESSAGES))
        r = await c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    text = r.text
    labels = {"engine": "0", "model_name": MODEL}
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_bytes_transferred_count",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert f"{name}{{" in text, name
    assert metric(text, "vllm:time_to_first_token_seconds_count", **labels) == 2
    assert metric(text, "vllm:prefix_cache_hits_total", **labels) > 0
    by_source = {
        s: metric(text, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert by_source["local_cache_hit"] == metric(text, "vllm:prefix_cache_hits_total", **labels)
    assert sum(by_source.values()) == metric(text, "vllm:prefix_cache_queries_total", **labels)
    assert 'vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="sim-model"}' in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="sim-model"}' in text
    assert 'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.075",model_name="sim-model"}' in text


async def test_tool_calls_in_the_body_and_the_stream() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    body = chat_body(MESSAGES, tools=tools, tool_choice="required")
    async with asgi_client() as c:
        full = (await c.post("/v1/chat/completions", json=body)).json()
        events = sse((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
        render_none = (await c.post("/v1/chat/completions/render", json={**body, "tool_choice": "none"})).json()
        render_plain = (await c.post("/v1/chat/completions/render", json=chat_body(MESSAGES))).json()
    (choice,) = full["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert list(msg) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "tool_calls",
        "reasoning",
    ]
    assert msg["content"] == ""  # required: "" rather than null
    (call,) = msg["tool_calls"]
    assert list(call) == ["id", "type", "function"] and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}
    streamed = [tc for e in events[1:] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert list(streamed[0]) == ["id", "type", "index", "function"]
    assert streamed[0]["function"] == {"name": "get_weather"}
    assert "".join(tc["function"].get("arguments", "") for tc in streamed) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice "none" still renders the tools into the prompt (vLLM's default)
    assert len(render_none["token_ids"]) > len(render_plain["token_ids"])


async def test_request_ids_follow_the_x_request_id_header() -> None:
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    headers = {"x-request-id": "r42"}
    async with asgi_client(role="prefill") as p:
        chat = (
            await p.post(
                "/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=1, kv_transfer_params=kv), headers=headers
            )
        ).json()
        cmpl = (
            await p.post(
                "/v1/completions", json={"prompt": "Bada", "max_tokens": 1, "kv_transfer_params": kv}, headers=headers
            )
        ).json()
    assert chat["id"] == "chatcmpl-r42" and cmpl["id"] == "cmpl-r42"
    assert re.fullmatch(r"chatcmpl-r42-[0-9a-f]{8}", chat["kv_transfer_params"]["remote_request_id"])
    assert re.fullmatch(r"cmpl-r42-0-[0-9a-f]{8}", cmpl["kv_transfer_params"]["remote_request_id"])


async def test_min_tokens_and_ignore_eos() -> None:
    async with asgi_client() as c:
        natural = (await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=500))).json()
        n = natural["usage"]["completion_tokens"]
        longer = (
            await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=500, min_tokens=n + 10))
        ).json()
        forced = (
            await c.post("/v1/chat/completions", json=chat_body(MESSAGES, max_tokens=n + 20, ignore_eos=True))
        ).json()
    assert natural["choices"][0]["finish_reason"] == "stop"
    assert longer["usage"]["completion_tokens"] >= n + 10
    assert longer["choices"][0]["token_ids"][: n - 1] == natural["choices"][0]["token_ids"][: n - 1]
    assert forced["usage"]["completion_tokens"] == n + 20 and forced["choices"][0]["finish_reason"] == "length"
