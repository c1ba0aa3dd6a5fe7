"""Simulated P/D clusters behind a real gateway, and a conversation driver using the openai SDK."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from turnkv import launch

# real engines in real time on a shared CPU: the engines' and the gateway's clocks race the load, so a
# run on a busy machine may see another moment than the one the test sets up; a fault fails every run
REAL_TIME = pytest.mark.flaky(reruns=2)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up",
            "parameters": {"type": "object", "properties": {"topic": {"type": "string"}, "limit": {"type": "integer"}}},
        },
    }
]


@dataclass
class Cluster:
    prefill: list[launch.Running]
    decode: list[launch.Running]
    truth: launch.Running  # a colocated engine: the ground truth for every answer
    gateway: launch.Running
    log_dir: Path

    def client(self, api_key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def truth_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.truth.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def turn_events(self, count: int) -> list[dict[str, Any]]:
        """The gateway's turn log, once it holds `count` turns: a streamed turn is logged after its last
        chunk has reached the client (capture runs then), so the log can trail the responses."""
        found: list[dict[str, Any]] = []

        def logged() -> bool:
            nonlocal found
            # Only complete lines: the gateway may be mid-write.
            lines = (self.log_dir / "gateway.log").read_text().split("\n")[:-1]
            found = [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == "turn"]
            return len(found) >= count

        wait_for(logged, what=f"{count} turns in the gateway log")
        return found


def start_cluster(
    procs: list[launch.Running],
    log_dir: Path,
    *,
    template: str = "keep",
    compat: str = "0.26",
    policy: str = "always-pull",
    n_prefill: int = 1,
    n_decode: int = 1,
    redis_url: str | None = None,
    sim_flags: tuple[str, ...] = (),
    prefill_flags: tuple[str, ...] = (),
    decode_flags: tuple[str, ...] = (),
    engine_flags: dict[str, tuple[str, ...]] | None = None,
    gateway_env: dict[str, str] | None = None,
    gateway_args: tuple[str, ...] = (),
) -> Cluster:
    common = ("--time-scale", "0", "--template", template, "--vllm-compat", compat, *sim_flags)
    own = engine_flags or {}  # by engine name (prefill0, decode1, ...): flags of that engine alone
    ps = [
        launch.sim(f"prefill{i}", "prefill", *common, *prefill_flags, *own.get(f"prefill{i}", ()), log_dir=log_dir)
        for i in range(n_prefill)
    ]
    procs += ps
    ds = [
        launch.sim(f"decode{i}", "decode", *common, *decode_flags, *own.get(f"decode{i}", ()), log_dir=log_dir)
        for i in range(n_decode)
    ]
    procs += ds
    truth = launch.sim("truth", "colocated", *common, log_dir=log_dir)
    procs.append(truth)
    extra = ["--policy", policy, *(["--redis-url", redis_url] if redis_url else []), *gateway_args]
    env = {
        "TURNKV_HEALTH_INTERVAL_S": "0.2",
        "TURNKV_SCRAPE_INTERVAL_S": "0.2",
        "TURNKV_DECISION_HEADERS": "full",
        **(gateway_env or {}),
    }
    gw = launch.gateway("gateway", [p.url for p in ps], [d.url for d in ds], *extra, log_dir=log_dir, env=env)
    procs.append(gw)
    return Cluster(ps, ds, truth, gw, log_dir)


def sim_control(url: str, **faults: Any) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/_sim/faults", data=json.dumps(faults).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on an engine or gateway, filtered by labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(predicate: Any, timeout_s: float = 10.0, what: str = "condition", state: Any = None) -> None:
    """Wait for an effect that happens after the response that caused it (bounded); ``state()`` says what
    was seen last when it does not come."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"; last seen: {state()}" if state else ""))
        time.sleep(0.05)


def sim_state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_sim/state", timeout=10) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


@dataclass
class Turn:
    answer: dict[str, Any]  # role, content, reasoning, tool_calls
    headers: dict[str, str]
    truth: dict[str, Any] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        return self.answer == self.truth

    @property
    def outcome(self) -> str:
        return self.headers.get("x-turnkv-outcome", "")

    @property
    def reason(self) -> str:
        return self.headers.get("x-turnkv-reason", "")


