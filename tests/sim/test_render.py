"""The simulated render service (``--role render``), in process: render and derender shapes per vLLM version,
their errors, and the cost model (streaming derender replays everything before it)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.sim.helpers import MODEL, asgi_client, chat_body
from turnkv.sim.app import create_sim_app
from turnkv.sim.costs import CostModel
from turnkv.sim.derender import NEEDS_CHAT_REQUEST, NEEDS_PROMPT_IDS, STREAM_STOP_ERROR
from turnkv.sim.engine import EngineConfig
from turnkv.sim.render import RenderCosts, RenderSettings, create_render_app
from turnkv.sim.settings import SimSettings

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# the keys vLLM 0.34 writes (recorded), which the 0.33 level emulates
RENDER_033 = [
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "parse_context",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
]
RENDER_026 = [
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
STREAM_CHUNK = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "usage",
    "system_fingerprint",
    "prompt_token_ids",
    "prompt_text",
    "metrics",
    "kv_transfer_params",
]
STREAM_STATE = [
    "prev_tokens",
    "prefix_offset",
    "read_offset",
    "role_sent",
    "logprob_context_token_ids",
    "logprob_text_offset",
    "output_token_ids",
    "output_chunk_lens",
    "tools_streamed",
    "last_tool_call_ids",
]


@contextlib.asynccontextmanager
async def render_client(compat: str = "0.26", **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_render_app(RenderSettings(compat=compat, costs=RenderCosts(time_scale=0), **kw))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://render") as client:
        yield client


@contextlib.asynccontextmanager
async def generate_client(compat: str = "0.26") -> AsyncIterator[httpx.AsyncClient]:
    settings = SimSettings(tokens_only=True, engine=EngineConfig(compat=compat, costs=CostModel(time_scale=0)))
    app = create_sim_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gen") as client,
    ):
        yield client


async def output_ids(compat: str, client: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Render's request and a tokens-only engine's answer to it."""
    async with render_client(compat) as r, generate_client(compat) as g:
        gen = (await r.post("/v1/chat/completions/render", json=client)).json()
        out = (await g.post("/inference/v1/generate", json=gen)).json()
    return gen, out


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_render_is_what_the_engines_render(compat: str) -> None:
    client = chat_body(MESSAGES, tools=TOOLS, kv_transfer_params={"do_remote_decode": True})
    async with render_client(compat) as r, asgi_client(compat=compat) as engine:
        gen = (await r.post("/v1/chat/completions/render", json=client)).json()
        ids = (await engine.post("/v1/chat/completions/render", json=client)).json()["token_ids"]
    assert gen["token_ids"] == ids
    assert list(gen) == (RENDER_026 if compat == "0.26" else RENDER_033)
    sp = gen["sampling_params"]
    assert sp["max_tokens"] == 200 and sp["skip_special_tokens"] is False and sp["output_kind"] == 2
    assert sp["extra_args"]["turnkv_sim"] == {"tools": TOOLS, "tool_choice": "auto"}
    if compat == "0.26":  # 0.26 leaves the client's KV params in extra_args, 0.33 hoists them
        assert sp["extra_args"]["kv_transfer_params"] == {"do_remote_decode": True}
        assert gen["kv_transfer_params"] is None
    else:
        assert "kv_transfer_params" not in sp["extra_args"]
        assert gen["kv_transfer_params"] == {"do_remote_decode": True}
        assert gen["reasoning_ended"] is False and gen["parse_context"]["tool_choice"] == "auto"


async def test_a_max_tokens_of_16_is_left_out_as_samplingparams_default() -> None:
    async with render_client() as r:
        gen = (await r.post("/v1/chat/completions/render", json=chat_body(MESSAGES, max_tokens=16))).json()
    assert "max_tokens" not in gen["sampling_params"]


async def test_render_refuses_what_the_engine_refuses() -> None:
    async with render_client() as r:
        bad = await r.post("/v1/chat/completions/render", json=chat_body(MESSAGES, max_tokens=10**6))
        other = await r.post("/v1/chat/completions/render", json={**chat_body(MESSAGES), "model": "other"})
        shape = await r.post("/v1/chat/completions/render", json={"model": MODEL, "messages": [{"content": "x"}]})
    assert bad.status_code == 400 and "max_tokens=1000000 cannot be greater" in bad.json()["error"]["message"]
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError"
    assert shape.status_code == 400 and shape.json()["error"]["code"] == 400


