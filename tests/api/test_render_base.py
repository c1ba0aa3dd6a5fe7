"""Where renders, the template audit and the engine API passed through go (``Services.render_base``): the
render service, else a prefill engine the router picks. When the router has none to give, that is the
server's condition, never the client's: a passed-through call gets a 503, and so does a turn, which renders
nothing and finds no P either (it used to get a 400 invalid_request_error from its render)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from tests.api.test_extending import BASE, ToyEngines, running
from turnkv.config import Settings
from turnkv.engine.mock import MockEngine
from turnkv.gateway.app import create_app
from turnkv.gateway.services import Services
from turnkv.routing.base import InstanceView, NoParams, RouteRequest
from turnkv.routing.plugins import FILTERS

WAIT_S = 10.0


class UpOnly:
    """A filter that leaves out every engine that is down, even when that leaves none."""

    def __init__(self, params: NoParams) -> None:
        pass

    def filter(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        return [c for c in candidates if c.healthy]


class PrefillDown(MockEngine):
    async def health(self, base: str) -> bool:
        return base != "http://p.toy"


async def wait_until_down(svc: Services) -> None:
    deadline = time.monotonic() + WAIT_S
    while any(v.healthy for v in svc.fleet.views("prefill")):
        assert time.monotonic() < deadline, "the fleet did not see P go down"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
async def test_no_engine_to_render_on_is_the_servers_condition(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FILTERS, "up-only", (NoParams, UpOnly))
    settings = Settings(
        **BASE,
        health_interval_s=0.01,
        routing="strict",
        routing_profiles={"strict": {"filters": [{"type": "up-only"}]}},
    )
    toy = ToyEngines()
    engine = PrefillDown(toy, model="toy")
    app = create_app(settings, engine=engine)
    async with running(app) as (client, svc):
        await wait_until_down(svc)
        for path in ("/tokenize", "/detokenize"):
            r = await client.post(path, json={"model": "toy", "prompt": "hi", "tokens": [1]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        r = await client.get("/version")
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ih"}]
        body = {"model": "toy", "messages": [*history, {"role": "user", "content": "more"}], "stream": stream}
        r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s"})
        # no render, so no reuse; and no P to recompute on either
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        assert [type(c).__name__ for c in engine.calls] == []  # nothing reached an engine
