"""First-token deadlines: how long a turn waits for an engine to start answering, and when it gives up.

An engine gets ``first_s`` to start (P: to answer its prefill, a pull included; D: to show the client
output). Past it, an engine whose token counters moved within the last ``first_s`` (the fleet's
``InstanceView.progressed_at``, read from its metrics) is busy with other work, not stuck: giving up
would only add a retry to its queue (on the H200 at 64 conversations, aborting turns D would have
started, and running them again, turned queueing into failed turns). So the deadline is renewed, up
to ``cap_s`` from the start in all: the leg's whole timeout (``timeouts.prefill_s`` for P,
``timeouts.decode_read_s`` for D). Only an engine that computes nothing misses it. ``TurnRun.until_aborted``
waits by it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from turnkv.config import Timeouts
from turnkv.routing.base import InstanceView


@dataclass(frozen=True)
class Deadline:
    leg: str  # prefill | decode
    url: str  # the engine waited for
    first_s: float  # the deadline, and each renewal
    cap_s: float  # the longest wait in all, renewals included

    @classmethod
    def prefill(cls, t: Timeouts, url: str) -> Deadline:
        return cls("prefill", url, t.prefill_first_token_s, t.prefill_s)

    @classmethod
    def decode(cls, t: Timeouts, url: str) -> Deadline:
        return cls("decode", url, t.decode_first_token_s, t.decode_read_s)

    def renews(self, engine: InstanceView | None, started: float, now: float) -> bool:
        """Whether the wait goes on for another ``first_s`` once the deadline passed (``started`` and ``now``:
        loop times): the engine computed something within the last ``first_s``, and the cap allows it."""
        busy = engine is not None and time.monotonic() - engine.progressed_at < self.first_s
        return busy and now - started + self.first_s <= self.cap_s