async def test_responses_render_from_0_30_is_stateless() -> None:
    body = {"model": MODEL, "input": "Weather in Paris?", "instructions": "Be brief.", "max_output_tokens": 32}
    async with render_client("0.33") as r, render_client("0.26") as old:
        gen = (await r.post("/v1/responses/render", json=body)).json()
        chat = (await r.post("/v1/chat/completions/render", json=chat_body(MESSAGES))).json()
        refused = await r.post("/v1/responses/render", json={**body, "previous_response_id": "resp_1"})
        missing = await old.post("/v1/responses/render", json=body)
    assert gen["token_ids"] == chat["token_ids"] and gen["request_id"].startswith("resp-")
    assert gen["sampling_params"]["max_tokens"] == 32 and gen["parse_context"] is None
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "previous_response_id is not supported by the stateless render endpoint.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": 400,
    }
    assert missing.status_code == 404


async def test_completions_render_is_a_list() -> None:
    async with render_client() as r:
        out = (await r.post("/v1/completions/render", json={"model": MODEL, "prompt": "Once upon"})).json()
    assert len(out) == 1 and out[0]["request_id"].startswith("cmpl-") and "max_tokens" not in out[0]["sampling_params"]


def derender_body(compat: str, gen: dict[str, Any], out: dict[str, Any], client: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "generate_response": out, "chat_request": client}
    if compat == "0.26":
        body["prompt_tokens"] = len(gen["token_ids"])
    else:
        body["prompt_token_ids"] = gen["token_ids"]
    return body


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_derender_gives_the_chat_answer(compat: str) -> None:
    client = chat_body(MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300)
    gen, out = await output_ids(compat, client)
    async with render_client(compat) as r, asgi_client(compat=compat) as engine:
        body = (await r.post("/v1/chat/completions/derender", json=derender_body(compat, gen, out, client))).json()
        truth = (await engine.post("/v1/chat/completions", json=client)).json()
    (choice,) = body["choices"]
    msg, want = choice["message"], truth["choices"][0]["message"]
    assert (msg["content"], msg["reasoning"]) == (want["content"], want["reasoning"])
    (call,) = msg["tool_calls"]
    assert call["function"] == want["tool_calls"][0]["function"]
    # the prompt is counted from ``prompt_tokens`` only, which 0.33 takes beside the ids (not sent here)
    assert body["usage"]["prompt_tokens"] == (len(gen["token_ids"]) if compat == "0.26" else 0)
    assert body["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"])
    if compat == "0.26":  # a bare uuid, and the engine's finish reason kept
        assert re.fullmatch(r"[0-9a-f]{32}", call["id"]) and choice["finish_reason"] == "stop"
    else:
        assert call["id"].startswith("chatcmpl-tool-") and choice["finish_reason"] == "tool_calls"


async def test_0_33_derender_refuses_a_parser_call_without_the_chat_request() -> None:
    client = chat_body(MESSAGES)
    gen, out = await output_ids("0.33", client)
    body = derender_body("0.33", gen, out, client)
    del body["chat_request"]
    async with render_client("0.33") as r, render_client("0.33", reasoning_parser=False, tool_parser=False) as plain:
        refused = await r.post("/v1/chat/completions/derender", json=body)
        text = (await plain.post("/v1/chat/completions/derender", json=body)).json()
    assert refused.status_code == 400 and refused.json()["error"]["message"] == NEEDS_CHAT_REQUEST
    assert text["choices"][0]["message"]["reasoning"] is None  # no parser: plain text, markers dropped
    assert "<think>" not in text["choices"][0]["message"]["content"]


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_derender_errors(compat: str) -> None:
    client = chat_body(MESSAGES)
    gen, out = await output_ids(compat, client)
    empty = derender_body(compat, gen, {**out, "choices": [{"index": 0, "token_ids": []}]}, client)
    async with render_client(compat) as r:
        r1 = await r.post("/v1/chat/completions/derender", json=empty)
        r2 = await r.post("/v1/chat/completions/derender", json={"model": MODEL})
    assert r1.status_code == 400 and r1.json()["error"]["message"] == "choice 0 has empty or null token_ids"
    assert r2.status_code == 400 and "generate_response" in r2.json()["error"]["message"]


async def stream_derender(
    r: httpx.AsyncClient, gen: dict[str, Any], out: dict[str, Any], client: dict[str, Any], per_call: int
) -> list[dict[str, Any]]:
    ids = out["choices"][0]["token_ids"]
    state = None
    chunks = []
    for i in range(0, len(ids), per_call):
        finish = "stop" if i + per_call >= len(ids) else None
        body = {
            "stream": True,
            "model": MODEL,
            "generate_chunk": {
                "request_id": "chatcmpl-x",
                "choices": [{"index": 0, "token_ids": ids[i : i + per_call], "finish_reason": finish}],
            },
            "stream_state": state,
            "prompt_token_ids": gen["token_ids"],
            "chat_request": {**client, "stream": True},
        }
        resp = await r.post("/v1/chat/completions/derender", json=body)
        assert resp.status_code == 200, resp.text
        chunks.append(resp.json()["chunk"])
        state = resp.json()["stream_state"]
        assert list(state) == STREAM_STATE
    return chunks


