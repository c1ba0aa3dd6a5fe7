"""The simulated engine core: admission, KV-transfer roles, continuous batching, and block pins.

Decides, per request, what vLLM's scheduler and NixlConnector would: the local prefix-cache hit
(capped at prompt length - 1), how many tokens to pull from a remote engine (all that is missing
for ``do_remote_prefill``; ``min(remote_num_tokens, prompt) - local_hit`` for a handle carrying
``do_remote_decode``, unless below ``kv_recompute_threshold``), how remote blocks line up (the
remote list end-trimmed to the local blocks, no token check), what a failed or declined pull does
(``kv_load_failure_policy``), and which blocks stay pinned after a request finishes and for how
long (P: ``kv_lease_duration``; D in bidirectional mode: ``decoder_kv_blocks_ttl``). A request
whose prompt does not fit in the free blocks waits for blocks to be freed, as in vLLM's queue.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from turnkv.sim.blocks import BlockPool, OutOfBlocks, block_hashes
from turnkv.sim.costs import CostModel
from turnkv.sim.metrics import EngineMetrics
from turnkv.sim.oracle import ROOT_KV, Generator, Sampling, kv_extend, kv_step
from turnkv.sim.sidechannel import SideChannelClient, SideChannelServer, TransferError
from turnkv.sim.tokenizer import Tokenizer

log = logging.getLogger("turnkv.sim")

EXPIRY_SAFETY_MARGIN_S = 5.0  # vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN
_HANDLE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


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
    max_model_len: int = Field(40960, ge=16)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(0, ge=0, le=65535)
    clock_skew_s: float = 0.0
    seed: int = 0
    costs: CostModel = Field(default_factory=CostModel)

    @property
    def has_connector(self) -> bool:
        return self.role != "colocated"


class EngineError(RuntimeError):
    """The request failed inside the engine; the API answers 500 "Internal server error"."""


@dataclass
class Output:
    token_ids: list[int]
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0


@dataclass
class _Pin:
    block_ids: list[int]
    deadline: float
    decode_side: bool


@dataclass
class _Seq:
    request_id: str
    prompt: list[int]
    sampling: Sampling
    params: dict[str, Any] | None
    arrival: float
    gen: Generator
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    external: int = 0
    load: bool = False
    load_blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    queue: asyncio.Queue[Output | BaseException] = field(default_factory=asyncio.Queue)
    done: bool = False
    first_token_at: float | None = None


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, metrics: EngineMetrics) -> None:
        self.cfg = config
        self.tok = tokenizer
        self.metrics = metrics
        self.engine_id = str(uuid.uuid4())
        self.side_channel_port = config.side_channel_port
        self._skew = config.clock_skew_s
        self.pool = BlockPool(config.num_blocks, config.block_size, enable_caching=config.prefix_caching)
        self.pins: dict[str, _Pin] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self.blocked = 0  # requests waiting for free blocks
        self._link_lock = asyncio.Lock()
        self._sidechannel = SideChannelServer(self._on_side_channel)
        self._tasks: list[asyncio.Task[None]] = []
        self._cache_root = hash(("turnkv-sim", config.seed))

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.cfg.has_connector:
            self.side_channel_port = await self._sidechannel.start(
                self.cfg.side_channel_host, self.cfg.side_channel_port)
        self._tasks = [asyncio.create_task(self._step_loop()), asyncio.create_task(self._expiry_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._sidechannel.close()

    def clock(self) -> float:
        """This engine's ``perf_counter`` domain, in which ``remote_blocks_expiry_time`` is stated."""
        return time.perf_counter() + self._skew

    def restart(self) -> None:
        """As a process restart: new engine id, empty cache, every request and pin gone."""
        for seq in [*self._waiting, *self._running]:
            self._fail(seq, EngineError("engine restarted"))
        self._waiting.clear()
        self._running.clear()
        self.pins.clear()
        self.engine_id = str(uuid.uuid4())
        self.pool = BlockPool(self.cfg.num_blocks, self.cfg.block_size,
                              enable_caching=self.cfg.prefix_caching)
        self._release([])  # requests waiting for blocks try the new pool
        self.metrics.process_start.set(time.time())

    def expire_handles(self) -> int:
        """Let every pin's TTL elapse now: blocks freed, and this engine's clock moved past them."""
        n = len(self.pins)
        for rid in list(self.pins):
            self._unpin(rid)
        self._skew += self.cfg.decoder_kv_blocks_ttl + EXPIRY_SAFETY_MARGIN_S
        return n

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self, prompt: Sequence[int], sampling: Sampling, kv_params: dict[str, Any] | None, request_id: str,
        arrival: float | None = None,
    ) -> AsyncGenerator[Output, None]:
        """Run one request; yields token outputs, the last one with ``finish_reason`` set."""
        seq = _Seq(
            request_id=f"{request_id}-{secrets.token_hex(4)}", prompt=list(prompt), sampling=sampling,
            params=dict(kv_params) if kv_params and self.cfg.has_connector else None,
            arrival=time.perf_counter() if arrival is None else arrival, gen=Generator(self.tok, sampling),
        )
        if kv_params and not self.cfg.has_connector:
            log.warning("Got kv_transfer_params, but no KVConnector found. "
                        "Disabling KVTransfer for this request.")
        try:
            await self._admit_when_blocks_free(seq)
            if seq.load:
                await self._load(seq)
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

    async def _admit_when_blocks_free(self, seq: _Seq) -> None:
        """Admit ``seq``; while the free blocks cannot hold its prompt, wait for some to be freed,
        as vLLM's scheduler leaves a request it cannot allocate in the waiting queue."""
        need = -(-len(seq.prompt) // self.cfg.block_size)
        if need > self.pool.num_blocks:
            raise EngineError(f"the prompt needs {need} KV blocks; the engine has {self.pool.num_blocks}")
        while True:
            freed = self._freed
            try:
                self._admit(seq)
                return
            except OutOfBlocks:
                self.blocked += 1
                try:
                    await freed.wait()
                finally:
                    self.blocked -= 1

    def _release(self, block_ids: Sequence[int]) -> None:
        self.pool.release(block_ids)
        self._freed.set()
        self._freed = asyncio.Event()

    def _admit(self, seq: _Seq) -> None:
        bs = self.cfg.block_size
        n = len(seq.prompt)
        seq.hashes = block_hashes(seq.prompt, bs, self._cache_root)
        hit = self.pool.lookup(seq.hashes[: (n - 1) // bs])
        self.pool.acquire(hit)
        local = len(hit) * bs
        try:
            external, seq.load = self._external_tokens(seq, local)
            seq.block_ids = hit + self.pool.allocate(-(-n // bs) - len(hit))
        except (EngineError, OutOfBlocks):
            self.pool.release(hit)
            raise
        self.metrics.prefix_cache_queries.inc(n)
        self.metrics.prefix_cache_hits.inc(local)
        seq.num_computed = seq.num_cached = local
        seq.external = external
        if external:
            first = local // bs
            seq.load_blocks = seq.block_ids[first: -(-(local + external) // bs)]
        if self.cfg.has_connector:
            self.metrics.external_queries.inc(n - local)

    def _external_tokens(self, seq: _Seq, local: int) -> tuple[int, bool]:
        """vLLM's get_num_new_matched_tokens and update_state_after_alloc, for one request: the
        tokens to pull, and whether a recv is queued at all (an empty one only sends "done")."""
        p = seq.params
        if p is None:
            return 0, False
        n = len(seq.prompt)
        handle = bool(p.get("remote_block_ids")) and all(k in p for k in _HANDLE_KEYS)
        if p.get("do_remote_prefill"):
            # with nothing to pull, P is still told to free its blocks
            return (max(n - local, 0), True) if handle else (0, False)
        if p.get("do_remote_decode") and handle:
            if not self.cfg.bidirectional:
                raise EngineError("KV load from a decode handle requested, but bidirectional_kv_xfer is off")
            count = min(int(p.get("remote_num_tokens") or 0), n) - local
            threshold = self.cfg.kv_recompute_threshold
            if count <= 0 or (threshold > 0 and count < threshold):
                return 0, True  # an empty recv still notifies D, which frees its pinned blocks
            return count, True
        return 0, False

    async def _load(self, seq: _Seq) -> None:
        """Pull ``seq.external`` tokens' blocks from the engine named in the handle."""
        p = seq.params
        assert p is not None
        remote = list((p.get("remote_block_ids") or [[]])[0])
        local_blocks = seq.load_blocks
        if len(local_blocks) > len(remote):
            # vLLM asserts num_local_blocks <= len(remote_group) and the engine dies.
            raise EngineError(
                f"AssertionError: {len(local_blocks)} local blocks > {len(remote)} remote blocks")
        remote = remote[len(remote) - len(local_blocks):] if local_blocks else []
        started = time.perf_counter()
        try:
            async with SideChannelClient(str(p["remote_host"]), int(p["remote_port"])) as sc:
                peer = await sc.handshake(str(p["remote_engine_id"]))
                offset = peer.clock - self.clock()
                expiry = p.get("remote_blocks_expiry_time")
                expired = expiry is not None and self.clock() + EXPIRY_SAFETY_MARGIN_S >= float(expiry) - offset
                if local_blocks and self.cfg.bidirectional and expired:
                    self.metrics.kv_expired.inc()
                    raise TransferError(
                        f"Declining expired remote read for {seq.request_id} from engine {peer.engine_id}.")
                if local_blocks:
                    nbytes = len(local_blocks) * self.cfg.block_size * self.cfg.costs.kv_bytes_per_token
                    async with self._link_lock:
                        await self._sleep(self.cfg.costs.transfer_link().seconds(nbytes))
                        blocks = await sc.read(peer.engine_id, remote)
                    for bid, values in zip(local_blocks, blocks, strict=True):
                        self.pool.write(bid, 0, values)
                    self.metrics.xfer_time.observe(time.perf_counter() - started)
                    self.metrics.xfer_bytes.observe(nbytes)
                await sc.notify(str(p["remote_request_id"]))
        except TransferError as exc:
            self.metrics.failed_transfers.inc()
            log.warning("KV transfer for %s failed: %s", seq.request_id, exc)
            if not local_blocks:
                return  # a failed "done" notification invalidates no block: the request goes on
            if self.cfg.kv_load_failure_policy == "fail":
                raise EngineError("Internal server error") from exc
            seq.external = 0
            log.warning("Recovered from KV load failure: 1 request(s) rescheduled")
            return
        bs = self.cfg.block_size
        for k in range(seq.num_computed // bs, min((seq.num_computed + seq.external) // bs, len(seq.hashes))):
            # cached under this request's token hashes, whatever the blocks were computed from
            self.pool.commit(seq.block_ids[k], seq.hashes[k])
        seq.num_computed += seq.external
        seq.num_cached += seq.external
        self.metrics.external_hits.inc(seq.external)
        if seq.num_computed >= len(seq.prompt):
            seq.num_computed = len(seq.prompt) - 1  # the last prompt token is recomputed to sample

    # -- the step loop -----------------------------------------------------------------------
    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(self.cfg.costs.scaled(seconds))

    async def _step_loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            self.metrics.running.set(len(self._running))
            self.metrics.waiting.set(len(self._waiting) + self.blocked)
            decoding = list(self._running)
            budget = self.cfg.max_num_batched_tokens - len(decoding)
            chunks: list[tuple[_Seq, int]] = []
            for seq in self._waiting:
                if budget <= 0:
                    break
                n = min(budget, len(seq.prompt) - seq.num_computed)
                chunks.append((seq, n))
                budget -= n
            costs = self.cfg.costs
            duration = costs.decode_s(len(decoding))
            if chunks:
                prefill = sum(costs.prefill_s(n, s.num_computed) for s, n in chunks)
                duration += max(costs.prefill_floor_s, prefill)
            await self._sleep(duration)
            for seq in decoding:
                if not seq.done:
                    self._decode_one(seq)
            for seq, n in chunks:
                if not seq.done:
                    self._prefill_chunk(seq, n)
            self.metrics.kv_usage.set(self.pool.usage())

    def _prev_kv(self, seq: _Seq, position: int) -> int:
        return ROOT_KV if position == 0 else self.pool.value_at(seq.block_ids, position - 1)

    def _write(self, seq: _Seq, start: int, values: Sequence[int]) -> None:
        bs = self.cfg.block_size
        pos, i = start, 0
        while i < len(values):
            off = pos % bs
            take = min(bs - off, len(values) - i)
            self.pool.write(seq.block_ids[pos // bs], off, values[i:i + take])
            if off + take == bs and pos // bs < len(seq.hashes):
                self.pool.commit(seq.block_ids[pos // bs], seq.hashes[pos // bs])
            pos += take
            i += take

    def _prefill_chunk(self, seq: _Seq, n: int) -> None:
        start = seq.num_computed
        values = kv_extend(self._prev_kv(seq, start), seq.prompt[start:start + n], start)
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
        self._sample(seq, values[-1])
        if not seq.done:
            self._running.append(seq)

    def _decode_one(self, seq: _Seq) -> None:
        pos = seq.num_computed
        bs = self.cfg.block_size
        if pos // bs >= len(seq.block_ids):
            try:
                seq.block_ids += self.pool.allocate(1)
            except OutOfBlocks as exc:
                self._fail(seq, EngineError(str(exc)))
                return
        if pos % bs == bs - 1 and len(seq.hashes) == pos // bs:
            parent = seq.hashes[-1] if seq.hashes else self._cache_root
            seq.hashes.append(hash((parent, tuple(self._tokens(seq, pos + 1 - bs, pos + 1)))))
        value = kv_step(self._prev_kv(seq, pos), seq.output[-1], pos)
        self._write(seq, pos, [value])
        seq.num_computed += 1
        self._sample(seq, value)

    @staticmethod
    def _tokens(seq: _Seq, start: int, end: int) -> list[int]:
        n = len(seq.prompt)
        return seq.prompt[start:min(end, n)] + seq.output[max(start - n, 0):max(end - n, 0)]

    def _sample(self, seq: _Seq, kv: int) -> None:
        token = seq.gen.next_token(kv, len(seq.output))
        seq.output.append(token)
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
        params = self._request_finished(seq)
        seq.queue.put_nowait(Output([token], reason, params, seq.num_cached))

    def _request_finished(self, seq: _Seq) -> dict[str, Any] | None:
        """vLLM's NixlPullConnectorScheduler.request_finished: pin the blocks, or free them now."""
        p = seq.params
        if not p:
            self._release(seq.block_ids)
            return None
        is_p_node = bool(p.get("do_remote_decode"))
        if not is_p_node and not self.cfg.bidirectional:
            self._release(seq.block_ids)
            return None
        ttl = self.cfg.kv_lease_duration if is_p_node else self.cfg.decoder_kv_blocks_ttl
        deadline = self.clock() + ttl
        blocks = seq.block_ids[: -(-seq.num_computed // self.cfg.block_size)]
        self._release(seq.block_ids[len(blocks):])
        self.pins[seq.request_id] = _Pin(blocks, deadline, decode_side=not is_p_node)
        out: dict[str, Any] = {
            "do_remote_prefill": is_p_node,
            "do_remote_decode": not is_p_node,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": seq.num_computed,
            "remote_blocks_expiry_time": None if is_p_node else deadline,
        }
        if self.cfg.compat == "0.33":
            out.update(dcp_size=1, pp_size=1, transfer_mode="pull", remote_registration_generation=0)
        return out

    def _fail(self, seq: _Seq, exc: BaseException) -> None:
        seq.queue.put_nowait(exc)
        self._abort(seq)

    def _abort(self, seq: _Seq) -> None:
        if seq.done:
            return
        seq.done = True
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        self._release(seq.block_ids)
        self.metrics.finished("abort")

    # -- pins and the side channel -----------------------------------------------------------
    def _unpin(self, request_id: str) -> bool:
        pin = self.pins.pop(request_id, None)
        if pin is None:
            return False
        self._release(pin.block_ids)
        return True

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = self.clock()
            for rid, pin in list(self.pins.items()):
                if pin.deadline <= now:
                    log.info("Releasing expired KV blocks for request %s", rid)
                    self.metrics.kv_expired.inc()
                    self._unpin(rid)

    async def _on_side_channel(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "handshake":
            return {"ok": True, "engine_id": self.engine_id, "clock": self.clock()}
        if op == "read":
            if msg["engine_id"] != self.engine_id:
                return {"ok": False, "error": "Remote NIXL agent engine ID mismatch"}
            ids = [int(b) for b in msg["block_ids"]]
            if any(not 0 <= b < self.pool.num_blocks for b in ids):
                return {"ok": False, "error": "invalid block id"}
            return {"ok": True, "blocks": [self.pool.read(b) for b in ids]}
        if op == "notify":
            self._unpin(str(msg["request_id"]))
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def pinned_tokens(self) -> int:
        return sum(len(p.block_ids) for p in self.pins.values() if p.decode_side) * self.cfg.block_size
