"""The simulated engine core: admission, continuous batching, and the KV each step computes.

Decides what vLLM's scheduler would: the local prefix-cache hit (full blocks, capped below the
prompt length so one token is computed), when a request is admitted (in arrival order, first come
first served: a prompt that does not fit in the free blocks waits for blocks to be freed, and every
request that arrived after it waits behind it however small, as vLLM's FCFS waiting queue stops at
the first request it cannot allocate; when a running stream
needs a block for its next token and none is free, the newest running request is preempted as vLLM
does: its blocks are freed and, once blocks are free again and before any new request, its KV is
recomputed (from what its prefix cache kept) and it decodes on with the same answer), how prefill chunks
and decode steps share a step (``schedule_chunks``: the running streams' decode tokens first out of
``max_num_batched_tokens``, then prefill chunks in arrival order, a long prompt split over steps),
how long a step takes (``costs.step_s`` of the decode batch, the context it reads and the prefill
chunks in it: a prefill lengthens the step every running stream waits for), and which KV values
each step writes (``oracle``). What a request pulls
from another engine and what it pins when it finishes is the ``connector``'s decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from turnkv.sim.blocks import BlockPool, OutOfBlocks, block_hashes
from turnkv.sim.connector import EXPIRY_SAFETY_MARGIN_S, Connector
from turnkv.sim.costs import CostModel
from turnkv.sim.gpu import SharedGpu
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import ROOT_KV, Generator, Sampling, kv_extend, kv_step
from turnkv.sim.sequence import EngineError, Output, Seq
from turnkv.sim.sidechannel import SideChannelServer
from turnkv.sim.tokenizer import Tokenizer

if TYPE_CHECKING:
    from turnkv.sim.connector import Pin

log = logging.getLogger("turnkv.sim")
STALL_WAIT_S = 0.05


def schedule_chunks(
    max_num_batched_tokens: int, decode_batch: int, remaining: Sequence[int], long_prefill_token_threshold: int = 0
) -> list[int]:
    """The prefill chunk each waiting request gets in one step, in order, as vLLM's scheduler with chunked
    prefill gives them: every running stream's decode token comes first out of ``max_num_batched_tokens``,
    then each waiting request takes what is left, up to its remaining prompt and, when
    ``long_prefill_token_threshold`` is set, up to that many tokens a step; what does not fit goes on in
    the next steps. The list stops at the first request that gets nothing."""
    budget = max_num_batched_tokens - decode_batch
    cap = long_prefill_token_threshold if long_prefill_token_threshold > 0 else budget
    out: list[int] = []
    for left in remaining:
        if budget <= 0:
            break
        n = min(budget, left, cap)
        out.append(n)
        budget -= n
    return out


class EngineConfig(BaseModel):
    role: Literal["prefill", "decode", "colocated"] = "colocated"
    compat: Literal["0.26", "0.33"] = "0.26"
    block_size: int = Field(16, ge=1)
    num_blocks: int = Field(20000, ge=16)
    prefix_caching: bool = True
    bidirectional: bool = True
    kv_recompute_threshold: int = Field(64, ge=0)
    decoder_kv_blocks_ttl: float = Field(480.0, gt=0)
    kv_lease_duration: float = Field(30.0, gt=0)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    max_num_batched_tokens: int = Field(8192, ge=16)
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="most prefill tokens of one request a step "
        "(vLLM's --long-prefill-token-threshold); 0: the budget's rest",
    )
    max_model_len: int = Field(40960, ge=16)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(0, ge=0, le=65535)
    clock_skew_s: float = 0.0
    seed: int = 0
    costs: CostModel = Field(default_factory=CostModel)
    gpu_share_file: str | None = Field(
        None, description="a file the engines on one GPU share its compute through (``sim.gpu``); none: its own"
    )

    @property
    def has_connector(self) -> bool:
        return self.role != "colocated"


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, metrics: EngineMetrics) -> None:
        self.cfg = config
        self.tok = tokenizer
        self.metrics = metrics
        self.engine_id = str(uuid.uuid4())
        self.side_channel_port = config.side_channel_port
        self._skew = config.clock_skew_s
        self.pool = BlockPool(config.num_blocks, config.block_size, enable_caching=config.prefix_caching)
        self.connector = Connector(self)
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._preempted: deque[Seq] = deque()  # to be recomputed before any new request is admitted
        self._arrivals: deque[Seq] = deque()  # not admitted yet, in arrival order: only the first may be
        self.preemptions = 0
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self.blocked = 0  # requests waiting for free blocks
        self._sidechannel = SideChannelServer(self.connector.on_side_channel)
        self._tasks: list[asyncio.Task[None]] = []
        self.gpu: SharedGpu | None = None
        self._cache_root = hash(("turnkv-sim", config.seed))
        self._evictions_counted = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.cfg.gpu_share_file and self.cfg.costs.time_scale > 0:
            self.gpu = SharedGpu(Path(self.cfg.gpu_share_file))
        if self.cfg.has_connector and self.cfg.bidirectional:
            log.info(  # vLLM's start-up line (nixl/base_scheduler.py), the one place its log says the flag
                "Bidirectional KV transfer is enabled and the kv recompute threshold is set to %d tokens."
                "KV blocks on D are released after a TTL of %d seconds.",
                self.cfg.kv_recompute_threshold,
                self.cfg.decoder_kv_blocks_ttl,
            )
        if self.cfg.has_connector:
            self.side_channel_port = await self._sidechannel.start(
                self.cfg.side_channel_host, self.cfg.side_channel_port
            )
        self._tasks = [asyncio.create_task(self._step_loop()), asyncio.create_task(self.connector.expiry_loop())]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.connector.notices]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._sidechannel.close()
        if self.gpu is not None:
            self.gpu.close()

    @property
    def pins(self) -> dict[str, Pin]:
        """Blocks held after their request finished: P's leases and, bidirectional, D's handles."""
        return self.connector.pins

    def report_load(self) -> None:
        """Running and waiting requests and KV usage, as vLLM's gauges say them now."""
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(
            len(self._waiting) + self.blocked + len(self._preempted) + sum(s.stalled for s in self._running)
        )
        self.metrics.kv_usage.set(self.pool.usage())
        self.metrics.cached_blocks.set(self.pool.num_cached)
        self.metrics.evictions.inc(self.pool.evictions - self._evictions_counted)
        self._evictions_counted = self.pool.evictions

    def pinned_tokens(self) -> int:
        return self.connector.pinned_tokens()

    def clock(self) -> float:
        """This engine's ``perf_counter`` domain, in which ``remote_blocks_expiry_time`` is stated."""
        return time.perf_counter() + self._skew

    def restart(self) -> None:
        """As a process restart: new engine id, empty cache, every request and pin gone."""
        for seq in [*self._waiting, *self._running, *self._preempted]:
            self._fail(seq, EngineError("engine restarted"))
        self._waiting.clear()
        self._running.clear()
        self._preempted.clear()
        self.connector.pins.clear()
        self.engine_id = str(uuid.uuid4())
        self.pool = BlockPool(self.cfg.num_blocks, self.cfg.block_size, enable_caching=self.cfg.prefix_caching)
        self._evictions_counted = 0
        self.release_blocks([])  # requests waiting for blocks try the new pool
        self.metrics.process_start.set(time.time())

    def expire_handles(self) -> int:
        """Let every pin's TTL elapse now: blocks freed, and this engine's clock moved past them."""
        n = self.connector.expire_all()
        self._skew += self.cfg.decoder_kv_blocks_ttl + EXPIRY_SAFETY_MARGIN_S
        return n

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Sequence[int],
        sampling: Sampling,
        kv_params: dict[str, Any] | None,
        request_id: str,
        arrival: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[Output, None]:
        """Run one request; yields token outputs, the last one with ``finish_reason`` set. As in vLLM, a
        ``cache_salt`` keys the prefix cache: blocks cached under another salt (or none) never match."""
        seq = Seq(
            request_id=f"{request_id}-{secrets.token_hex(4)}",
            prompt=list(prompt),
            sampling=sampling,
            params=dict(kv_params) if kv_params and self.cfg.has_connector else None,
            arrival=time.perf_counter() if arrival is None else arrival,
            gen=Generator(self.tok, sampling),
            cache_root=self._cache_root if cache_salt is None else hash((self._cache_root, cache_salt)),
        )
        if kv_params and not self.cfg.has_connector:
            log.warning("Got kv_transfer_params, but no KVConnector found. Disabling KVTransfer for this request.")
        try:
            seq.queued_at = time.perf_counter()
            await self._admit_when_blocks_free(seq)
            if seq.load:
                loading = time.perf_counter()
                await self.connector.load(seq)
                seq.load_s = time.perf_counter() - loading
            self._waiting.append(seq)
            self._wake.set()
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.done:
                self._abort(seq)

    async def _admit_when_blocks_free(self, seq: Seq) -> None:
        """Admit ``seq`` once every request that arrived before it was admitted; while the free blocks
        cannot hold its prompt, wait for some to be freed. vLLM's FCFS scheduler walks its waiting queue
        in order and stops at the first request it cannot allocate, so a one-block request waits behind
        a long prompt that does not fit (a release sent to a full P among them)."""
        need = -(-len(seq.prompt) // self.cfg.block_size)
        if need > self.pool.num_blocks:
            raise EngineError(f"the prompt needs {need} KV blocks; the engine has {self.pool.num_blocks}")
        self._arrivals.append(seq)
        try:
            while True:
                freed = self._freed
                try:
                    if self._preempted:  # requests preempted for blocks are recomputed first
                        raise OutOfBlocks("preempted requests wait")
                    if self._arrivals[0] is not seq:
                        raise OutOfBlocks("an earlier request waits for blocks")
                    self._admit(seq)
                    return
                except OutOfBlocks:
                    self.blocked += 1
                    try:
                        await freed.wait()
                    finally:
                        self.blocked -= 1
        finally:
            head = self._arrivals[0] is seq
            self._arrivals.remove(seq)
            if head and self._arrivals:
                self.release_blocks([])  # the next in line tries now

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        self.pool.release(block_ids)
        self._freed.set()
        self._freed = asyncio.Event()

    def _admit(self, seq: Seq) -> None:
        bs = self.cfg.block_size
        n = len(seq.prompt)
        seq.hashes = block_hashes(seq.prompt, bs, seq.cache_root)
        hit = self.pool.lookup(seq.hashes[: (n - 1) // bs])
        self.pool.acquire(hit)
        local = len(hit) * bs
        try:
            external, seq.load = self.connector.external_tokens(seq, local)
            seq.block_ids = hit + self.pool.allocate(-(-n // bs) - len(hit))
        except (EngineError, OutOfBlocks):
            self.pool.release(hit)
            raise
        self.metrics.prefix_cache_queries.inc(n)
        self.metrics.prefix_cache_hits.inc(local)
        seq.num_computed = seq.num_cached = local
        seq.external = external
        seq.admitted = True
        if external:
            first = local // bs
            seq.load_blocks = seq.block_ids[first : -(-(local + external) // bs)]
        if self.cfg.has_connector:
            self.metrics.external_queries.inc(n - local)

    # -- the step loop -----------------------------------------------------------------------
    async def sleep(self, seconds: float) -> None:
        """Wait out a simulated duration, scaled by ``time_scale``."""
        await asyncio.sleep(self.cfg.costs.scaled(seconds))

    async def compute(self, seconds: float) -> None:
        """Run ``seconds`` of GPU work: alone, or sharing the GPU with the engines computing on it too."""
        if self.gpu is None:
            await self.sleep(seconds)
        else:
            await self.gpu.run(seconds, self.sleep)

    async def _step_loop(self) -> None:
        while True:
            if not self._waiting and not self._running and not self._preempted:
                self._wake.clear()
                await self._wake.wait()
            self.report_load()
            self._resume_preempted()
            decoding = self._make_room()
            sizes = schedule_chunks(
                self.cfg.max_num_batched_tokens,
                len(decoding),
                [self._target(s) - s.num_computed for s in self._waiting],
                self.cfg.long_prefill_token_threshold,
            )
            chunks = list(zip(self._waiting, sizes, strict=False))
            self._scheduled([s for s, n in chunks if n > 0])
            duration = self.cfg.costs.step_s(
                len(decoding), sum(s.num_computed for s in decoding), [(n, s.num_computed) for s, n in chunks]
            )
            freed = self._freed
            await self.compute(duration)
            for seq in decoding:
                if not seq.done:
                    self._decode_one(seq)
            for seq, n in chunks:
                if not seq.done:
                    self._prefill_chunk(seq, n)
            if not chunks and (all(s.stalled for s in decoding) if decoding else self._preempted):
                # nothing could move: wait for blocks to be freed (a release, an expiry), bounded so
                # that every wait is looked at again
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(freed.wait(), STALL_WAIT_S)
            self.metrics.kv_usage.set(self.pool.usage())

    def _scheduled(self, seqs: Sequence[Seq]) -> None:
        """vLLM's queue time: from its arrival (its KV load aside) to its first step."""
        now = time.perf_counter()
        for seq in seqs:
            if seq.scheduled_at is None and seq.queued_at is not None:
                seq.scheduled_at = now
                self.metrics.queue_time.observe(max(0.0, now - seq.queued_at - seq.load_s))

    @staticmethod
    def _target(seq: Seq) -> int:
        """The positions a waiting request computes before it decodes: its prompt, or, after a
        preemption, all it had computed."""
        return len(seq.prompt) if seq.resume is None else len(seq.resume)

    def _make_room(self) -> list[Seq]:
        """The decode batch of this step: every running stream gets a block for its next token; where
        none is free, the newest running requests are preempted for it (vLLM's scheduler). The newest
        stream itself is not preempted for nobody's sake: it waits in place (``stalled``) for a block."""
        bs = self.cfg.block_size
        for seq in list(self._running):
            if seq not in self._running:
                continue  # preempted for an older stream
            while not seq.done and seq.num_computed // bs >= len(seq.block_ids):
                try:
                    seq.block_ids += self.pool.allocate(1)
                except OutOfBlocks:
                    victim = self._running[-1]
                    if victim is seq:
                        break
                    self._preempt(victim)
        return list(self._running)

    def _preempt(self, seq: Seq) -> None:
        """Free a running request's blocks; its KV is kept aside, to be written again (at the cost of
        recomputing it) when it is resumed."""
        seq.resume = [self._prev_kv(seq, i + 1) for i in range(seq.num_computed)]
        self._running.remove(seq)
        self.release_blocks(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        self._preempted.appendleft(seq)
        self.preemptions += 1
        self.metrics.preemptions.inc()

    def _resume_preempted(self) -> None:
        """Readmit preempted requests, first preempted last, while their blocks fit: each is prefilled
        again (its prefix-cache hits aside) before any waiting prompt."""
        bs = self.cfg.block_size
        while self._preempted:
            seq = self._preempted[0]
            assert seq.resume is not None
            n = len(seq.resume)
            hit = self.pool.lookup(seq.hashes[: (n - 1) // bs])
            self.pool.acquire(hit)
            try:
                seq.block_ids = hit + self.pool.allocate(-(-n // bs) - len(hit))
            except OutOfBlocks:
                self.pool.release(hit)
                return
            seq.num_computed = len(hit) * bs
            self._preempted.popleft()
            self._waiting.appendleft(seq)

    def _prev_kv(self, seq: Seq, position: int) -> int:
        return ROOT_KV if position == 0 else self.pool.value_at(seq.block_ids, position - 1)

    def _write(self, seq: Seq, start: int, values: Sequence[int]) -> None:
        bs = self.cfg.block_size
        pos, i = start, 0
        while i < len(values):
            off = pos % bs
            take = min(bs - off, len(values) - i)
            self.pool.write(seq.block_ids[pos // bs], off, values[i : i + take])
            if off + take == bs and pos // bs < len(seq.hashes):
                self.pool.commit(seq.block_ids[pos // bs], seq.hashes[pos // bs])
            pos += take
            i += take

    def _prefill_chunk(self, seq: Seq, n: int) -> None:
        start = seq.num_computed
        if seq.resume is not None:  # a preempted request: its KV again, then it decodes on
            self._write(seq, start, seq.resume[start : start + n])
            seq.num_computed += n
            if seq.num_computed >= len(seq.resume):
                self._waiting.remove(seq)
                seq.resume = None
                self._running.append(seq)
            return
        values = kv_extend(self._prev_kv(seq, start), seq.prompt[start : start + n], start)
        self._write(seq, start, values)
        seq.num_computed += n
        self.metrics.prompt_tokens.inc(n)
        if seq.num_computed < len(seq.prompt):
            return
        self._waiting.remove(seq)
        computed = len(seq.prompt) - seq.num_cached
        self.metrics.tokens_local_compute.inc(max(computed, 0))
        self.metrics.tokens_local_cache_hit.inc(seq.num_cached - seq.external)
        self.metrics.tokens_external.inc(seq.external)
        seq.first_token_at = time.perf_counter()
        self.metrics.ttft.observe(seq.first_token_at - seq.arrival)
        if seq.scheduled_at is not None:
            self.metrics.prefill_time.observe(seq.first_token_at - seq.scheduled_at)
        self._sample(seq, values[-1])
        if not seq.done:
            self._running.append(seq)

    def _decode_one(self, seq: Seq) -> None:
        pos = seq.num_computed
        bs = self.cfg.block_size
        if pos // bs >= len(seq.block_ids):
            try:
                seq.block_ids += self.pool.allocate(1)
            except OutOfBlocks:
                # vLLM preempts a request it cannot extend and runs it again once blocks are free: its
                # stream pauses, its answer is the same; here it waits for the block in place
                seq.stalled = True
                return
        seq.stalled = False
        if pos % bs == bs - 1 and len(seq.hashes) == pos // bs:
            parent = seq.hashes[-1] if seq.hashes else seq.cache_root
            seq.hashes.append(hash((parent, tuple(self._tokens(seq, pos + 1 - bs, pos + 1)))))
        value = kv_step(self._prev_kv(seq, pos), seq.output[-1], pos)
        self._write(seq, pos, [value])
        seq.num_computed += 1
        self._sample(seq, value)

    @staticmethod
    def _tokens(seq: Seq, start: int, end: int) -> list[int]:
        n = len(seq.prompt)
        return seq.prompt[start : min(end, n)] + seq.output[max(start - n, 0) : max(end - n, 0)]

    def _sample(self, seq: Seq, kv: int) -> None:
        token = seq.gen.next_token(kv, len(seq.output))
        seq.output.append(token)
        now = time.perf_counter()
        if seq.last_token_at is not None:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.generation_tokens.inc()
        s = seq.sampling
        reason = None
        if token == self.tok.eos_id and not s.ignore_eos and len(seq.output) >= s.min_tokens:
            reason = "stop"
        elif len(seq.output) >= s.max_tokens:
            reason = "length"
        if reason is None:
            seq.queue.put_nowait(Output([token]))
            return
        seq.done = True
        if seq in self._running:
            self._running.remove(seq)
        self.metrics.finished(reason)
        params = self.connector.request_finished(seq)
        seq.queue.put_nowait(Output([token], reason, params, seq.num_cached))

    def _fail(self, seq: Seq, exc: BaseException) -> None:
        seq.queue.put_nowait(exc)
        self._abort(seq)

    def _abort(self, seq: Seq) -> None:
        if seq.done:
            return
        seq.done = True
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._preempted:
            self._preempted.remove(seq)
        self.release_blocks(seq.block_ids)
        if not seq.admitted:
            self.connector.aborted_before_alloc(seq)
        self.metrics.finished("abort")