def _message(m: Any) -> dict[str, Any]:
    d = m.model_dump() if hasattr(m, "model_dump") else dict(m)
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in d.get("tool_calls") or []
    ]
    return {"content": d.get("content") or "", "reasoning": d.get("reasoning") or "", "tool_calls": calls}


def ask(
    client: openai.OpenAI,
    messages: list[dict[str, Any]],
    *,
    stream: bool,
    session: str | None,
    tools: bool = False,
    max_tokens: int = 120,
) -> tuple[dict[str, Any], dict[str, str], list[Any]]:
    """One request; returns the answer, the response headers and the raw ids of tool calls."""
    kwargs: dict[str, Any] = {"model": "sim-model", "messages": messages, "max_tokens": max_tokens}
    if tools:
        kwargs["tools"] = TOOLS
    if session:
        kwargs["extra_headers"] = {"X-Session-ID": session}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        m = raw.parse().choices[0].message
        return _message(m), dict(raw.headers), [c.id for c in (m.tool_calls or [])]
    raw = client.chat.completions.with_raw_response.create(stream=True, **kwargs)
    content, reasoning = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta.model_dump()
        content += d.get("content") or ""
        reasoning += d.get("reasoning") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.get("id") or slot["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    answer = {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())],
    }
    return answer, dict(raw.headers), [c["id"] for _, c in sorted(calls.items())]


class Dialogue:
    """An agent-style conversation, one turn at a time: every answer goes back into the history as the
    client received it; tool calls get a tool result, other answers a new user message. Each answer is
    also computed by the colocated engine from the same history: the ground truth."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        session: str | None = "conv-1",
        api_key: str = "key-a",
        stream: bool = False,
        tools: bool = False,
        system: str = "You are a helpful agent.",
        max_tokens: int = 120,
    ) -> None:
        self.client = cluster.client(api_key)
        self.truth = cluster.truth_client()
        self.session, self.stream, self.tools, self.max_tokens = session, stream, tools, max_tokens
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Plan a short trip."},
        ]

    def __enter__(self) -> Dialogue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.truth.close()

    def step(self, *, session: str | None = None, client: openai.OpenAI | None = None, truth: bool = True) -> Turn:
        """One turn; with truth=False the ground truth is not asked, so the next turn can follow at once."""
        answer, headers, ids = ask(
            client or self.client,
            self.messages,
            stream=self.stream,
            session=session or self.session,
            tools=self.tools,
            max_tokens=self.max_tokens,
        )
        expected: dict[str, Any] = {}
        if truth:
            expected, _, _ = ask(
                self.truth,
                self.messages,
                stream=self.stream,
                session=None,
                tools=self.tools,
                max_tokens=self.max_tokens,
            )
        self.advance(answer, ids)
        return Turn(answer, headers, expected)

    def advance(self, answer: dict[str, Any], ids: list[Any]) -> None:
        k = len(self.messages)
        msg: dict[str, Any] = {"role": "assistant", "content": answer["content"], "reasoning": answer["reasoning"]}
        if answer["tool_calls"]:
            msg["tool_calls"] = [
                {"id": i, "type": "function", "function": c} for i, c in zip(ids, answer["tool_calls"], strict=True)
            ]
            tool_msgs = [{"role": "tool", "tool_call_id": i, "content": f"result {k}"} for i in ids]
            self.messages = [*self.messages, msg, *tool_msgs]
        else:
            self.messages = [*self.messages, msg, {"role": "user", "content": f"Thanks. Now step {k}, please."}]


def converse(
    cluster: Cluster,
    turns: int,
    *,
    session: str | None = "conv-1",
    stream: bool = False,
    tools: bool = False,
    api_key: str = "key-a",
) -> list[Turn]:
    with Dialogue(cluster, session=session, api_key=api_key, stream=stream, tools=tools) as d:
        return [d.step() for _ in range(turns)]
