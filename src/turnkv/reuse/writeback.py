"""After a turn: write D's KV back to P's prefix cache, keep it pinned on D, or let it go.

Pure: what the gateway measured about the conversation's next turn and the engines in (``AfterFacts``), the
choice and its reason out (``AfterChoice``).

A pin holds D's memory through the user's think time; under load that memory is what D's running streams
need (on the H200 at 64 conversations, pins held D at 97-99% KV and turns waited there for half a minute).
A write-back frees it at once: P pulls the blocks into its own prefix cache (evictable, as any other
prompt it computed; ``Engine.write_back``) during the think time, and the next turn, which extends the
sequence, finds it there and computes only its new tokens, the transfer off its path. It pays when:

* P has room for it now (``write_back.prefill_max_kv_usage``): a write-back that P cannot allocate waits at
  the head of its first-come queue, and a P that is full evicts what it is given;
* P's prefix cache keeps what it is given (``min_cache_factor``: the share of the hits the gateway expected of
  P that P reported);
* the conversation's next turn mostly comes after the write-back is done: the conversations' think time (the
  median of the gaps the gateway saw between a turn's end and the next turn) is longer than the transfer of
  what P lacks of the sequence, at the link's measured rate. P's queue does not count: P takes requests in
  order, so a write-back sent before the next turn is pulled before that turn is scheduled. An agent's tool
  loop (the next call the instant the stream ends) keeps its pin where the policy would pull it, or D's own
  cache where D would take the turn; so does every conversation until the gateway has seen a few think
  times. A write-back the next turn overtakes costs little: that turn recomputes on P what P lacked.

Where D is short of KV or turns wait on it (``decode_pressed``), nothing is kept pinned: the handle is
written back where P can take it, else let go. Otherwise a handle the policy would keep for a pull or as a
hedge (``Keep``) is written back where that pays, and kept where it does not; one the policy would not
keep (D would take the next turn from its own prefix cache) is let go, as before. ``write_back.mode:
always`` writes back every handle where P has room; ``off`` keeps or lets go as before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from turnkv.reuse.decision import Keep


class AfterChoice(enum.StrEnum):
    WRITE_BACK = "write_back"  # to P's prefix cache; D's pin freed once P has it
    KEEP = "keep"  # pinned on D for a pull (or a hedge)
    LET_GO = "let_go"  # released now; its blocks stay in D's prefix cache (evictable)


class Why(enum.StrEnum):
    """Why a handle was not written back (the log's ``write_back`` reason)."""

    OFF = "off"  # write_back.mode: off
    NOT_KEPT = "not_kept"  # the policy would not keep it: D takes the next turn from its own cache
    PREFILL_FULL = "prefill_full"  # P's KV too full now to take it
    PREFILL_EVICTS = "prefill_evicts"  # P's cache has not kept what it was expected to
    THINK_TOO_SHORT = "think_too_short"  # the next turn would come before the write-back is done
    THINK_UNKNOWN = "think_unknown"  # the gateway has not seen enough think times yet
    NO_PREFILL = "no_prefill"  # no prefill engine to write back to


@dataclass(frozen=True)
class AfterFacts:
    keep: Keep  # the policy's own view of the handle (``AdaptivePolicy.keeps_pin``)
    decode_pressed: bool  # D short of KV, or turns waiting on it (now)
    has_prefill: bool  # a prefill engine to write back to
    prefill_kv_usage: float  # P's KV usage now, with the write-back's blocks it lacks
    prefill_cache_factor: float  # of the prefix-cache hits expected of P, the share it delivered (1: all)
    transfer_s: float  # the write-back's transfer: what P lacks of the sequence, at the link's rate
    think_s: float | None  # the conversations' think time, their median (None: not measured yet)


@dataclass(frozen=True)
class AfterParams:
    mode: str = "auto"  # auto | always | off
    prefill_max_kv_usage: float = 0.85
    min_cache_factor: float = 0.5


@dataclass(frozen=True)
class After:
    choice: AfterChoice
    why: Why | None = None  # why not written back (None: it is, or no write-back was in question)


def pays(f: AfterFacts, p: AfterParams) -> Why | None:
    """Why a write-back would not pay now (None: it would)."""
    if not f.has_prefill:
        return Why.NO_PREFILL
    if f.prefill_kv_usage > p.prefill_max_kv_usage:
        return Why.PREFILL_FULL
    if p.mode == "always":
        return None
    if f.prefill_cache_factor < p.min_cache_factor:
        return Why.PREFILL_EVICTS
    if f.decode_pressed:
        return None  # nothing stays pinned on a pressed D: a write-back is the only way to keep the reuse
    if f.think_s is None:
        return Why.THINK_UNKNOWN
    if f.think_s < f.transfer_s:
        return Why.THINK_TOO_SHORT
    return None


def after_turn(f: AfterFacts, p: AfterParams) -> After:
    """What becomes of a turn's new handle (see the module docstring)."""
    if p.mode == "off":
        return After(AfterChoice.KEEP if f.keep.kept and not f.decode_pressed else AfterChoice.LET_GO, Why.OFF)
    if not f.keep.kept and not f.decode_pressed and p.mode != "always":
        return After(AfterChoice.LET_GO, Why.NOT_KEPT)
    why = pays(f, p)
    if why is None:
        return After(AfterChoice.WRITE_BACK)
    if f.decode_pressed or not f.keep.kept:
        return After(AfterChoice.LET_GO, why)
    return After(AfterChoice.KEEP, why)
