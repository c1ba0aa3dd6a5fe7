"""Whether the decode engine that holds a conversation has room for its turn decode-local: its memory,
and its queue weighed against P's.

Pure: D's KV usage, the turns the gateway holds for room on D, D's queue and P's queue in (as
``reuse.load`` reads them), a ``DecodeRoom`` with its reason out.

* D's KV nearly full (``pressure_kv_usage``), or turns held in the gateway for room on D (the decode
  admission: D's queue all the same, for memory): no, ``decode_busy``. A D short of blocks has evicted its
  idle conversations' freed blocks first, so the turn would likely compute the whole history again there.
* Requests waiting on D: a decode-local turn waits D's queue before its prefill starts there; through P
  it waits P's queue first, and D's requests waiting now are scheduled while it does. So D's queue is
  weighed against P's: D's longer, no (``decode_queue``); else yes (``queued``: the policy then weighs the
  rest, with D's queue in its estimate). Refusing the turn whenever any request waits on D
  (``decode_memory.local_queue: refuse``) refuses it when P's queue is longest too, and the turn then waits
  longer at P. A P queue nobody measured counts as none (D's queue then refuses).
* Nothing waits on D: yes (``free``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from turnkv.reuse.assess import Reason


class RoomState(enum.StrEnum):
    FREE = "free"  # nothing waits on D
    QUEUED = "queued"  # requests wait on D, but P's queue is at least as long
    QUEUE_LONGER = "queue_longer"  # D's queue is longer than P's: no decode-local turn
    BUSY = "busy"  # D's KV is nearly full, or the gateway holds turns for room on it


@dataclass(frozen=True)
class DecodeRoom:
    state: RoomState
    decode_queue_ms: float | None = None
    prefill_queue_ms: float | None = None

    @property
    def ok(self) -> bool:
        """D may take the turn decode-local (the policy still decides whether it should)."""
        return self.state in (RoomState.FREE, RoomState.QUEUED)

    @property
    def reason(self) -> Reason | None:
        """Why not: ``decode_busy`` for memory, ``decode_queue`` for D's queue; None when it may."""
        if self.state is RoomState.BUSY:
            return Reason.DECODE_BUSY
        if self.state is RoomState.QUEUE_LONGER:
            return Reason.DECODE_QUEUE
        return None

    def log(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "decode_queue_ms": None if self.decode_queue_ms is None else round(self.decode_queue_ms, 1),
            "prefill_queue_ms": None if self.prefill_queue_ms is None else round(self.prefill_queue_ms, 1),
        }


def decode_room(
    *,
    kv_usage: float,
    pressure_kv_usage: float,
    held: int,
    decode_queue_ms: float | None,
    prefill_queue_ms: float | None,
) -> DecodeRoom:
    """Whether D has room for a decode-local turn. ``kv_usage``: D's, 0-1; ``held``: turns the gateway
    holds for room on D; ``decode_queue_ms``: how long a request sent to D now would wait there (None:
    D not read yet, taken as no queue); ``prefill_queue_ms``: how long at P (None: taken as none)."""
    if kv_usage >= pressure_kv_usage or held > 0:
        return DecodeRoom(RoomState.BUSY, decode_queue_ms, prefill_queue_ms)
    d = decode_queue_ms or 0.0
    if d <= 0:
        return DecodeRoom(RoomState.FREE, decode_queue_ms, prefill_queue_ms)
    if d > (prefill_queue_ms or 0.0):
        return DecodeRoom(RoomState.QUEUE_LONGER, decode_queue_ms, prefill_queue_ms)
    return DecodeRoom(RoomState.QUEUED, decode_queue_ms, prefill_queue_ms)
