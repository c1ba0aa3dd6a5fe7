"""Shutdown without cut streams: what a SIGTERM does to readiness, new turns and turns in flight.

On SIGTERM (``begin``) ``/ready`` answers 503 at once, so a load balancer moves traffic away; new
connections are still served for ``shutdown_delay_s`` (the server decides when it stops listening),
new turns are refused (503 with ``Retry-After``) from then on; turns in flight may finish for
``drain_s``. When that runs out, every turn still running is aborted: a stream ends with an SSE error
event (its decode request is closed, so D aborts it and pins nothing), and its record, claimed
handle and in-flight marker are settled by capture as for any failed turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("turnkv.lifecycle")


class Drain:
    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.draining = False  # a shutdown began: not ready
        self.refusing = False  # new turns are refused
        self.expired = False  # turns still running are being aborted
        self._aborts: dict[int, Callable[[], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_count: Callable[[int], None] = lambda n: None  # turns in flight, on every change
        self.on_draining: Callable[[], None] = lambda: None  # once, as the shutdown begins

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def begin(self, refuse_after_s: float = 0.0) -> None:
        """Start the shutdown; safe to call from a signal handler."""
        if self.draining or self._loop is None:
            return
        self.draining = True
        self._loop.call_soon_threadsafe(self._schedule, refuse_after_s)

    def _schedule(self, refuse_after_s: float) -> None:
        assert self._loop is not None
        self.on_draining()
        log.warning(
            "shutdown.draining turns=%d refuse_after_s=%.1f drain_s=%.1f",
            len(self._aborts),
            refuse_after_s,
            self.drain_s,
        )
        self._loop.call_later(refuse_after_s, self._refuse)
        self._loop.call_later(refuse_after_s + self.drain_s, self._expire)

    def _refuse(self) -> None:
        self.refusing = True

    def _expire(self) -> None:
        self.expired = True
        if self._aborts:
            log.warning("shutdown.aborting turns=%d", len(self._aborts))
        for abort in list(self._aborts.values()):
            abort()

    @property
    def in_flight(self) -> int:
        return len(self._aborts)

    def track(self, key: object, abort: Callable[[], None]) -> None:
        """A turn is in flight; ``abort`` ends it early when the drain runs out."""
        self._aborts[id(key)] = abort
        self.on_count(len(self._aborts))

    def untrack(self, key: object) -> None:
        if self._aborts.pop(id(key), None) is not None:
            self.on_count(len(self._aborts))
