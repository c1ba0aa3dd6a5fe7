"""Gives decode memory back: handles that will not be used are released through a prefill engine.

A handle sent to P with ``remote_num_tokens: 0`` makes P pull nothing and notify D, which frees the
pinned blocks at once (verified on vLLM 0.26). Without it D keeps them for ``decoder_kv_blocks_ttl``.
A handle is released at most once (a second notice names a request D no longer tracks: D logs it
and frees nothing); releases run a few at a time, each bounded, off the turns' path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from turnkv.errors import UpstreamError
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.registry import Registry
from turnkv.gateway.upstream import Upstream
from turnkv.reuse.assess import release_handle

log = logging.getLogger("turnkv.release")
QUEUE_SIZE = 4096
WORKERS = 8  # releases in flight at once: each is one 1-token request to a prefill engine
REMEMBERED = 8192  # pin ids already released, to never release one twice
RELEASE_TIMEOUT_S = 10.0


class Releaser:
    def __init__(self, upstream: Upstream, registry: Registry, metrics: GatewayMetrics, model: str | None) -> None:
        self._upstream = upstream
        self._registry = registry
        self._metrics = metrics
        self.model = model
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_SIZE)
        self._done: OrderedDict[str, None] = OrderedDict()
        self._busy = 0

    def submit(self, handle: dict[str, Any], why: str) -> None:
        pin = str(handle.get("remote_request_id"))
        if pin in self._done:
            self._metrics.releases.labels("duplicate").inc()
            return
        self._done[pin] = None
        while len(self._done) > REMEMBERED:
            self._done.popitem(last=False)
        try:
            self._queue.put_nowait(handle)
            self._metrics.releases.labels(why).inc()
        except asyncio.QueueFull:
            self._metrics.releases.labels("dropped").inc()

    @property
    def pending(self) -> int:
        return self._queue.qsize() + self._busy

    async def run(self) -> None:
        await asyncio.gather(*(self._work() for _ in range(WORKERS)))

    async def _work(self) -> None:
        while True:
            handle = await self._queue.get()
            self._busy += 1
            try:
                await self.release(handle)
            finally:
                self._busy -= 1
                self._queue.task_done()

    async def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until every submitted release has been sent; True when none is left."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def release(self, handle: dict[str, Any]) -> bool:
        inst = self._registry.pick("prefill")
        if inst is None:
            return False
        body: dict[str, Any] = {"prompt": ".", "max_tokens": 1, "kv_transfer_params": release_handle(handle)}
        if self.model:
            body["model"] = self.model
        try:
            await self._upstream.post_json("prefill", inst.url, "/v1/completions", body,
                                           self._upstream.headers(None, None), timeout_s=RELEASE_TIMEOUT_S)
        except UpstreamError as exc:
            self._metrics.releases.labels("failed").inc()
            log.warning("release.failed instance=%s error=%s", inst.url, exc)
            return False
        return True
