"""Sends one chat turn over a streaming OpenAI API and times it, as cheaply as a client can.

Per network read the client only splits SSE events and checks, with one bytes regex, whether an
event carries generated text (non-empty ``content``/``reasoning`` or a ``tool_calls`` list); that
gives TTFT and the gaps between token-bearing events (ITL). The events are JSON-parsed once, in a
single call, after the stream ended, to rebuild the answer and read ``usage``.

Two kinds of target: an OpenAI-compatible endpoint (turnkv, or an engine), or ``pd-direct``,
where the client itself runs vLLM's P/D handshake (P with ``max_tokens: 1`` and
``do_remote_decode``, then D with P's ``kv_transfer_params``), as a proxy-free baseline. An endpoint
may have replicas (colocated engines side by side): each conversation then sticks to one, the
conversations taking them in turn, as a session-affinity balancer in front of them would.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from turnkv.bench.records import DECISION_HEADERS
from turnkv.engine.vllm.handles import P_ONLY

_VISIBLE = re.compile(rb'"(?:content|reasoning|reasoning_content)":"(?!")|"tool_calls":\[')


# what the bare relays (baseline_relay, baseline_asgi) pass on, and their client to the engines
HOP_HEADERS = ("content-type", "accept")
UPSTREAM_TIMEOUT_S = 120.0


def upstream_session() -> aiohttp.ClientSession:
    """The relays' client to the engines: no connection limit, one timeout for a whole call."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S), connector=aiohttp.TCPConnector(limit=0)
    )


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """P's half of vLLM's P/D handshake for a chat request: one token, not streamed, ``do_remote_decode``."""
    p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    p_body.update(max_tokens=1, stream=False, kv_transfer_params=P_ONLY)
    return p_body


def chat_url(base: str) -> str:
    base = base.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


@dataclass(frozen=True)
class Target:
    """Where the load goes: ``url`` (OpenAI API), or ``prefill``+``decode`` for pd-direct."""

    url: str | None = None
    prefill: str | None = None
    decode: str | None = None
    replicas: tuple[str, ...] = ()  # more endpoints like ``url``; conversation i goes to the (i mod n)-th

    def __post_init__(self) -> None:
        if (self.url is None) == (self.prefill is None or self.decode is None):
            raise ValueError("a target is either a url, or a prefill and a decode url")
        if self.replicas and self.url is None:
            raise ValueError("replicas go with a url")

    def url_for(self, conversation: int) -> str:
        """The endpoint of ``conversation``: ``url`` itself, or the replica its index picks."""
        assert self.url is not None
        urls = (self.url, *self.replicas)
        return urls[conversation % len(urls)]

    @property
    def kind(self) -> str:
        return "openai" if self.url else "pd-direct"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.url,
            "prefill": self.prefill,
            "decode": self.decode,
            "replicas": list(self.replicas),
        }


@dataclass
class TurnOutcome:
    """What one request returned, before it becomes a record."""

    ttft_s: float | None = None
    latency_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    chunks: int = 0
    content: str = ""
    reasoning: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    decision: dict[str, str] = field(default_factory=dict)

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)]


def _dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class TurnClient:
    """Sends turns to one target over one shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, timeout_s: float) -> None:
        self.session = session
        self.target = target
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def send(self, body: dict[str, Any], headers: dict[str, str], conversation: int = 0) -> TurnOutcome:
        out = TurnOutcome()
        hdrs = {"content-type": "application/json", **headers}
        try:
            if self.target.url is not None:
                data = _dumps(body)
                t0 = time.perf_counter()
                await self._stream(chat_url(self.target.url_for(conversation)), data, hdrs, t0, out)
            else:
                await self._pd_direct(body, hdrs, out)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            out.error = out.error or f"{type(exc).__name__}: {exc}"[:300]
        return out

    async def _pd_direct(self, body: dict[str, Any], hdrs: dict[str, str], out: TurnOutcome) -> None:
        assert self.target.prefill is not None and self.target.decode is not None
        p_data = _dumps(prefill_request(body))
        t0 = time.perf_counter()
        async with self.session.post(
            chat_url(self.target.prefill), data=p_data, headers=hdrs, timeout=self.timeout
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                out.status, out.error = resp.status, f"prefill HTTP {resp.status}: {raw[:300]!r}"
                return
        params = json.loads(raw).get("kv_transfer_params")
        await self._stream(chat_url(self.target.decode), _dumps({**body, "kv_transfer_params": params}), hdrs, t0, out)

    async def _stream(self, url: str, data: bytes, hdrs: dict[str, str], t0: float, out: TurnOutcome) -> None:
        events: list[bytes] = []
        times = out.token_times
        done = False
        async with self.session.post(url, data=data, headers=hdrs, timeout=self.timeout) as resp:
            out.status = resp.status
            out.decision = {h[len("x-turnkv-") :]: resp.headers[h] for h in DECISION_HEADERS if h in resp.headers}
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return
            buf = b""
            async for piece in resp.content.iter_any():
                now = time.perf_counter()
                parts = (buf + piece).split(b"\n\n")
                buf = parts.pop()
                for ev in parts:
                    if not ev.startswith(b"data: "):
                        continue
                    payload = ev[6:]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    events.append(payload)
                    if _VISIBLE.search(payload):
                        times.append(now)
        end = time.perf_counter()
        out.latency_s = end - t0
        out.ttft_s = times[0] - t0 if times else None
        out.chunks = len(events)
        self._parse(events, out)
        if out.error is None and not done:
            out.error = "stream ended without [DONE]"
        if out.error is None and not times:
            out.error = "no generated token in the stream"

    @staticmethod
    def _parse(events: list[bytes], out: TurnOutcome) -> None:
        try:
            parsed = json.loads(b"[" + b",".join(events) + b"]")
        except ValueError:
            out.error = "malformed SSE event"
            return
        content: list[str] = []
        reasoning: list[str] = []
        for ev in parsed:
            if not isinstance(ev, dict):
                continue
            if "error" in ev:
                out.error = f"error event: {json.dumps(ev['error'])[:300]}"
            for ch in ev.get("choices") or ():
                d = ch.get("delta") or {}
                if d.get("content"):
                    content.append(d["content"])
                r = d.get("reasoning") or d.get("reasoning_content")
                if r:
                    reasoning.append(r)
            u = ev.get("usage")
            if u:
                out.prompt_tokens = u.get("prompt_tokens")
                out.completion_tokens = u.get("completion_tokens")
        out.content = "".join(content)
        out.reasoning = "".join(reasoning)
