"""Serving the gateway in this process: uvicorn with the edge's connection limits and the drain.

A shutdown (SIGTERM, SIGINT) first tells the app's ``Drain`` (``gateway.lifecycle``): the gateway says it is
not ready at once, stops listening ``shutdown_delay_s`` later, and gives the turns in flight ``drain_s`` and
then ``launch.GRACE_S`` to finish before uvicorn gives up on their connections. ``serve`` (one process) and
``gateway.workers`` (several) run it; the engines' simulators and the benchmark's relays are served plainly
(``launch.serve``).
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType
from typing import Any

import uvicorn

from turnkv.gateway.connections import EdgeLimits, edge_protocol
from turnkv.gateway.lifecycle import Drain
from turnkv.gateway.tally import Tally
from turnkv.launch import GRACE_S, listening, uvicorn_config


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the app's ``Drain`` when a shutdown begins: the app says it is not ready at once, and
    the server stops listening only ``delay_s`` later."""

    def __init__(self, config: uvicorn.Config, drain: Drain, delay_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._delay_s = delay_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._drain.bind(self._loop)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining or self._delay_s <= 0 or self._loop is None:
            self._drain.begin(0.0)
            super().handle_exit(sig, frame)
            return
        self._drain.begin(self._delay_s)
        self._loop.call_soon_threadsafe(self._loop.call_later, self._delay_s, super().handle_exit, sig, frame)


def run(app: Any, sock: socket.socket, log_level: str = "warning", *, edge: EdgeLimits, tally: Tally | None) -> None:
    """Serve the gateway ``app`` (``create_app``) on a listening socket until stopped: a client's headers
    have a deadline and connections a cap (``gateway.connections``), counted in ``tally``; websockets are
    off; the app's ``Drain`` gets its drain time before the server gives up on its connections."""
    drain: Drain = app.state.drain
    delay_s = float(app.state.shutdown_delay_s)
    config = uvicorn_config(
        app,
        log_level,
        graceful_s=delay_s + drain.drain_s + GRACE_S,
        http=edge_protocol(edge, tally=tally),
        ws="none",
        timeout_keep_alive=edge.keep_alive_s,
    )
    _DrainingServer(config, drain, delay_s).run(sockets=[sock])


def serve(app: Any, host: str, port: int, log_level: str = "warning", *, edge: EdgeLimits, tally: Tally) -> None:
    """Bind, announce the URL on stdout (``launch.announce``), then serve the gateway until stopped."""
    run(app, listening(host, port), log_level, edge=edge, tally=tally)
