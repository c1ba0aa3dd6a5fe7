"""Helpers for the simulator's tests: apps in process, SSE parsing, metrics, and proxy-shaped requests.

The P and D request builders copy what vLLM's P/D proxies send:
P gets the client body with ``stream: false``, ``max_tokens: 1``, no ``stream_options`` or
``min_tokens``, and ``do_remote_decode: true`` (plus D's handle on a later turn); D gets the client
body unchanged with P's ``kv_transfer_params``.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from turnkv.sim.app import create_sim_app
from turnkv.sim.costs import CostModel
from turnkv.sim.engine import EngineConfig
from turnkv.sim.settings import SimSettings

MODEL = "sim-model"
P_KEYS_026 = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
]
P_KEYS_033 = [*P_KEYS_026, "dcp_size", "pp_size", "transfer_mode", "remote_registration_generation"]


def settings(*, template: str = "keep", drift: bool = False, details: bool = False, **engine: Any) -> SimSettings:
    costs = CostModel(time_scale=0)
    return SimSettings(
        template=template,
        retokenize_drift=drift,
        prompt_tokens_details=details,
        engine=EngineConfig(costs=costs, **engine),
    )


@contextlib.asynccontextmanager
async def asgi_client(**kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client for an in-process sim app whose lifespan (the engine) runs around it."""
    app = create_sim_app(settings(**kw))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client,
    ):
        yield client


def sse(text: str) -> list[Any]:
    """The events of an SSE body, checking vLLM's framing: only ``data: <json>\\n\\n``, then [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events: list[Any] = []
    for raw in text.split("\n\n")[:-1]:
        assert raw.startswith("data: ") and "\n" not in raw, raw
        payload = raw[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics body (0 when absent)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def external_tokens(metrics_text: str) -> float:
    return metric(metrics_text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 200, "return_token_ids": True, **extra}


def prefill_body(client_body: dict[str, Any], handle: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(client_body)
    if handle is None:
        body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    else:  # the multi-turn proxy: D's dict, flipped to a P request
        body["kv_transfer_params"] = {**handle, "do_remote_decode": True, "do_remote_prefill": False}
    body.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(k, None)
    return body


def decode_body(client_body: dict[str, Any], p_params: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(client_body), "kv_transfer_params": p_params}


def answer(body: dict[str, Any]) -> tuple[list[int], str | None, str | None]:
    """Token ids, content and reasoning of a non-streaming chat body."""
    choice = body["choices"][0]
    return choice["token_ids"], choice["message"]["content"], choice["message"]["reasoning"]


def next_turn(
    messages: list[dict[str, Any]], body: dict[str, Any], user: str, reasoning_key: str = "reasoning"
) -> list[dict[str, Any]]:
    """The conversation with the answer re-sent (with its reasoning) and a new user message."""
    msg = body["choices"][0]["message"]
    assistant: dict[str, Any] = {"role": "assistant", "content": msg["content"], reasoning_key: msg["reasoning"]}
    if msg.get("tool_calls"):
        assistant["tool_calls"] = msg["tool_calls"]
    return [*messages, assistant, {"role": "user", "content": user}]


class Sim:
    """A ``turnkv sim`` process seen over HTTP."""

    def __init__(self, url: str, http: httpx.Client) -> None:
        self.url = url
        self.http = http

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(self.url + path, json=body)

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def chat_stream(self, body: dict[str, Any]) -> list[Any]:
        r = self.post("/v1/chat/completions", {**body, "stream": True})
        assert r.status_code == 200, r.text
        return sse(r.text)

    def state(self) -> dict[str, Any]:
        return dict(self.http.get(self.url + "/_sim/state").json())

    def faults(self, **update: Any) -> dict[str, Any]:
        r = self.post("/_sim/faults", update)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metrics(self) -> str:
        return self.http.get(self.url + "/metrics").text

    def render(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        body = {"messages": messages, **extra}
        return list(self.post("/v1/chat/completions/render", body).json()["token_ids"])


def stream_answer(events: list[Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A streamed chat answer as a non-streaming body's choice would say it, and the final chunk's params."""
    role, *rest = events
    chunks = [e for e in rest if e["choices"]]
    deltas = [e["choices"][0]["delta"] for e in chunks]
    finish = chunks[-1]
    body = {
        "prompt_token_ids": role["prompt_token_ids"],
        "choices": [
            {
                "token_ids": [t for e in chunks for t in e["choices"][0]["token_ids"]],
                "finish_reason": finish["choices"][0]["finish_reason"],
                "message": {
                    "content": "".join(d.get("content", "") for d in deltas) or None,
                    "reasoning": "".join(d.get("reasoning", "") for d in deltas) or None,
                },
            }
        ],
    }
    return body, finish.get("kv_transfer_params")
