"""Fault injection for a simulated engine: what goes wrong with the next requests, and when.

Set from the command line at start, or at run time with ``POST /_sim/faults`` (a JSON object
with the fields below, plus the one-off actions ``restart`` and ``expire_handles``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class Faults(BaseModel):
    fail_next: int = Field(0, ge=0, description="answer the next N generation requests with HTTP 500")
    delay_ms: float = Field(0.0, ge=0, description="added to every generation request before it starts")
    drop_next: int = Field(0, ge=0, description="drop the connection of the next N streams mid-stream")
    drop_after_chunks: int = Field(2, ge=0, description="chunks sent before a stream is dropped")

    def take_failure(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def take_drop(self) -> bool:
        if self.drop_next > 0:
            self.drop_next -= 1
            return True
        return False


class FaultUpdate(BaseModel):
    fail_next: int | None = Field(None, ge=0)
    delay_ms: float | None = Field(None, ge=0)
    drop_next: int | None = Field(None, ge=0)
    drop_after_chunks: int | None = Field(None, ge=0)
    restart: bool = False
    expire_handles: bool = False
    reset_prefix_cache: bool = False
