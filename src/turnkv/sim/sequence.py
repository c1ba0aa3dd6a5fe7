"""The state of one request inside a simulated engine, what the engine hands back, and its error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from turnkv.sim.oracle import Generator, Sampling


class EngineError(RuntimeError):
    """The request failed inside the engine; the API answers 500 "Internal server error"."""


@dataclass
class Output:
    token_ids: list[int]
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0


@dataclass
class Seq:
    """One request: its prompt, blocks, progress, the pull it was granted, and its output queue."""

    request_id: str
    prompt: list[int]
    sampling: Sampling
    params: dict[str, Any] | None
    arrival: float
    gen: Generator
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    cache_root: int = 0  # the prefix-cache hash chain's root: the engine's, salted by the request's cache_salt
    num_computed: int = 0
    num_cached: int = 0
    external: int = 0
    load: bool = False
    admitted: bool = False  # its blocks were allocated (vLLM: update_state_after_alloc ran)
    load_blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    queue: asyncio.Queue[Output | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False
    stalled: bool = False  # no free block for its next token (none can be made: it waits in place)
    resume: list[int] | None = None  # after a preemption: the KV of every position it had computed
    first_token_at: float | None = None
    # for vLLM's latency histograms: when it was admitted (less the time its KV load took), first
    # scheduled, and gave its last token
    queued_at: float | None = None
    load_s: float = 0.0
    scheduled_at: float | None = None
    last_token_at: float | None = None