@pytest.mark.parametrize("per_call", [1, 7])
async def test_streaming_derender_adds_up_to_the_non_streaming_answer(per_call: int) -> None:
    client = chat_body(MESSAGES, tools=TOOLS, max_tokens=300)
    gen, out = await output_ids("0.33", client)
    async with render_client("0.33") as r:
        whole = (await r.post("/v1/chat/completions/derender", json=derender_body("0.33", gen, out, client))).json()
        chunks = await stream_derender(r, gen, out, client, per_call)
    assert all(list(c) == STREAM_CHUNK for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all(d["role"] is None for d in deltas[1:])
    msg = whole["choices"][0]["message"]
    assert "".join(d["content"] or "" for d in deltas) == (msg["content"] or "")
    assert "".join(d["reasoning"] or "" for d in deltas) == (msg["reasoning"] or "")
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [tc["function"] for tc in calls] == [tc["function"] for tc in msg.get("tool_calls") or []]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_streaming_derender_replays_everything_before_it() -> None:
    """One token per call replays n(n-1)/2 tokens; the modelled core time grows with it."""
    client = chat_body(MESSAGES, max_tokens=300)
    gen, out = await output_ids("0.33", client)
    n = len(out["choices"][0]["token_ids"])
    busy = {}
    for per_call in (1, 16):
        async with render_client("0.33") as r:
            await stream_derender(r, gen, out, client, per_call)
            state = (await r.get("/_sim/state")).json()
        busy[per_call] = state["busy_s"]["derender_stream"]
        if per_call == 1:
            assert state["replayed_tokens"] == n * (n - 1) // 2
    costs = RenderCosts()
    prompt = len(gen["token_ids"])
    assert busy[1] == pytest.approx(sum(costs.stream_call(prompt, k, 1, k) for k in range(n)), abs=1e-5)
    assert busy[1] > 4 * busy[16]


async def test_streaming_derender_errors() -> None:
    client = chat_body(MESSAGES)
    gen, out = await output_ids("0.33", client)
    chunk = {"request_id": "x", "choices": [{"index": 0, "token_ids": out["choices"][0]["token_ids"][:2]}]}
    base = {"stream": True, "model": MODEL, "generate_chunk": chunk, "prompt_token_ids": gen["token_ids"]}
    two = {"request_id": "x", "choices": [*chunk["choices"], {"index": 1, "token_ids": [5]}]}
    cases = [
        ({**base, "chat_request": {**client, "stop": ["x"]}}, STREAM_STOP_ERROR),
        (base, NEEDS_CHAT_REQUEST),
        ({**base, "chat_request": client, "prompt_token_ids": None}, NEEDS_PROMPT_IDS),
        ({**base, "chat_request": client, "generate_chunk": two}, "at most one choice per chunk (got 2)"),
        ({**base, "chat_request": client, "stream_state": {"output_token_ids": [1], "output_chunk_lens": [3]}}, ""),
    ]
    async with render_client("0.33") as r, render_client("0.26") as old:
        for body, message in cases:
            resp = await r.post("/v1/chat/completions/derender", json=body)
            assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
        # 0.26 has no streaming derender: the body is not a derender request there
        resp = await old.post("/v1/chat/completions/derender", json={**base, "chat_request": client})
        assert resp.status_code == 400 and "generate_response" in resp.json()["error"]["message"]


async def test_render_costs_are_accounted_per_route() -> None:
    client = chat_body(MESSAGES, max_tokens=300)
    gen, out = await output_ids("0.26", client)
    async with render_client("0.26") as r:
        await r.post("/v1/chat/completions/render", json=client)
        await r.post("/v1/chat/completions/derender", json=derender_body("0.26", gen, out, client))
        await r.post("/detokenize", json={"tokens": out["choices"][0]["token_ids"][:10]})
        state = (await r.get("/_sim/state")).json()
    costs = RenderCosts()
    assert state["calls"] == {"render": 1, "derender": 1, "detokenize": 1}
    assert state["busy_s"]["render"] == pytest.approx(costs.render(len(gen["token_ids"])), abs=1e-6)
    assert state["busy_s"]["derender"] == pytest.approx(costs.derender(len(out["choices"][0]["token_ids"])), abs=1e-6)
    assert state["busy_s"]["detokenize"] == pytest.approx(costs.detokenize(10), abs=1e-6)
