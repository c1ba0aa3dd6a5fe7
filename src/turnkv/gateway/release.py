"""Gives decode memory back: handles that will not be used are released through a prefill engine.

The engine turns a handle into a release (vLLM: P pulls nothing and notifies D, which frees the pinned
blocks at once); without one D keeps them for ``decoder_kv_blocks_ttl``. A handle is released at most
once (a second notice names a request D no longer tracks: D logs it and frees nothing); releases run
``WORKERS`` at a time, each bounded, off the turns' path. Until its release is sent a handle's blocks are
D's KV in use (``on_held``: ``Fleet.let_go``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from turnkv.engine.base import Handle, HandleRules
from turnkv.errors import UpstreamError
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.routing import Router

log = logging.getLogger("turnkv.release")
QUEUE_SIZE = 4096
# releases in flight at once, each a 1-token request to a prefill engine. At a saturated P each waits there
# until it is aborted (the engine's release wait; D is told then), so this over that wait is how many
# handles a second can be given back: the turns ending under load come faster than 8 over 2 s, and the
# handles waiting their turn pinned D's KV (the simulator's shared-gpu suite)
WORKERS = 64
REMEMBERED = 8192  # pin ids already released, to never release one twice


@dataclass(frozen=True)
class _Release:
    handle: Handle
    decode_url: str | None  # the D whose blocks it pins (None: not known)
    tokens: int


class Releaser:
    def __init__(
        self, engine: HandleRules, router: Router, metrics: GatewayMetrics, model: Callable[[], str | None]
    ) -> None:
        self._engine = engine
        self._router = router
        self._metrics = metrics
        self.model = model  # the model a release names: the first served, once known
        self._queue: asyncio.Queue[_Release] = asyncio.Queue(QUEUE_SIZE)
        # KV on a decode engine that a handle still holds (+) or no longer holds (-): ``Fleet.let_go``
        self.on_held: Callable[[str, int], None] = lambda url, tokens: None
        self._done: OrderedDict[str, None] = OrderedDict()
        self._busy = 0

    def submit(self, handle: Handle, why: str, decode_url: str | None = None, tokens: int = 0) -> None:
        """Release ``handle`` off the turns' path; ``decode_url`` and ``tokens``: the D and the KV it pins
        there, counted as held until the release was sent (``on_held``)."""
        pin = self._engine.pin_id(handle)
        if pin in self._done:
            self._metrics.releases.labels("duplicate").inc()
            return
        self._done[pin] = None
        while len(self._done) > REMEMBERED:
            self._done.popitem(last=False)
        held = _Release(handle, decode_url, tokens if decode_url else 0)
        try:
            self._queue.put_nowait(held)
            self._metrics.releases.labels(why).inc()
        except asyncio.QueueFull:
            self._metrics.releases.labels("dropped").inc()
            return
        if held.decode_url:
            self.on_held(held.decode_url, held.tokens)

    async def run(self) -> None:
        await asyncio.gather(*(self._work() for _ in range(WORKERS)))

    async def _work(self) -> None:
        while True:
            held = await self._queue.get()
            self._busy += 1
            try:
                await self.release(held.handle)
            finally:
                self._busy -= 1
                if held.decode_url:
                    self.on_held(held.decode_url, -held.tokens)  # D was told (or its TTL frees them)
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
