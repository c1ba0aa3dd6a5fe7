"""docs/extending.md's recipes, each followed by a toy: an engine family behind the seam, a front end through
``prepare_turn``, a reuse policy and a routing plugin, each running turns through the whole gateway in
process (httpx over ASGI, the app's lifespan running)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from turnkv.config import Settings
from turnkv.engine.base import PrefillResult
from turnkv.engine.mock import Call, Decode, MockEngine, Prefill, Render, Reply, WriteBackCall
from turnkv.errors import ClientError, ConfigError
from turnkv.gateway.app import ROUTES, create_app
from turnkv.gateway.hot import TurnRoute
from turnkv.gateway.intake import prepare_turn, receive
from turnkv.gateway.services import Services
from turnkv.gateway.turn.driver import run_turn
from turnkv.reuse.assess import Reason
from turnkv.reuse.cost import Action, CostParams, TurnFacts
from turnkv.reuse.decision import Decision, Keep, PolicyParams
from turnkv.reuse.policies import POLICIES
from turnkv.routing.base import InstanceView, Params, RouteRequest
from turnkv.routing.plugins import SCORERS

P, D = "http://p.toy", "http://d.toy"
ROLES = {"system": 1, "user": 2, "assistant": 3}
END = 4  # ends a message
BASE: dict[str, Any] = {
    "prefill": [P],
    "decode": [D],
    "models": ["toy"],
    "decision_headers": "full",
    "template_audit": False,
}


def toy_render(messages: Sequence[Mapping[str, Any]], generation: bool = True) -> list[int]:
    """A toy chat template over a toy tokenizer: a role id, one id per character, an end id."""
    ids: list[int] = []
    for m in messages:
        ids += [ROLES[str(m["role"])], *map(ord, str(m.get("content") or "")), END]
    return ids + ([ROLES["assistant"]] if generation else [])


class ToyEngines:
    """The handler of a ``MockEngine``: P and D of a toy family. D answers with the user's last words
    reversed and, when it took P's KV, pins its sequence under a handle of its own."""

    def __init__(self) -> None:
        self.pins: dict[str, int] = {}  # D's pinned sequences: pin id -> tokens
        self.pulled: list[tuple[str, int]] = []  # (pin id, tokens) of each pull P made

    def __call__(self, call: Call) -> Any:
        if isinstance(call, Render):
            return toy_render(call.body["messages"])
        if isinstance(call, Prefill):
            return self.prefill(call)
        if isinstance(call, Decode):
            return self.decode(call)
        handle = call.call.handle if isinstance(call, WriteBackCall) else call.handle
        self.pins.pop(str(handle["pin"]), None)  # a release, or a write-back: D frees the blocks
        return None

    def prefill(self, call: Prefill) -> PrefillResult:
        ids = list(call.call.prompt_ids or toy_render(call.call.body["messages"]))
        pulled = 0
        if call.call.handle is not None:
            pin = str(call.call.handle.handle["pin"])
            assert pin in self.pins, "P pulls only a pin D holds"
            del self.pins[pin]
            pulled = call.call.handle.tokens
            if pulled:
                self.pulled.append((pin, pulled))
        return PrefillResult(
            for_decode={"staged": len(ids)},
            cached_tokens=pulled,
            prompt_tokens=len(ids),
            prompt_ids=ids if call.call.return_ids else None,
        )

    def decode(self, call: Decode) -> Reply:
        ids = list(call.call.prompt_ids or toy_render(call.call.body["messages"]))
        words = str(call.call.body["messages"][-1]["content"])[::-1]
        answer = [*map(ord, words), END]
        handle = None
        if call.call.for_decode is not None:  # D took P's KV: it pins the sequence for a next turn
            pin = f"d-{len(self.pins) + len(self.pulled)}"
            self.pins[pin] = len(ids) + len(answer) - 1
            handle = {"pin": pin, "tokens": self.pins[pin]}
        return Reply(words, token_ids=answer, prompt_ids=ids, handle=handle)


class ToyEngine(MockEngine):
    """The toy family with a rule of its own on what clients send (as vLLM's on ``kv_transfer_params``)."""

    def check_request(self, body: Mapping[str, Any]) -> None:
        if "toy_kv" in body:
            raise ClientError("toy_kv is set by turnkv, not by clients", param="toy_kv")


