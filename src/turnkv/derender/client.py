"""HTTP to render services (vLLM's ``vllm launch render``, or ``vllm serve`` with its render routes).

``RenderClient`` sends render, derender and detokenize calls to one of several replicas (the one with the
fewest calls in flight, round-robin among equals) through a ``Poster``: any function that POSTs JSON and
reads a JSON answer, raising the ``turnkv.errors.UpstreamError`` tree. ``AiohttpPoster`` is one, over an
aiohttp session; a gateway hands in its own. A refused call raises ``UpstreamStatus`` carrying the render
service's OpenAI-shaped error body, which a client then gets as it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp

from turnkv import jsonwire
from turnkv.errors import (
    UpstreamError,
    UpstreamProtocolError,
    aiohttp_errors,
    retryable,
    upstream_answer,
)

RENDER_LEG = "render"
DERENDER_LEG = "derender"


class Poster(Protocol):
    def __call__(self, leg: str, base: str, path: str, body: Any) -> Awaitable[Any]:
        """POST ``body`` to ``base + path`` and return the decoded JSON answer; any status >= 400 raises
        ``UpstreamStatus`` with the body kept, a failed call another ``UpstreamError``."""


class AiohttpPoster:
    """A ``Poster`` over one aiohttp session, with one total timeout per call."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __call__(self, leg: str, base: str, path: str, body: Any) -> Any:
        with aiohttp_errors(leg, base, peer="service"):
            async with self.session.post(
                base + path,
                data=jsonwire.dumps(body),
                headers={"content-type": "application/json"},
                timeout=self.timeout,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        data = upstream_answer(status, raw, leg=leg, instance=base)
        if data is None:
            raise UpstreamProtocolError(f"{leg} service answered a body that is not JSON", leg=leg, instance=base)
        return data


class RenderClient:
    """Calls to a set of equivalent render-service replicas."""

    def __init__(self, bases: Sequence[str], post: Poster | Callable[..., Awaitable[Any]]) -> None:
        if not bases:
            raise ValueError("a render client needs at least one render service")
        self.bases = [b.rstrip("/") for b in bases]
        self._post = post
        self._inflight = dict.fromkeys(self.bases, 0)
        self._turn = itertools.count()
        self.calls = 0  # calls made, all routes together

    def pick(self, exclude: set[str] | None = None) -> str:
        """The replica with the fewest calls in flight (of those not in ``exclude``); among equals, the next in
        turn."""
        left = [b for b in self.bases if not exclude or b not in exclude]
        low = min(self._inflight[b] for b in left)
        ready = [b for b in left if self._inflight[b] == low]
        return ready[next(self._turn) % len(ready)]

    async def call(self, leg: str, path: str, body: Any) -> Any:
        """One call; where a replica fails it (unreachable, timed out, a 5xx), the next one is tried, each at
        most once (render and derender calls change nothing on the service: they are safe to repeat)."""
        tried: set[str] = set()
        while True:
            base = self.pick(exclude=tried)
            tried.add(base)
            self._inflight[base] += 1
            self.calls += 1
            try:
                return await self._post(leg, base, path, body)
            except UpstreamError as exc:
                if len(tried) == len(self.bases) or not retryable(exc):
                    raise
            finally:
                self._inflight[base] -= 1

    async def _object(self, leg: str, path: str, body: Any) -> dict[str, Any]:
        out = await self.call(leg, path, body)
        if not isinstance(out, dict):
            raise UpstreamProtocolError(f"{leg} service answered a non-object body", leg=leg)
        return out

    async def render_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._object(RENDER_LEG, "/v1/chat/completions/render", body)

    async def render_completion(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = await self.call(RENDER_LEG, "/v1/completions/render", body)
        if not isinstance(out, list) or not all(isinstance(x, dict) for x in out):
            raise UpstreamProtocolError("render service answered a completions render not a list", leg=RENDER_LEG)
        return out

    async def derender_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._object(DERENDER_LEG, "/v1/chat/completions/derender", body)

    async def detokenize(self, ids: Sequence[int]) -> str:
        out = await self._object(DERENDER_LEG, "/detokenize", {"tokens": list(ids)})
        text = out.get("prompt")
        if not isinstance(text, str):
            raise UpstreamProtocolError("render service answered /detokenize without text", leg=DERENDER_LEG)
        return text
