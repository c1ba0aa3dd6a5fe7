"""Fault injection for a simulated engine: what goes wrong with the next requests, and when.

Set from the command line at start, or at run time with ``POST /_sim/faults`` (a JSON object
with the fields below, plus the one-off actions ``restart``, ``expire_handles`` and
``reset_prefix_cache``). A delay holds each request until ``delay_ms`` after it arrived, as the
setting stands at that moment: lowering it releases requests already waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pydantic import BaseModel, Field


class Faults(BaseModel):
    fail_next: int = Field(0, ge=0, description="answer the next N generation requests with HTTP 500")
    delay_ms: float = Field(0.0, ge=0, description="added to every generation request before it starts")
    drop_next: int = Field(0, ge=0, description="drop the connection of the next N streams mid-stream")
    drop_after_chunks: int = Field(2, ge=0, description="chunks sent before a stream is dropped (or frozen)")
    freeze_next: int = Field(
        0,
        ge=0,
        description="the next N streams stop sending mid-stream, their connection left open, until the client leaves",
    )


class FaultUpdate(BaseModel):
    fail_next: int | None = Field(None, ge=0)
    delay_ms: float | None = Field(None, ge=0)
    drop_next: int | None = Field(None, ge=0)
    drop_after_chunks: int | None = Field(None, ge=0)
    freeze_next: int | None = Field(None, ge=0)
    restart: bool = False
    expire_handles: bool = False
    reset_prefix_cache: bool = False


class FaultInjector:
    """The faults in force on one engine, and the requests a delay is holding."""

    def __init__(self, initial: Faults) -> None:
        self.faults = initial.model_copy()
        self.delayed = 0
        self._changed = asyncio.Event()

    def update(self, upd: FaultUpdate) -> None:
        for name in Faults.model_fields:
            value = getattr(upd, name)
            if value is not None:
                setattr(self.faults, name, value)
        self._changed.set()
        self._changed = asyncio.Event()

    def take_failure(self) -> bool:
        if self.faults.fail_next > 0:
            self.faults.fail_next -= 1
            return True
        return False

    def take_drop(self) -> bool:
        if self.faults.drop_next > 0:
            self.faults.drop_next -= 1
            return True
        return False

    def take_freeze(self) -> bool:
        if self.faults.freeze_next > 0:
            self.faults.freeze_next -= 1
            return True
        return False

    async def delay(self, arrival: float) -> None:
        """Hold a request that arrived at ``arrival`` (``perf_counter``) for the current delay."""
        if self.faults.delay_ms <= 0:
            return
        self.delayed += 1
        try:
            while (left := arrival + self.faults.delay_ms / 1e3 - time.perf_counter()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
        finally:
            self.delayed -= 1
