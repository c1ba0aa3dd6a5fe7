"""The gateway in process, over the simulator-backed engine: the whole app (edge, routes, the turn pipeline, the store,
the background loops) on the test's own event loop, driven through httpx, its turn log read as it is
written. Nothing in the gateway is replaced but the engines (``tests.sim_engine``) and, where a test
needs one, the store."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from tests.sim_engine import MODEL, SimEngine
from turnkv.config import Settings
from turnkv.errors import StoreBusy, StoreError
from turnkv.gateway.app import create_app
from turnkv.gateway.services import Services
from turnkv.openai.sse import DONE, SSESplitter
from turnkv.state.base import Claim, ConversationStore
from turnkv.state.memory import MemoryRecords, MemoryStore
from turnkv.state.record import ConversationRecord

P0, P1 = "http://p0.fake", "http://p1.fake"
D0, D1 = "http://d0.fake", "http://d1.fake"
WAIT_S = 10.0


@dataclass
class Answer:
    status: int
    headers: Mapping[str, str]
    message: dict[str, Any]  # the assistant message, assembled from the stream when streamed
    body: dict[str, Any] = field(default_factory=dict)  # the JSON body, or the error event
    events: list[dict[str, Any]] = field(default_factory=list)  # a stream's events, [DONE] left out
    done: bool = False  # a stream ended with [DONE]

    @property
    def reason(self) -> str:
        return self.headers["x-turnkv-reason"]

    @property
    def action(self) -> str:
        return self.headers["x-turnkv-action"]

    @property
    def outcome(self) -> str:
        return self.headers["x-turnkv-outcome"]

    @property
    def error(self) -> dict[str, Any] | None:
        if self.status >= 400:
            return dict(self.body.get("error") or {})
        errors = [e["error"] for e in self.events if "error" in e]
        return dict(errors[-1]) if errors else None


def assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a client builds from chat chunks."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        for choice in e.get("choices") or []:
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning") or "")
            for c in delta.get("tool_calls") or []:
                slot = calls.setdefault(
                    c["index"], {"id": c.get("id"), "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["function"]["name"] += c["function"].get("name") or ""
                slot["function"]["arguments"] += c["function"].get("arguments") or ""
    m: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if "".join(reasoning):
        m["reasoning"] = "".join(reasoning)
    if calls:
        m["tool_calls"] = [calls[i] for i in sorted(calls)]
    return m


class TurnLog(logging.Handler):
    """The gateway's ``turn`` events, as dicts, in the order they were written."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = json.loads(record.getMessage())
        if event.get("event") == "turn":
            self.events.append(event)


@dataclass
class Gateway:
    client: httpx.AsyncClient
    svc: Services
    engine: SimEngine
    log: TurnLog
    app: Callable[[Scope, Receive, Send], Awaitable[None]]

    @property
    def turns(self) -> list[dict[str, Any]]:
        return self.log.events

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``. Read from its own collector:
        tests poll this on the gateway's loop, and the whole registry (every label value at 0) is slow."""
        collector = self.svc.metrics.registry._names_to_collectors.get(name)
        families = collector.collect() if collector is not None else []
        want = labels.items()
        return sum(s.value for f in families for s in f.samples if s.name == name and want <= s.labels.items())

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        session: str | None = None,
        stream: bool = False,
        headers: Mapping[str, str] | None = None,
        **body: Any,
    ) -> Answer:
        h = {"x-session-id": session} if session else {}
        req = {"model": MODEL, "messages": messages, "stream": stream, **body}
        r = await self.client.post("/v1/chat/completions", json=req, headers={**h, **(headers or {})})
        return read_answer(r, stream)

    async def wait_for(self, what: str, predicate: Callable[[], bool]) -> None:
        """Wait (bounded) for an effect of the gateway's background loops."""
        import asyncio

        deadline = time.monotonic() + WAIT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.005)


def read_answer(r: httpx.Response, stream: bool) -> Answer:
    if r.status_code >= 400 or not stream:
        body = r.json()
        choices = body.get("choices") or [{}]
        message = dict(choices[0].get("message") or {})
        message.pop("reasoning_content", None)
        return Answer(
            r.status_code, r.headers, {k: v for k, v in message.items() if v is not None or k == "content"}, body
        )
    splitter = SSESplitter()
    events: list[dict[str, Any]] = []
    done = False
    for payload in splitter.feed(r.content):
        if payload == DONE:
            done = True
            continue
        events.append(json.loads(payload))
    err = next((e for e in events if "error" in e), None)
    return Answer(r.status_code, r.headers, assemble(events), err or {}, events, done)


