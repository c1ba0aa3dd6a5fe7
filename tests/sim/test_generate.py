"""The simulated ``--tokens-only`` engine: ``/inference/v1/generate`` shapes, checks and the routes it refuses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.sim.conftest import StartSims
from tests.sim.helpers import MODEL, chat_body, sse
from turnkv.sim.app import create_sim_app
from turnkv.sim.costs import CostModel
from turnkv.sim.engine import EngineConfig
from turnkv.sim.generate import NO_TOKENIZER_ERROR, TOKENS_ONLY_STOP_ERROR
from turnkv.sim.render import RenderCosts, RenderSettings, create_render_app
from turnkv.sim.settings import SimSettings

MESSAGES = [{"role": "user", "content": "Plan a trip to the sea"}]
BODY_026 = ["request_id", "model", "created", "choices", "usage", "prompt_logprobs", "kv_transfer_params"]
BODY_026 += ["ec_transfer_params"]
CHOICE_026 = ["index", "logprobs", "finish_reason", "token_ids", "routed_experts"]
CHOICE_033 = ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask"]
CHOICE_033 += ["weight_versions", "logprobs"]


@contextlib.asynccontextmanager
async def tokens_only(compat: str = "0.26", **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    engine = EngineConfig(compat=compat, costs=CostModel(time_scale=0), max_model_len=kw.pop("max_model_len", 40960))
    app = create_sim_app(SimSettings(tokens_only=True, engine=engine, **kw))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gen") as client,
    ):
        yield client


async def rendered(compat: str = "0.26", **extra: Any) -> dict[str, Any]:
    app = create_render_app(RenderSettings(compat=compat, costs=RenderCosts(time_scale=0)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as r:
        resp = await r.post("/v1/chat/completions/render", json=chat_body(MESSAGES, **extra))
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_generate_answers_in_token_ids(compat: str) -> None:
    gen = await rendered(compat, max_tokens=300)
    async with tokens_only(compat) as g:
        body = (await g.post("/inference/v1/generate", json=gen, headers={"x-request-id": "r1"})).json()
        events = sse(
            (await g.post("/inference/v1/generate", json={**gen, "stream": True, "return_token_ids": None})).text
        )
    assert body["request_id"] == "generate-tokens-r1"
    (choice,) = body["choices"]
    if compat == "0.26":
        assert list(body) == BODY_026 and list(choice) == CHOICE_026
        assert all(list(e) == ["request_id", "choices", "usage"] for e in events)
    else:
        assert list(choice) == CHOICE_033 and body["output_mode"] == "tokens"
        assert all(list(e) == ["request_id", "usage", "output_mode", "choices"] for e in events)
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == 2  # <|im_end|>, as the engine sampled it
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]  # the same prompt gives the same answer, streamed or not
    assert all("kv_transfer_params" not in e for e in events)
    assert body["usage"]["prompt_tokens"] == len(gen["token_ids"])


async def test_0_33_returns_the_prompt_ids_on_the_first_chunk_and_usage_last() -> None:
    gen = await rendered("0.33")
    async with tokens_only("0.33") as g:
        stream = {**gen, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
        events = sse((await g.post("/inference/v1/generate", json=stream)).text)
    assert events[0]["prompt_token_ids"] == gen["token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == len(gen["token_ids"])


@pytest.mark.parametrize("compat", ["0.26", "0.33"])
async def test_stop_strings_on_a_tokens_only_engine(compat: str) -> None:
    """0.33 refuses them (no detokenizer to match them with); 0.26 accepts them and never applies them."""
    gen = await rendered(compat, max_tokens=300)
    with_stop = {**gen, "sampling_params": {**gen["sampling_params"], "stop": [" "]}}
    async with tokens_only(compat) as g:
        plain = (await g.post("/inference/v1/generate", json=gen)).json()
        resp = await g.post("/inference/v1/generate", json=with_stop)
    if compat == "0.33":
        assert resp.status_code == 400 and resp.json()["error"]["message"] == TOKENS_ONLY_STOP_ERROR
    else:
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]  # " " never stopped it


async def test_max_tokens_left_out_runs_to_the_model_length() -> None:
    gen = await rendered(max_tokens=16, ignore_eos=True)  # 16 is SamplingParams' default: render leaves it out
    assert "max_tokens" not in gen["sampling_params"]
    async with tokens_only(max_model_len=200) as g:
        body = (await g.post("/inference/v1/generate", json=gen)).json()
        capped = await g.post(
            "/inference/v1/generate", json={**gen, "sampling_params": {**gen["sampling_params"], "max_tokens": 16}}
        )
    assert len(body["choices"][0]["token_ids"]) == 200 - len(gen["token_ids"])
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(capped.json()["choices"][0]["token_ids"]) == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"token_ids": [1, -2]}, "token_ids must not contain negative values"),
        ({"token_ids": []}, "at least 1 item"),
        ({"sampling_params": {"max_tokens": 1, "min_tokens": 5}}, "min_tokens must be less than or equal to"),
        ({"sampling_params": {"max_tokens": 0}}, "max_tokens must be at least 1, got 0."),
        ({"token_ids": [10**6]}, "out of vocabulary"),
        ({"model": "other"}, "The model `other` does not exist."),
    ],
)
async def test_generate_refuses_bad_requests(change: dict[str, Any], message: str) -> None:
    gen = await rendered()
    async with tokens_only() as g:
        resp = await g.post("/inference/v1/generate", json={**gen, **change})
    assert resp.status_code in (400, 404) and message in resp.json()["error"]["message"], resp.text


async def test_text_routes_need_a_tokenizer() -> None:
    async with tokens_only() as g:
        for path in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
            resp = await g.post(path, json=chat_body(MESSAGES))
            assert resp.status_code == 400 and resp.json()["error"]["message"] == NO_TOKENIZER_ERROR
        assert (await g.get("/health")).status_code == 200
        assert (await g.get("/v1/models")).json()["data"][0]["id"] == MODEL


@pytest.mark.integration
def test_abort_requests_ends_a_running_generate(sims: StartSims) -> None:
    r, g = sims(("r", "render"), ("g", "colocated", "--tokens-only", "--time-scale", "1", "--decode-itl-ms", "20"))
    gen = r.post("/v1/chat/completions/render", chat_body(MESSAGES, max_tokens=2000, ignore_eos=True)).json()
    with g.http.stream("POST", g.url + "/inference/v1/generate", json={**gen, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the first token is out: the request runs
        assert g.post("/abort_requests", {"request_ids": [gen["request_id"]]}).status_code == 200
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and len(rest) < 200  # ended long before its 2,000 tokens
    assert g.post("/abort_requests", {}).status_code == 400
