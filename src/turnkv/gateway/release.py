"""Gives decode memory back: handles that will not be used are released through a prefill engine.

The engine turns a handle into a release (vLLM: P pulls nothing and notifies D, which frees the pinned
blocks at once); without one D keeps them for ``decoder_kv_blocks_ttl``. A handle is released at most
once (a second notice names a request D no longer tracks: D logs it and frees nothing); releases run a
few at a time, each bounded, off the turns' path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

from turnkv.engine.base import Handle, HandleRules
from turnkv.errors import UpstreamError
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.routing import Router

log = logging.getLogger("turnkv.release")
QUEUE_SIZE = 4096
WORKERS = 8  # releases in flight at once: each is one 1-token request to a prefill engine
REMEMBERED = 8192  # pin ids already released, to never release one twice


class Releaser:
    def __init__(
        self, engine: HandleRules, router: Router, metrics: GatewayMetrics, model: Callable[[], str | None]
    ) -> None:
        self._engine = engine
        self._router = router
        self._metrics = metrics
        self.model = model  # the model a release names: the first served, once known
        self._queue: asyncio.Queue[Handle] = asyncio.Queue(QUEUE_SIZE)
        self._done: OrderedDict[str, None] = OrderedDict()
        self._busy = 0

    def submit(self, handle: Handle, why: str) -> None:
        pin = self._engine.pin_id(handle)
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

    async def release(self, handle: Handle) -> bool:
        inst = self._router.pick("prefill")
        if inst is None:
            return False
        try:
            await self._engine.release(inst.url, handle, self.model())
        except UpstreamError as exc:
            self._metrics.releases.labels("failed").inc()
            log.warning("release.failed instance=%s error=%s", inst.url, exc)
            return False
        return True
