"""The gateway's front door, in process: API keys, admin-only views, CORS, in-flight caps, the body deadline
and a client that leaves mid-body. Engines are unreachable on purpose: a request that gets past the front
door ends in the engines' 503 (``upstream_unavailable``), one that does not ends in the door's own answer.

Requests that must stay in flight, or still arriving, are driven as ASGI calls on the app's own event loop
(the TestClient's portal), with a body that arrives only when the test says so; a request kept in flight
waits in an engine double (``engine.mock.MockEngine``) that answers only once the test opens it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from tests.asgi import chat_scope
from turnkv.config import Settings
from turnkv.engine.base import CallMeta, PrefillResult
from turnkv.engine.mock import Call, MockEngine, Prefill, Render, Reply
from turnkv.gateway.app import create_app

DOWN = "http://127.0.0.1:9"  # the discard port: nothing listens
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WAIT_S = 10.0


@contextmanager
def gateway(caplog: pytest.LogCaptureFixture, *, engine: Any = None, **over: Any) -> Iterator[TestClient]:
    # with an engine double, P and D are two engines (one URL for both is one engine: a decode engine)
    engines = {"prefill": [DOWN], "decode": [DOWN if engine is None else "http://127.0.0.2:9"]}
    settings = Settings(**{**engines, "models": ["m"], "template_audit": False, **over})
    app = create_app(settings, engine=engine)
    with caplog.at_level(logging.DEBUG), TestClient(app, raise_server_exceptions=False) as c:
        yield c
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


KEYS = ["sk-a acme", "sk-b beta", "sk-ops admin"]


def test_keys_are_required_and_checked(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog, api_keys=KEYS) as c:
        for headers in ({}, bearer("sk-unknown"), {"authorization": "sk-a"}, {"x-api-key": "sk-a"}):
            r = c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/models", "/version", "/metrics", "/v1/embeddings"):
            error_of(c.get(path), 401)
        error_of(c.post("/tokenize", json={"prompt": "x"}), 401)
        # a known key, its scheme in any case, gets through to the (unreachable) engines
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"{scheme} sk-a"})
            assert error_of(r, 503)["code"] == "upstream_unavailable"
        assert c.get("/health").json() == {"status": "ok"}


def test_ready_and_metrics_are_for_operators(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog, api_keys=KEYS) as c:
        for headers in ({}, bearer("sk-a"), bearer("sk-wrong")):
            r = c.get("/ready", headers=headers)
            assert r.status_code == 503 and r.json() == {"ready": False}  # a load balancer's answer, nothing more
        details = c.get("/ready", headers=bearer("sk-ops"))
        assert details.status_code == 503 and DOWN in details.text  # engine URLs, load, store, template
        assert error_of(c.get("/metrics", headers=bearer("sk-a")), 403)["code"] == "insufficient_permissions"
        metrics = c.get("/metrics", headers=bearer("sk-ops"))
        assert metrics.status_code == 200
        assert 'turnkv_rejected_requests_total{reason="invalid_api_key"} 0.0' in metrics.text  # none refused yet
        error_of(c.get("/metrics"), 401)
        refused = c.get("/metrics", headers=bearer("sk-ops")).text
        assert 'turnkv_rejected_requests_total{reason="invalid_api_key"} 1.0' in refused


def test_without_keys_everything_is_open_as_before(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog) as c:
        assert DOWN in c.get("/ready").text
        assert c.get("/metrics").status_code == 200
        error_of(c.post("/v1/chat/completions", json=CHAT), 503)


def test_tenant_header_needs_the_proxy_secret(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog, tenant_header="x-tenant", trusted_proxy_secret="s3cret") as c:
        error_of(c.post("/v1/chat/completions", json=CHAT, headers={"x-tenant": "acme"}), 401)
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-tenant": "acme", "x-turnkv-proxy-secret": "s3cret"})
        error_of(r, 503)


def test_cors_is_off_by_default_and_answers_preflights_when_on(caplog: pytest.LogCaptureFixture) -> None:
    pre = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    with gateway(caplog, api_keys=KEYS) as c:
        assert "access-control-allow-origin" not in c.options("/v1/chat/completions", headers=pre).headers
    with gateway(caplog, api_keys=KEYS, cors={"allow_origins": ["https://app.example"]}) as c:
        r = c.options("/v1/chat/completions", headers=pre)  # no key: a browser's preflight carries none
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options("/v1/chat/completions", headers={**pre, "origin": "https://evil.example"})
        assert other.status_code == 400
        refused = c.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://app.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
        exposed = {h.strip() for h in refused.headers["access-control-expose-headers"].split(",")}
        assert {"x-turnkv-conversation", "x-turnkv-divergence", "x-turnkv-reason", "x-request-id"} <= exposed


class Held:
    """An ASGI request whose body arrives only when released (or never); its response is collected."""

    def __init__(
        self, app: Any, state: dict[str, Any], body: bytes, headers: dict[str, str], path: str = "/v1/chat/completions"
    ) -> None:
        self.app, self.body = app, body
        self.scope = chat_scope(headers, state=state, path=path)
        self.reading = anyio.Event()  # the app asked for the body: it is past the front door
        self.release = anyio.Event()
        self.disconnect = False  # on release, the client is gone instead
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []

    async def receive(self) -> dict[str, Any]:
        self.reading.set()
        if not self.release.is_set():  # as a server's: a body already there is given without a wait
            await self.release.wait()
        if self.disconnect:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    def error(self) -> dict[str, Any]:
        err: dict[str, Any] = json.loads(b"".join(self.chunks))["error"]
        return err


def in_loop(c: TestClient, fn: Callable[[], Awaitable[None]]) -> None:
    assert c.portal is not None
    c.portal.call(fn)


def hold(
    c: TestClient, headers: dict[str, str], body: bytes = json.dumps(CHAT).encode(), path: str = "/v1/chat/completions"
) -> Held:
    return Held(c.app, c.app_state, body, headers, path)


class Gated(MockEngine):
    """Engines that answer each call (and /tokenize) only once the test opens them, counting who reached
    them: a request that did is in flight."""

    def __init__(self) -> None:
        super().__init__(self.answer, model="m")
        self.opened: anyio.Event | None = None  # made on the app's loop by the scenario
        self.reached = 0

    async def wait(self) -> None:
        self.reached += 1
        assert self.opened is not None, "the scenario opens the engines"
        await self.opened.wait()

    async def answer(self, call: Call) -> Any:
        await self.wait()
        if isinstance(call, Render):
            return [1, 2, 3]
        if isinstance(call, Prefill):
            return PrefillResult(for_decode={}, cached_tokens=0, prompt_tokens=3, prompt_ids=None)
        return Reply("ok", token_ids=[4])

    async def api_post(self, base: str, path: str, body: Any, meta: CallMeta) -> dict[str, Any]:
        await self.wait()
        return {"tokens": [1, 2, 3]}

    async def until_reached(self, n: int) -> None:
        with anyio.fail_after(WAIT_S):
            while self.reached < n:  # noqa: ASYNC110 - a count, not an event: polled, bounded
                await anyio.sleep(0.001)


def test_overload_is_a_503_with_retry_after_and_the_slot_comes_back(caplog: pytest.LogCaptureFixture) -> None:
    engine = Gated()
    with gateway(caplog, engine=engine, limits={"max_inflight": 2, "retry_after_s": 3}) as c:
        first, second, third, after = (hold(c, {}) for _ in range(4))
        for h in (first, second, third, after):
            h.release.set()  # every body arrives at once

        async def scenario() -> None:
            engine.opened = anyio.Event()
            async with anyio.create_task_group() as tg:
                for h in (first, second):
                    tg.start_soon(h.run)
                await engine.until_reached(2)  # both in flight
                await third.run()  # both places taken: refused at once
                engine.opened.set()
            await after.run()

        in_loop(c, scenario)
        assert third.status == 503 and third.headers["retry-after"] == "3"
        assert third.error()["code"] == "server_overloaded"
        for h in (first, second, after):
            assert h.status == 200, h.chunks


def test_a_tenant_over_its_limit_gets_429_others_are_served(caplog: pytest.LogCaptureFixture) -> None:
    engine = Gated()
    limits = {"max_inflight_per_tenant": 1, "max_inflight": 10}
    with gateway(caplog, engine=engine, api_keys=KEYS, limits=limits) as c:
        a1, a2, b1 = hold(c, bearer("sk-a")), hold(c, bearer("sk-a")), hold(c, bearer("sk-b"))
        for h in (a1, a2, b1):
            h.release.set()

        async def scenario() -> None:
            engine.opened = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(a1.run)
                await engine.until_reached(1)
                await a2.run()
                tg.start_soon(b1.run)
                await engine.until_reached(2)
                engine.opened.set()

        in_loop(c, scenario)
        assert a2.status == 429 and a2.error()["code"] == "rate_limit_exceeded" and a2.headers["retry-after"] == "1"
        assert a1.status == 200 and b1.status == 200


def test_a_stalled_upload_holds_no_place_in_flight(caplog: pytest.LogCaptureFixture) -> None:
    """A request takes its place in flight once its body is whole: stalled uploads hold only the small budget
    of requests still arriving, and a whole request is served beside them."""
    limits = {"max_inflight": 1, "max_arriving": 3, "reserve_share": 0, "body_timeout_s": WAIT_S / 2}
    with gateway(caplog, limits=limits) as c:
        stalled = [hold(c, {}) for _ in range(3)]  # their bodies never come
        over, whole = hold(c, {}), hold(c, {})
        whole.release.set()

        async def scenario() -> None:
            async with anyio.create_task_group() as tg:
                for h in stalled:
                    tg.start_soon(h.run)
                with anyio.fail_after(WAIT_S):
                    for h in stalled:
                        await h.reading.wait()
                    await over.run()  # a fourth body to wait for: refused at once
                    await whole.run()  # its body came whole: it takes the one place in flight
                tg.cancel_scope.cancel()  # the stalled clients leave

        in_loop(c, scenario)
        assert over.status == 503 and over.error()["code"] == "server_overloaded"
        assert whole.status == 503 and whole.error()["code"] == "upstream_unavailable"  # past the door: the engines


def test_a_body_that_never_finishes_is_a_408_that_closes(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog, limits={"body_timeout_s": 0.2, "max_inflight": 1}) as c:
        stalled, after = hold(c, {}), hold(c, {})

        async def scenario() -> None:
            with anyio.fail_after(WAIT_S):
                await stalled.run()  # its body never comes (never released)
            after.release.set()
            await after.run()

        in_loop(c, scenario)
        assert stalled.status == 408 and stalled.headers["connection"] == "close"
        assert stalled.error()["code"] == "request_timeout"
        assert after.status == 503 and after.error()["code"] == "upstream_unavailable"  # its slot came back
        assert 'turnkv_rejected_requests_total{reason="request_timeout"} 1.0' in c.get("/metrics").text


def test_a_client_gone_mid_body_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    with gateway(caplog, limits={"max_inflight": 1}) as c:
        gone, after = hold(c, {}), hold(c, {})
        gone.disconnect = True
        gone.release.set()
        after.release.set()

        async def scenario() -> None:
            with anyio.fail_after(WAIT_S):
                await gone.run()
                await after.run()

        in_loop(c, scenario)
        assert after.status == 503  # the gone client's slot came back
    said = [r for r in caplog.records if "client.gone" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # one debug line, no traceback (checked above)


@pytest.mark.parametrize(
    ("held_path", "other_path"),
    [
        ("/v1/chat/completions", "/tokenize"),
        ("/tokenize", "/v1/chat/completions"),
        ("/v1/responses", "/v1/completions"),
    ],
)
def test_turn_routes_and_the_others_share_one_admission_count(
    caplog: pytest.LogCaptureFixture, held_path: str, other_path: str
) -> None:
    """The turn routes skip Starlette's router (gateway/hot.py) but not the front door: a request held in
    flight on one way in takes the only place from a request on the other."""
    body = {"/v1/responses": {"model": "m", "input": "hi"}, "/tokenize": {"model": "m", "prompt": "hi"}}
    body["/v1/completions"] = body["/tokenize"]
    engine = Gated()
    with gateway(caplog, engine=engine, limits={"max_inflight": 1, "retry_after_s": 2}) as c:
        held = hold(c, {}, json.dumps(body.get(held_path, CHAT)).encode(), held_path)
        other = hold(c, {}, json.dumps(body.get(other_path, CHAT)).encode(), other_path)
        after = hold(c, {}, json.dumps(body.get(other_path, CHAT)).encode(), other_path)
        for h in (held, other, after):
            h.release.set()

        async def scenario() -> None:
            engine.opened = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(held.run)
                await engine.until_reached(1)
                with anyio.fail_after(WAIT_S):
                    await other.run()  # refused at once: its body is never read
                engine.opened.set()
            with anyio.fail_after(WAIT_S):
                await after.run()

        in_loop(c, scenario)
        assert other.status == 503 and other.error()["code"] == "server_overloaded" and not other.reading.is_set()
        for h in (held, after):
            assert h.status == 200, h.chunks
