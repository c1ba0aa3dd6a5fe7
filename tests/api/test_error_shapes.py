"""One error shape for everything the gateway answers, per API: OpenAI's on its paths, Anthropic's on
``/v1/messages``; unknown routes and methods, endpoints turnkv does not serve (a 501 that says so), pooling
endpoints passed to an engine that serves them, and the edge's refusals alike.

In process: the whole gateway over the simulator-backed engines (``tests.pipeline.harness``)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.pipeline.harness import P0, gateway
from tests.sim_engine import MODEL, SimEngine
from turnkv.engine.base import CallMeta

ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "request_too_large"}


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, r.text
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return str(body["error"]["message"])


async def test_unknown_routes_methods_and_unserved_endpoints_are_openai_errors() -> None:
    async with gateway() as gw:
        c = gw.client
        missing = openai_error(await c.get("/v1/nothing", headers={"x-request-id": "r-1"}), 404, "unknown_url")
        assert missing["message"] == "Invalid URL (GET /v1/nothing)"
        r = await c.delete("/v1/models")
        assert openai_error(r, 405, "method_not_allowed") and r.headers["allow"]
        for method, path in (("POST", "/v1/audio/speech"), ("GET", "/v1/files"), ("POST", "/v1/batches")):
            err = openai_error(await c.request(method, path, json={}), 501, "unsupported_endpoint")
            assert path in err["message"]
        # a generative model's engines serve no embeddings: said so, not the engine's bare 404
        err = openai_error(await c.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}), 501)
        assert "/v1/embeddings" in err["message"] and "pooling" in err["message"]


class EmbeddingEngine(SimEngine):
    """Engines of a pooling model: they serve /v1/embeddings."""

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        if path == "/v1/embeddings":
            self[base].calls.append("embeddings")
            return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]}
        return await super().api_post(base, path, body, meta)


async def test_embeddings_pass_to_an_engine_that_serves_them() -> None:
    engine = EmbeddingEngine([P0], ["http://d0.fake"])
    async with gateway(engine) as gw:
        r = await gw.client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.5, 0.25]
        assert engine[P0].calls.count("embeddings") == 1
        openai_error(await gw.client.post("/v1/embeddings", json={"model": "other", "input": "hi"}), 404)


async def test_the_anthropic_api_answers_every_error_in_anthropics_shape() -> None:
    async with gateway(api_keys=["sk-a"], max_body_bytes=4096) as gw:
        c = gw.client
        key = {"x-api-key": "sk-a"}
        hi = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        assert "x-api-key" in anthropic_error(await c.post("/v1/messages", json=hi), 401, "authentication_error")
        anthropic_error(await c.post("/v1/messages", json=hi, headers={"x-api-key": "no"}), 401, "authentication_error")
        # the key goes in x-api-key on Anthropic's API only
        openai_error(await c.post("/v1/chat/completions", json=hi, headers=key), 401, "invalid_api_key")
        anthropic_error(await c.post("/v1/messages/nothing", json={}, headers=key), 404, "not_found_error")
        anthropic_error(await c.post("/v1/messages/batches", json={}, headers=key), 501, "invalid_request_error")
        big = {**hi, "system": "x" * 5000}
        anthropic_error(await c.post("/v1/messages", json=big, headers=key), 413, "request_too_large")
        r = await c.post("/v1/messages", content=b"{", headers={**key, "x-request-id": "r-2"})
        assert "not valid JSON" in anthropic_error(r, 400, "invalid_request_error")
        assert r.headers["request-id"] == "r-2" and r.json()["request_id"] == "r-2"