@contextlib.asynccontextmanager
async def running(app: Starlette) -> AsyncIterator[tuple[httpx.AsyncClient, Services]]:
    """The app with its lifespan running, and a client of it."""
    async with app.router.lifespan_context(app) as state:
        assert state is not None
        lifespan_state = dict(state)

        async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
            scope["state"] = dict(lifespan_state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test", timeout=30) as client:
            yield client, lifespan_state["services"]


def conversation(n: int) -> list[dict[str, Any]]:
    """The first ``n`` turns' messages of a conversation with the toy D (long enough to fill blocks)."""
    messages: list[dict[str, Any]] = []
    for i in range(n):
        words = f"turn {i}: the quick brown fox jumps over the lazy dog"
        messages.append({"role": "user", "content": words})
        if i < n - 1:
            messages.append({"role": "assistant", "content": words[::-1]})
    return messages


async def test_a_toy_engine_family_behind_the_seam_runs_a_conversation_that_reuses_ds_kv() -> None:
    toy = ToyEngines()
    engine = MockEngine(toy, model="toy")
    app = create_app(Settings(**BASE, policy={"name": "always-pull"}), engine=engine)
    async with running(app) as (client, _):
        for n, stream in ((1, False), (2, True), (3, False)):
            body = {"model": "toy", "messages": conversation(n), "stream": stream}
            r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "toy-1"})
            assert r.status_code == 200, r.text
            words = conversation(n)[-1]["content"][::-1]
            assert words in r.text  # the toy D's answer, as a client of the plain engine gets it
            assert "pin" not in r.text  # D's handle is the gateway's, never the client's
            if n > 1:
                assert (r.headers["x-turnkv-outcome"], r.headers["x-turnkv-action"]) == ("full", "pull")
        # each later turn pulled the pin the turn before it left on D, and only the last one is still pinned
        assert [pin for pin, _ in toy.pulled] == ["d-0", "d-1"]
        assert list(toy.pins) == ["d-2"]
    assert toy.pins == {}  # a gateway without a shared store gives every pin back when it stops


async def toy_front_end(request: Request) -> Response:
    """``POST /v1/toy``: ``{"model", "asked": [questions...], "answered": [answers...]}`` in, ``{"answer"}``
    out; the conversation is named by ``X-Session-ID``, as for chat."""
    received = await receive(request)  # drain, body limits, the engine's rules, the model: as every turn
    asked, answered = received.body.get("asked"), received.body.get("answered", [])
    if not isinstance(asked, list) or not isinstance(answered, list) or len(asked) != len(answered) + 1:
        raise ClientError("asked: one more question than answers", param="asked")
    messages: list[dict[str, Any]] = []
    for i, q in enumerate(asked):
        messages.append({"role": "user", "content": q})
        if i < len(answered):
            messages.append({"role": "assistant", "content": answered[i]})
    turn = prepare_turn(received, {"model": received.body.get("model"), "messages": messages})
    answer = await run_turn(received.svc, turn)
    chat = json.loads(bytes(answer.body))
    reused = answer.headers.get("x-turnkv-outcome", "")
    return JSONResponse({"answer": chat["choices"][0]["message"]["content"], "reused": reused})


@pytest.mark.parametrize("cors", [False, True], ids=["fast_path", "through_starlette"])
async def test_a_toy_front_end_comes_in_the_one_way_and_its_turns_reuse(cors: bool) -> None:
    toy = ToyEngines()
    settings = Settings(**BASE, policy={"name": "always-pull"}, cors={"allow_origins": ["*"] if cors else []})
    app = create_app(
        settings, engine=ToyEngine(toy, model="toy"), routes=[*ROUTES, TurnRoute("/v1/toy", toy_front_end)]
    )
    session = {"x-session-id": "toy-front-end"}
    async with running(app) as (client, _):
        asked = [m["content"] for m in conversation(3) if m["role"] == "user"]
        answered: list[str] = []
        for n in range(1, 4):
            r = await client.post(
                "/v1/toy", json={"model": "toy", "asked": asked[:n], "answered": answered}, headers=session
            )
            assert r.status_code == 200, r.text
            assert r.json()["answer"] == asked[n - 1][::-1]
            assert r.json()["reused"] == ("full" if n > 1 else "none")
            answered.append(r.json()["answer"])
        # what every front end refuses, this one refuses too, before any engine call
        calls = len(toy.pulled)
        bad = [
            ({"model": "gpt-9", "asked": ["hi"]}, 404, "model"),
            ({"model": "toy", "asked": ["hi"], "toy_kv": {}}, 400, "toy_kv"),
            ({"model": "toy", "asked": "hi"}, 400, "asked"),
        ]
        for body, status, param in bad:
            r = await client.post("/v1/toy", json=body, headers=session)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
        assert len(toy.pulled) == calls


