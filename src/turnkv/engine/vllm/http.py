"""HTTP to vLLM's engines: one aiohttp session, per-leg timeouts, aiohttp's errors translated
(``errors.aiohttp_errors``).

Every call names its leg (render, prefill, decode, probe) and the instance, so an error can be
counted and retried without parsing messages. Messages, which clients may read, name the leg only:
the instance (an internal URL) rides on the exception, for logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from turnkv import jsonwire
from turnkv.config import Timeouts
from turnkv.errors import UpstreamProtocolError, aiohttp_errors, upstream_answer


def let_go(resp: aiohttp.ClientResponse, *, read_to_end: bool) -> None:
    """End a streamed answer: its connection goes back to the pool where the stream was read to its end,
    else it is closed (a connection mid-stream cannot carry another request; closing aborts the request)."""
    if read_to_end and resp.content.at_eof():
        resp.release()
    else:
        resp.close()


def _dumps(body: Any) -> bytes:
    return jsonwire.dumps(body)


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, timeouts: Timeouts, api_key: str | None = None) -> None:
        self.session = session
        self.t = timeouts
        self._api_key = api_key
        self._leg_timeouts = {
            "render": aiohttp.ClientTimeout(total=timeouts.render_s, connect=timeouts.connect_s),
            "prefill": aiohttp.ClientTimeout(total=timeouts.prefill_s, connect=timeouts.connect_s),
            "decode": aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.decode_read_s),
            "probe": aiohttp.ClientTimeout(total=timeouts.health_s, connect=timeouts.health_s),
        }

    def headers(self, request_id: str | None, authorization: str | None) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if request_id:
            h["x-request-id"] = request_id
        auth = f"Bearer {self._api_key}" if self._api_key else authorization
        if auth:
            h["authorization"] = auth
        return h

    def _timeout(self, leg: str, timeout_s: float | None) -> aiohttp.ClientTimeout:
        if timeout_s is None:
            return self._leg_timeouts[leg]
        return aiohttp.ClientTimeout(total=timeout_s, connect=min(self.t.connect_s, timeout_s))

    async def post_json(
        self,
        leg: str,
        base: str,
        path: str,
        body: Any,
        headers: Mapping[str, str],
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST and read a JSON body. Any status >= 400 raises ``UpstreamStatus`` with the body kept;
        ``timeout_s`` bounds the whole call instead of the leg's own timeouts."""
        with aiohttp_errors(leg, base):
            async with self.session.post(
                base + path, data=_dumps(body), headers=headers, timeout=self._timeout(leg, timeout_s)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        data = upstream_answer(status, raw, leg=leg, instance=base)
        if not isinstance(data, dict):
            raise UpstreamProtocolError(f"{leg} engine answered a non-object body", leg=leg, instance=base)
        return data

    async def open_stream(
        self,
        leg: str,
        base: str,
        path: str,
        body: Any,
        headers: Mapping[str, str],
    ) -> aiohttp.ClientResponse:
        """POST and return the open response once its status is known (2xx), for streaming."""
        with aiohttp_errors(leg, base):
            resp = await self.session.post(
                base + path, data=_dumps(body), headers=headers, timeout=self._leg_timeouts[leg]
            )
            if resp.status >= 400:
                try:
                    raw = await resp.read()
                finally:
                    resp.release()
                upstream_answer(resp.status, raw, leg=leg, instance=base)  # raises UpstreamStatus
        return resp

    async def get(self, base: str, path: str) -> tuple[int, bytes]:
        status, body, _ = await self.probe(base, path)
        return status, body

    async def probe(self, base: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        """GET with the short probe timeout; status, body and (lower-cased) headers."""
        with aiohttp_errors("probe", base):
            async with self.session.get(base + path, timeout=self._leg_timeouts["probe"]) as resp:
                return resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()}
