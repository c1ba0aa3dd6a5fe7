"""Derender that scales (``turnkv.derender``) against the simulated render service and tokens-only engine, in
process: a streamed answer adds up to exactly the non-streaming derender's, which is the colocated engine's
answer, whichever way it is derendered, with a render service call count that does not grow with its square."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.sim.helpers import asgi_client, chat_body, sse
from turnkv.derender import (
    Chunk,
    Delta,
    Derender,
    DerenderConfig,
    Ending,
    FlushPolicy,
    RenderClient,
    reasoning_open,
    relay,
)
from turnkv.errors import UpstreamStatus
from turnkv.sim.app import create_sim_app
from turnkv.sim.costs import CostModel
from turnkv.sim.engine import EngineConfig
from turnkv.sim.render import RenderCosts, RenderSettings, create_render_app
from turnkv.sim.settings import SimSettings
from turnkv.sim.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
QUESTIONS = ["Plan a trip to the sea", "Weather in Paris?", "What should I pack?", "Budget for a week?"]


class AsgiPoster:
    """A ``Poster`` onto an in-process app."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def __call__(self, leg: str, base: str, path: str, body: Any) -> Any:
        r = await self.client.post(path, json=body)
        if r.status_code >= 400:
            raise UpstreamStatus(r.status_code, r.json(), leg=leg, instance=base)
        return r.json()


@contextlib.asynccontextmanager
async def four_hop_parts(compat: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, RenderClient]]:
    render = create_render_app(RenderSettings(compat=compat, costs=RenderCosts(time_scale=0)))
    engine = EngineConfig(compat=compat, costs=CostModel(time_scale=0))
    gen = create_sim_app(SimSettings(tokens_only=True, engine=engine))
    async with (
        gen.router.lifespan_context(gen),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=render), base_url="http://render") as r,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=gen), base_url="http://gen") as g,
    ):
        yield r, g, RenderClient(["http://render"], AsgiPoster(r))


async def d_chunks(g: httpx.AsyncClient, rendered: dict[str, Any]) -> list[Chunk]:
    events = sse((await g.post("/inference/v1/generate", json={**rendered, "stream": True})).text)
    return [Chunk(c["choices"][0]["token_ids"], c["choices"][0]["finish_reason"]) for c in events if c["choices"]]


async def listed(chunks: list[Chunk]) -> AsyncIterator[Chunk]:
    for c in chunks:
        yield c


async def stream_through(
    derender: Derender, rendered: dict[str, Any], chunks: list[Chunk], client: dict[str, Any], policy: FlushPolicy
) -> tuple[Delta, Ending]:
    d = derender.stream(
        model=client["model"],
        prompt_ids=rendered["token_ids"],
        chat_request=client,
        request_id=rendered["request_id"],
        reasoning_open=reasoning_open(rendered, client),
    )
    reasoning = content = ""
    ending = None
    async for x in relay(listed(chunks), d, policy, request_id=rendered["request_id"]):
        if isinstance(x, Ending):
            ending = x
            x = x.rest
        reasoning += x.reasoning
        content += x.content
        for marker in ("<think>", "</think>", "<tool_call>", "<|im_end|>"):
            assert marker not in x.content + x.reasoning
    assert ending is not None
    return Delta(reasoning, content, ending.rest.tool_calls), ending


async def streamed_truth(colocated: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    events = sse((await colocated.post("/v1/chat/completions", json={**body, "stream": True})).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    named = [{"function": {"name": c["function"]["name"], "arguments": ""}} for c in calls if "id" in c]
    for c in calls:
        if "id" not in c:
            named[-1]["function"]["arguments"] += c["function"].get("arguments", "")
    message = {
        "content": "".join(d.get("content") or "" for d in deltas) or None,
        "reasoning": "".join(d.get("reasoning") or "" for d in deltas) or None,
        "tool_calls": named,
    }
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    return {"message": message, "finish_reason": finish[-1]}


def clients() -> list[dict[str, Any]]:
    out = []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        out.append(chat_body(messages, max_tokens=400))
        out.append(chat_body(messages, max_tokens=400, tools=TOOLS, tool_choice="required" if i % 2 else "auto"))
        out.append(chat_body(messages, max_tokens=400, chat_template_kwargs={"enable_thinking": False}))
        out.append(chat_body(messages, max_tokens=12))  # cut off mid-answer: finish "length"
    return out


@pytest.mark.parametrize(
    ("compat", "mode", "local"),
    [
        ("0.26", "incremental", True),
        ("0.26", "incremental", False),
        ("0.33", "incremental", False),
        ("0.33", "vllm-stream", False),
        ("0.26", "final", False),
    ],
)
async def test_a_streamed_answer_adds_up_to_the_colocated_one(compat: str, mode: str, local: bool) -> None:
    tok = Tokenizer()
    version = (0, 26) if compat == "0.26" else (0, 33)
    async with four_hop_parts(compat) as (r, g, client), asgi_client(compat=compat) as colocated:
        config = DerenderConfig(mode=mode, policy=FlushPolicy(max_tokens=5, max_delay_s=10.0))  # type: ignore[arg-type]
        derender = Derender(client, version, config, local_decode=tok.decode if local else None)
        for body in clients():
            rendered = (await r.post("/v1/chat/completions/render", json=body)).json()
            chunks = await d_chunks(g, rendered)
            calls_before = client.calls
            streamed, ending = await stream_through(derender, rendered, chunks, body, config.policy)
            if mode == "vllm-stream":  # vLLM's streamed answer: what its own chat stream gives
                truth = await streamed_truth(colocated, body)
            else:
                truth = (await colocated.post("/v1/chat/completions", json=body)).json()["choices"][0]
            want = truth["message"]
            a = ending.answer
            assert not ending.diverged
            assert (a.content, a.reasoning) == (want["content"], want["reasoning"])
            assert a.finish_reason == truth["finish_reason"]
            assert [(c.name, c.arguments) for c in a.tool_calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in want.get("tool_calls") or []
            ]
            assert streamed.content == (a.content or "") and streamed.reasoning == (a.reasoning or "")
            assert streamed.tool_calls == a.tool_calls
            n = sum(len(c.token_ids) for c in chunks)
            calls = client.calls - calls_before
            if mode == "incremental" and local:
                assert calls == 1  # the final derender only
            elif mode == "final":
                assert calls == 1
            else:
                assert calls <= 2 * (n // 5 + 2) + 1  # a flush per five ids (a detokenize, two where it re-anchors)


async def test_a_derender_refusal_carries_the_render_services_reason() -> None:
    async with four_hop_parts("0.33") as (r, g, client):
        derender = Derender(client, (0, 33))
        body = chat_body([{"role": "user", "content": "Hi"}])
        rendered = (await r.post("/v1/chat/completions/render", json=body)).json()
        chunks = await d_chunks(g, rendered)
        d = derender.stream(
            model="other",
            prompt_ids=rendered["token_ids"],
            chat_request=body,
            request_id="x",
            reasoning_open=True,
        )
        with pytest.raises(UpstreamStatus) as err:
            async for _ in relay(listed(chunks), d, FlushPolicy(), request_id="x"):
                pass
    assert err.value.status == 404 and err.value.body()["error"]["message"] == "The model `other` does not exist."
