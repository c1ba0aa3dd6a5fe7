"""Gives decode memory back: handles that will not be used are released through a prefill engine.

A handle sent to P with ``remote_num_tokens: 0`` makes P pull nothing and notify D, which frees the
pinned blocks at once (verified on vLLM 0.26). Without it D keeps them for ``decoder_kv_blocks_ttl``.
Used when a new handle cannot be stored (the store is down) or D is short of KV memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from turnkv.errors import UpstreamError
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.gateway.registry import Registry
from turnkv.gateway.upstream import Upstream
from turnkv.reuse.assess import release_handle

log = logging.getLogger("turnkv.release")
QUEUE_SIZE = 1024


class Releaser:
    def __init__(self, upstream: Upstream, registry: Registry, metrics: GatewayMetrics, model: str | None) -> None:
        self._upstream = upstream
        self._registry = registry
        self._metrics = metrics
        self.model = model
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_SIZE)

    def submit(self, handle: dict[str, Any], why: str) -> None:
        try:
            self._queue.put_nowait(handle)
            self._metrics.releases.labels(why).inc()
        except asyncio.QueueFull:
            self._metrics.releases.labels("dropped").inc()

    async def run(self) -> None:
        while True:
            handle = await self._queue.get()
            await self.release(handle)

    async def release(self, handle: dict[str, Any]) -> bool:
        inst = self._registry.pick("prefill")
        if inst is None:
            return False
        body: dict[str, Any] = {"prompt": ".", "max_tokens": 1, "kv_transfer_params": release_handle(handle)}
        if self.model:
            body["model"] = self.model
        try:
            await self._upstream.post_json("prefill", inst.url, "/v1/completions", body,
                                           self._upstream.headers(None, None))
        except UpstreamError as exc:
            log.warning("release.failed instance=%s error=%s", inst.url, exc)
            return False
        return True