class PullAtLeastParams(PolicyParams):
    min_tokens: int = 0


class PullAtLeast:
    """A toy reuse policy: pull D's KV when at least ``min_tokens`` of it match, else recompute (and say so)."""

    name = "pull-at-least"
    checks_tokens = True
    may_decode_local = False
    may_decode_local_first = False

    def __init__(self, params: PullAtLeastParams) -> None:
        self.min_tokens = params.min_tokens

    def decide(self, facts: TurnFacts, costs: CostParams) -> Decision:
        if facts.reusable_tokens > 0 and facts.reusable_tokens >= self.min_tokens:
            return Decision(Action.PULL)
        return Decision(Action.RECOMPUTE, Reason.CHEAPER_TO_RECOMPUTE if facts.reusable_tokens else None)

    def keeps_pin(self, facts: TurnFacts, costs: CostParams) -> Keep:
        return Keep.PULL if facts.reusable_tokens >= self.min_tokens else Keep.NOT_NEEDED


@pytest.mark.parametrize(
    ("min_tokens", "action", "reason"), [(1, "pull", "full_match"), (10**6, "recompute", "cheaper_to_recompute")]
)
async def test_a_toy_policy_registered_by_name_decides_the_turns(
    monkeypatch: pytest.MonkeyPatch, min_tokens: int, action: str, reason: str
) -> None:
    monkeypatch.setitem(POLICIES, "pull-at-least", (PullAtLeastParams, PullAtLeast))
    settings = Settings(**BASE, policy={"name": "pull-at-least", "params": {"min_tokens": min_tokens}})
    toy = ToyEngines()
    async with running(create_app(settings, engine=MockEngine(toy, model="toy"))) as (client, svc):
        assert svc.policy.name == "pull-at-least"
        for n in (1, 2):
            body = {"model": "toy", "messages": conversation(n)}
            r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "toy-policy"})
            assert r.status_code == 200, r.text
        assert r.headers["x-turnkv-action"] == action
        assert r.headers["x-turnkv-reason"] == reason
        assert bool(toy.pulled) is (action == "pull")


async def test_an_unknown_policy_refuses_the_start() -> None:
    app = create_app(Settings(**BASE, policy={"name": "pull-at-least"}), engine=MockEngine(ToyEngines()))
    with pytest.raises(ConfigError, match="unknown policy 'pull-at-least'"):
        async with running(app):
            pass


class PreferUrl:
    """A toy routing scorer: 1 for the engines whose URL ends with ``suffix``, 0 for the others."""

    def __init__(self, params: PreferUrlParams) -> None:
        self.suffix = params.suffix

    def score(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[float]:
        return [1.0 if c.url.endswith(self.suffix) else 0.0 for c in candidates]


class PreferUrlParams(Params):
    suffix: str


async def test_a_toy_routing_plugin_in_a_profile_of_ones_own_picks_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCORERS, "prefer-url", (PreferUrlParams, PreferUrl))
    second = "http://d2.toy"
    profile = {"scorers": [{"type": "prefer-url", "params": {"suffix": "d2.toy"}}]}
    settings = Settings(**{**BASE, "decode": [D, second]}, routing="mine", routing_profiles={"mine": profile})
    engine = MockEngine(ToyEngines(), model="toy")
    async with running(create_app(settings, engine=engine)) as (client, _):
        for session in ("a", "b", "c"):
            body = {"model": "toy", "messages": conversation(1)}
            r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
            assert r.status_code == 200, r.text
    assert {c.base for c in engine.calls if isinstance(c, Decode)} == {second}
    with pytest.raises(ValueError, match="suffix"):  # its parameters are checked at start
        Settings(**BASE, routing="mine", routing_profiles={"mine": {"scorers": [{"type": "prefer-url"}]}})