def settings(**over: Any) -> Settings:
    base: dict[str, Any] = {
        "prefill": [P0],
        "decode": [D0],
        "models": [MODEL],
        "decision_headers": "full",
        "health_interval_s": 0.01,
        "scrape_interval_s": 0.01,
        "policy": {"name": "always-pull"},
        "conversation_from_history": False,
        "log_json": True,
    }
    return Settings(**{**base, **over})


@contextlib.asynccontextmanager
async def gateway(
    engine: SimEngine | None = None, *, store: ConversationStore | None = None, **over: Any
) -> AsyncIterator[Gateway]:
    """The gateway app with its lifespan running, over ``engine`` (a fake P0 and D0 by default)."""
    s = settings(**over)
    engine = engine or SimEngine(s.prefill, s.decode)
    app = create_app(s, engine=engine, store=store)
    log = TurnLog()
    logger = logging.getLogger("turnkv.turn")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        async with app.router.lifespan_context(app) as state:
            assert state is not None
            lifespan_state = dict(state)

            async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
                scope["state"] = dict(lifespan_state)  # what a server's lifespan hands each request
                await app(scope, receive, send)

            transport = httpx.ASGITransport(app=with_state)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test", timeout=30) as client:
                gw = Gateway(client, lifespan_state["services"], engine, log, with_state)
                yield gw
                await settled(gw)
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)


async def settled(gw: Gateway) -> None:
    """After a test: every turn ended, every decode answer closed and every in-flight count back to 0."""
    svc = gw.svc
    await gw.wait_for("every turn to end", lambda: svc.drain.in_flight == 0)
    for view in (*svc.fleet.views("prefill"), *svc.fleet.views("decode")):
        assert view.in_flight == 0, f"{view.url} still counts {view.in_flight} in flight"
    for inst in gw.engine.instances.values():
        assert inst.running == 0, f"{inst.url} still streams {inst.running} answers"


class EditableStore(MemoryStore):
    """The in-process store, with a way to change a record as a turn claims it (an expired handle, another
    tenant's record, another block size) and to fail, or be too busy to answer, on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.edit: Callable[[ConversationRecord], ConversationRecord] | None = None
        self.failing: set[str] = set()  # operations that raise StoreError
        self.busy: set[str] = set()  # operations that raise StoreBusy (every connection in use)
        self.records = _EditableRecords(self)

    def check(self, op: str) -> None:
        if op in self.busy:
            raise StoreBusy(f"{op}: no connection came free")
        if op in self.failing or "all" in self.failing:
            raise StoreError(f"{op} failed on purpose")


class _EditableRecords(MemoryRecords):
    def __init__(self, store: EditableStore) -> None:
        super().__init__(store._table)
        self._store = store

    async def claim(self, key: str, *, owner: str) -> Claim:
        self._store.check("claim")
        claim = await super().claim(key, owner=owner)
        edit = self._store.edit
        if edit is not None and claim.record is not None:
            self._store.edit = None
            return Claim(claim.status, edit(claim.record))
        return claim

    async def put(self, key: str, record: ConversationRecord, ttl_s: float) -> None:
        self._store.check("put")
        await super().put(key, record, ttl_s)


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its tool calls' ids left out: engines make them up at random."""
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls} if calls else message


@dataclass
class Chat:
    """A client's conversation: it sends its history and echoes each answer back as it got it."""

    gw: Gateway
    session: str | None = None
    stream: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (an API key)

    async def say(self, text: str, **over: Any) -> Answer:
        self.messages.append({"role": "user", "content": text})
        return await self.send(**over)

    async def send(self, **over: Any) -> Answer:
        body = {**self.body, **over}
        stream = body.pop("stream", self.stream)
        truth = self.gw.engine.truth({"messages": self.messages, **body})
        a = await self.gw.chat(list(self.messages), session=self.session, stream=stream, headers=self.headers, **body)
        if a.status == 200 and a.error is None:
            assert _without_ids(a.message) == _without_ids(truth), "the answer differs from a colocated engine's"
            self.messages.append(dict(a.message))
        return a
