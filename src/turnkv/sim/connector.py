"""The NixlConnector stand-in of one engine: what a request pulls, and which blocks stay pinned.

Decides what vLLM's NixlPullConnectorScheduler and worker decide (0.26-0.33): how many tokens a request pulls
(all its prefix cache lacks for ``do_remote_prefill``; ``min(remote_num_tokens, prompt) - local_hit`` for a
handle carrying ``do_remote_decode``, unless below ``kv_recompute_threshold``), how remote blocks line up (the
remote list end-trimmed to the local blocks, no token check), when a read is declined (within 5 s of the
remote expiry, judged on the remote clock through the handshake's offset), what a failed pull does
(``kv_load_failure_policy``), what a finished request returns and which blocks it pins for how long (P:
``kv_lease_duration``; D in bidirectional mode: ``decoder_kv_blocks_ttl``), what a request aborted before its
blocks were allocated tells the remote engine (with ``do_remote_prefill`` still set: that it is done with the
remote blocks, so they are freed; otherwise nothing), and what the side channel answers other engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turnkv.sim.sequence import EngineError, Seq
from turnkv.sim.sidechannel import SideChannelClient, TransferError

if TYPE_CHECKING:
    from turnkv.sim.engine import Engine

log = logging.getLogger("turnkv.sim")

EXPIRY_SAFETY_MARGIN_S = 5.0  # vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN (pull_worker.py:30)
_HANDLE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass
class Pin:
    block_ids: list[int]
    deadline: float
    decode_side: bool
    # vLLM's worker tracks a D-side pin only when its request came with do_remote_prefill (a P -> D turn)
    # or do_remote_decode; params with neither still pin the blocks, untracked: no notice and no TTL
    # frees them until the engine restarts (pull_scheduler.py:126-129, pull_worker.py:96-99 in 0.26)
    tracked: bool = True


class Connector:
    """The connector of one engine; it reaches the engine for its pool, clock, id and metrics."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.pins: dict[str, Pin] = {}
        self.unrecognized_notices = 0  # "Potentially invalid KV blocks for unrecognized request" lines
        self._link_lock = asyncio.Lock()
        self.notices: set[asyncio.Task[None]] = set()  # "done" notices of aborted requests, in flight

    def external_tokens(self, seq: Seq, local: int) -> tuple[int, bool]:
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
            if not self.e.cfg.bidirectional:
                raise EngineError("KV load from a decode handle requested, but bidirectional_kv_xfer is off")
            count = min(int(p.get("remote_num_tokens") or 0), n) - local
            threshold = self.e.cfg.kv_recompute_threshold
            if count <= 0 or (threshold > 0 and count < threshold):
                return 0, True  # an empty recv still notifies D, which frees its pinned blocks
            return count, True
        return 0, False

    async def load(self, seq: Seq) -> None:
        """Pull ``seq.external`` tokens' blocks from the engine named in the handle."""
        p = seq.params
        assert p is not None
        remote = list((p.get("remote_block_ids") or [[]])[0])
        local_blocks = seq.load_blocks
        if len(local_blocks) > len(remote):
            # vLLM asserts num_local_blocks <= len(remote_group) and the engine dies.
            raise EngineError(f"AssertionError: {len(local_blocks)} local blocks > {len(remote)} remote blocks")
        remote = remote[len(remote) - len(local_blocks) :] if local_blocks else []
        try:
            async with SideChannelClient(str(p["remote_host"]), int(p["remote_port"])) as sc:
                peer = await sc.handshake(str(p["remote_engine_id"]))
                offset = peer.clock - self.e.clock()
                expiry = p.get("remote_blocks_expiry_time")
                expired = expiry is not None and self.e.clock() + EXPIRY_SAFETY_MARGIN_S >= float(expiry) - offset
                if local_blocks and self.e.cfg.bidirectional and expired:
                    self.e.metrics.kv_expired.inc()
                    raise TransferError(
                        f"Declining expired remote read for {seq.request_id} from engine {peer.engine_id}."
                    )
                if local_blocks:
                    await self._read(sc, peer.engine_id, remote, local_blocks)
                await sc.notify(str(p["remote_request_id"]))
        except TransferError as exc:
            self.e.metrics.failed_transfers.inc()
            log.warning("KV transfer for %s failed: %s", seq.request_id, exc)
            if not local_blocks:
                return  # a failed "done" notification invalidates no block: the request goes on
            if self.e.cfg.kv_load_failure_policy == "fail":
                raise EngineError("Internal server error") from exc
            seq.external = 0
            log.warning("Recovered from KV load failure: 1 request(s) rescheduled")
            return
        bs = self.e.cfg.block_size
        for k in range(seq.num_computed // bs, min((seq.num_computed + seq.external) // bs, len(seq.hashes))):
            # cached under this request's token hashes, whatever the blocks were computed from
            self.e.pool.commit(seq.block_ids[k], seq.hashes[k])
        seq.num_computed += seq.external
        seq.num_cached += seq.external
        self.e.metrics.external_hits.inc(seq.external)
        if seq.num_computed >= len(seq.prompt):
            seq.num_computed = len(seq.prompt) - 1  # the last prompt token is recomputed to sample

    async def _read(self, sc: SideChannelClient, engine_id: str, remote: list[int], local: list[int]) -> None:
        """Read ``remote`` blocks into ``local`` ones over the link, one transfer at a time. What it reports
        is what NIXL's telemetry times (``xferDuration``): the transfer, queued behind the engine's other
        transfers on the link, at the link's modelled rate; not the handshake (vLLM makes one per peer) and
        not the simulator's own copying of block contents over its side channel."""
        costs = self.e.cfg.costs
        nbytes = len(local) * self.e.cfg.block_size * costs.kv_bytes_per_token
        link_s = costs.transfer_link().seconds(nbytes)
        queued = time.perf_counter()
        async with self._link_lock:
            waited = time.perf_counter() - queued
            await self.e.sleep(link_s)
            blocks = await sc.read(engine_id, remote)
        for bid, values in zip(local, blocks, strict=True):
            self.e.pool.write(bid, 0, values)
        self.e.metrics.xfer_time.observe(waited + costs.scaled(link_s))
        self.e.metrics.xfer_bytes.observe(nbytes)

    def aborted_before_alloc(self, seq: Seq) -> None:
        """vLLM's request_finished for a request that never got its blocks (aborted in the waiting
        queue): with ``do_remote_prefill`` still set, the worker is handed an empty recv, which only
        notifies the remote engine, and the remote frees the blocks it held for the request
        (pull_scheduler.py:210-221 in 0.26, the same in 0.33). Any other params notify nobody: a
        release in vLLM's proxy form (``do_remote_decode``) aborted in P's queue frees nothing on D."""
        p = seq.params
        if not p or not p.get("do_remote_prefill") or not p.get("remote_block_ids"):
            return
        if not all(k in p for k in _HANDLE_KEYS):
            return
        task = asyncio.create_task(self._notify_only(p))
        self.notices.add(task)
        task.add_done_callback(self.notices.discard)

    async def _notify_only(self, p: dict[str, Any]) -> None:
        try:
            async with SideChannelClient(str(p["remote_host"]), int(p["remote_port"])) as sc:
                await sc.handshake(str(p["remote_engine_id"]))
                await sc.notify(str(p["remote_request_id"]))
        except TransferError as exc:
            self.e.metrics.failed_transfers.inc()
            log.warning("KV transfer notification failed: %s", exc)

    def request_finished(self, seq: Seq) -> dict[str, Any] | None:
        """vLLM's NixlPullConnectorScheduler.request_finished: pin the blocks, or free them now."""
        p = seq.params
        if not p:
            self.e.release_blocks(seq.block_ids)
            return None
        is_p_node = bool(p.get("do_remote_decode"))
        if not is_p_node and not self.e.cfg.bidirectional:
            self.e.release_blocks(seq.block_ids)
            return None
        ttl = self.e.cfg.kv_lease_duration if is_p_node else self.e.cfg.decoder_kv_blocks_ttl
        deadline = self.e.clock() + ttl
        blocks = seq.block_ids[: -(-seq.num_computed // self.e.cfg.block_size)]
        self.e.release_blocks(seq.block_ids[len(blocks) :])
        tracked = is_p_node or bool(p.get("do_remote_prefill"))
        self.pins[seq.request_id] = Pin(blocks, deadline, decode_side=not is_p_node, tracked=tracked)
        self.e.metrics.pinned(self.pinned_tokens())
        out: dict[str, Any] = {
            "do_remote_prefill": is_p_node,
            "do_remote_decode": not is_p_node,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.e.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": self.e.cfg.side_channel_host,
            "remote_port": self.e.side_channel_port,
            "tp_size": 1,
            "remote_num_tokens": seq.num_computed,
            "remote_blocks_expiry_time": None if is_p_node else deadline,
        }
        if self.e.cfg.compat == "0.33":
            out.update(dcp_size=1, pp_size=1, transfer_mode="pull", remote_registration_generation=0)
        return out

    def unpin(self, request_id: str) -> bool:
        pin = self.pins.pop(request_id, None)
        if pin is None:
            return False
        self.e.release_blocks(pin.block_ids)
        self.e.metrics.pinned(self.pinned_tokens())
        return True

    def notified(self, request_id: str) -> None:
        """A peer is done with ``request_id``'s blocks: free them, if this engine tracks that request."""
        pin = self.pins.get(request_id)
        if pin is None or not pin.tracked:
            self.unrecognized_notices += 1
            log.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode "
                "worker. They may have expired.",
                request_id,
            )
            return
        self.unpin(request_id)

    async def expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = self.e.clock()
            for rid, pin in list(self.pins.items()):
                if pin.deadline <= now and pin.tracked:
                    log.info("Releasing expired KV blocks for request %s", rid)
                    self.e.metrics.kv_expired.inc()
                    self.unpin(rid)

    async def on_side_channel(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "handshake":
            return {"ok": True, "engine_id": self.e.engine_id, "clock": self.e.clock()}
        if op == "read":
            if msg["engine_id"] != self.e.engine_id:
                return {"ok": False, "error": "Remote NIXL agent engine ID mismatch"}
            ids = [int(b) for b in msg["block_ids"]]
            if any(not 0 <= b < self.e.pool.num_blocks for b in ids):
                return {"ok": False, "error": "invalid block id"}
            return {"ok": True, "blocks": [self.e.pool.read(b) for b in ids]}
        if op == "notify":
            self.notified(str(msg["request_id"]))
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def pinned_tokens(self) -> int:
        """KV held by decode-side pins; a block two pins share (a prefix-cache hit) counts once."""
        blocks = {b for p in self.pins.values() if p.decode_side for b in p.block_ids}
        return len(blocks) * self.e.cfg.block_size

    def expire_all(self) -> int:
        n = len(self.pins)
        for rid in list(self.pins):
            self.unpin(rid)
        return n
