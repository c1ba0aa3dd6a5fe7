"""The bare relays the overhead suite measures turnkv against: they must relay, byte for byte, or their CPU
figures are not baselines. A real simulated engine and the relay as its own process on loopback, served by
aiohttp.web and by uvicorn (a bare ASGI app, turnkv's server stack)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from turnkv import launch
from turnkv.bench.baseline_relay import SERVERS

pytestmark = pytest.mark.integration

BODY = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "héllo"}],
    "max_tokens": 8,
    "stream": True,
    "seed": 3,
    "temperature": 0,
}


@pytest.fixture(scope="module", params=SERVERS)
def urls(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    eng = launch.sim("colocated", "colocated", "--time-scale", "0", "--no-thinking")
    try:
        flags = ["--upstream", eng.url, "--server", request.param]
        relay = launch.spawn("relay", flags, module="turnkv.bench.baseline_relay")
        try:
            yield eng.url, relay.url
        finally:
            assert relay.stop() in (0, -15)
    finally:
        eng.stop()


async def _post(s: aiohttp.ClientSession, url: str, body: object) -> tuple[int, str, bytes]:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, r.content_type, await r.read()


async def test_streams_and_errors_are_relayed_unchanged_under_concurrency(urls: tuple[str, str]) -> None:
    eng, relay = urls
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        direct = await _post(s, eng, BODY)
        relayed = await asyncio.gather(*(_post(s, relay, BODY) for _ in range(16)))
        bad_direct = await _post(s, eng, {"messages": "nope"})
        bad_relayed = await _post(s, relay, {"messages": "nope"})
    assert direct[0] == 200 and direct[1] == "text/event-stream" and direct[2].endswith(b"data: [DONE]\n\n")
    # ids and timestamps differ per answer: compare the chunks' content
    for status, ctype, data in relayed:
        assert (status, ctype) == (200, "text/event-stream")
        assert _contents(data) == _contents(direct[2])
    assert bad_direct[0] >= 400 and bad_relayed[:2] == bad_direct[:2]


def _contents(data: bytes) -> list[str]:
    out = []
    for line in data.decode().split("\n\n"):
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            out += [c.get("delta", {}).get("content") or "" for c in chunk.get("choices", [])]
    return out


@pytest.fixture(scope="module", params=SERVERS)
def pd_urls(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    flags = ("--time-scale", "0", "--no-thinking", "--vllm-compat", "0.33")
    p = launch.sim("prefill", "prefill", *flags)
    d = launch.sim("decode", "decode", *flags)
    try:
        relay = launch.spawn(
            "pd-relay",
            ["--prefill", p.url, "--upstream", d.url, "--server", request.param],
            module="turnkv.bench.baseline_relay",
        )
        try:
            yield p.url, relay.url
        finally:
            assert relay.stop() in (0, -15)
    finally:
        d.stop()
        p.stop()


async def _prompt_tokens(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:prompt_tokens_total{"))


async def test_the_bare_pd_relay_runs_the_handshake_and_answers_as_a_colocated_engine(
    urls: tuple[str, str], pd_urls: tuple[str, str]
) -> None:
    # the floor the suite measures stateless turns against: P prefills every request (its counters move),
    # D's answer is what one engine computing the whole request answers, and P's errors reach the client
    eng, _ = urls
    p, relay = pd_urls
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        truth = await _post(s, eng, BODY)
        before = await _prompt_tokens(s, p)
        relayed = await asyncio.gather(*(_post(s, relay, BODY) for _ in range(16)))
        after = await _prompt_tokens(s, p)
        bad = await _post(s, relay, {"model": "sim-model", "messages": "nope"})
    for status, ctype, data in relayed:
        assert (status, ctype) == (200, "text/event-stream")
        assert _contents(data) == _contents(truth[2]) and data.endswith(b"data: [DONE]\n\n")
    assert after - before >= 16  # every request prefilled on P
    assert bad[0] == 400 and json.loads(bad[2])["error"]
