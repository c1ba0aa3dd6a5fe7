"""First-token deadlines: how long a turn waits for an engine to start answering, and when it gives up.

An engine gets ``first_s`` to start (P: to answer its prefill, a pull included; D: to show the client
output). Past it, an engine that answers its health probe and whose token counters moved since the wait
began, within the last ``first_s`` (the fleet's ``InstanceView.progressed_at``, read from its metrics), is
busy with other work, not stuck: giving up would only add a retry to its queue (on the H200 at 64
conversations, aborting turns D would have started, and running them again, turned queueing into failed
turns). So the deadline is renewed, up to ``cap_s`` from the start in all: the leg's whole timeout
(``timeouts.prefill_s`` for P, ``timeouts.decode_read_s`` for D). Progress seen before the wait began counts
for nothing (an engine that froze or went unreachable had moved its counters just before), and neither does
an engine whose health probe fails. A wait on an engine the fleet finds lost (``Fleet.lost_since``: health
probes failing in a row, nothing computed since) is given up at once, whatever its deadline.
``TurnRun.until_aborted`` waits by these.
"""

from __future__ import annotations

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

    def renews(self, engine: InstanceView | None, started: float, now: float, since: float) -> bool:
        """Whether the wait goes on for another ``first_s`` once the deadline passed (``started`` and ``now``:
        loop times): the engine answers its health probe and computed something after ``since`` (the fleet's
        clock: the later of the wait's start and ``first_s`` ago), and the cap allows it."""
        busy = engine is not None and engine.healthy and engine.progressed_at > since
        return busy and now - started + self.first_s <= self.cap_s

    @staticmethod
    def lost(engine: InstanceView | None, lost_since: float | None, waited_from: float) -> bool:
        """Whether a wait that began at ``waited_from`` (the fleet's clock) is given up because its engine is
        lost: it failed its health probes since ``lost_since`` and computed nothing since then, nor since the
        wait began."""
        if lost_since is None:
            return False
        return engine is None or engine.progressed_at <= max(lost_since, waited_from)
