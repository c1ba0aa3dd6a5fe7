"""A TCP relay on loopback that delays what a client sends: a slow network path to one server."""

from __future__ import annotations

import asyncio
from typing import Any

from turnkv.bench.relay import LoopbackRelay


class LatencyProxy(LoopbackRelay):
    """Forwards 127.0.0.1:<port> to an upstream port; each chunk the client sends reaches the upstream
    `delay_s` later (answers are not delayed)."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        super().__init__(upstream_port)
        self.delay_s = delay_s

    async def to_server(self, data: bytes, conn: dict[str, Any]) -> None:
        await asyncio.sleep(self.delay_s)  # the injected latency, not a synchronisation
