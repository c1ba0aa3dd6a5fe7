"""Write-backs: finished turns' KV handed from D's pins to P's prefix cache, off the turns' path and behind
P's live requests; and the conversations' think times, which say whether a write-back would be done in time.

A write-back (``Engine.write_back``) owns its handle: the conversation's record holds none meanwhile, so no
turn can pull blocks a write-back is reading (a second read of a handle reads freed blocks). It never delays
a live request at P:

* it is sent only while P has room for what it lacks of the sequence (its KV usage now, as the fleet counts
  it, within ``write_back.prefill_max_kv_usage``): vLLM's first-come scheduler stops at the first request it
  cannot allocate, so a write-back P could not allocate would hold every request behind it;
* at most ``write_back.max_in_flight`` run at once on one P (each pulls a conversation's KV and takes P's
  blocks for it), and with ``write_back.priority`` each goes with a request priority below live requests',
  for a P scheduled by priority;
* one that cannot be sent within ``write_back.max_wait_s`` (or before its handle would expire) is given up:
  the handle is released instead (D frees the blocks; they stay in D's prefix cache), and so is one that
  fails.

A conversation whose next turn comes before its write-back was sent takes the handle back (``reclaim``): it
is still pinned on D, so that turn may pull it as if it had been kept, and the write-back is dropped. One
already sent runs to its end; that turn finds what P has of it in P's prefix cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from turnkv.config import WriteBackSettings
from turnkv.engine.base import Handle, HandleRules, WriteBack, WriteBackResult
from turnkv.errors import UpstreamError
from turnkv.gateway.fleet import Fleet
from turnkv.gateway.metrics import GatewayMetrics
from turnkv.routing import InstanceView
from turnkv.state.record import ConversationRecord

log = logging.getLogger("turnkv.writeback")
QUEUE_SIZE = 4096
WORKERS = 8  # write-backs waiting for room or in flight at once, on all prefill engines together
POLL_S = 0.02  # how often a waiting write-back looks at P's room again
EXPIRY_MARGIN_S = 10.0  # vLLM's P declines a read within 5 s of D's expiry; the gateway's clock differs a little
THINK_SAMPLES = 256  # the think times remembered (the latest)
THINK_MIN_SAMPLES = 8  # before this many, the think time is not known
THINK_QUANTILE = 0.5  # the think time a write-back must fit in: most next turns come later than this


def job_key(store_key: str, record: ConversationRecord) -> str:
    """What a conversation's write-back is found by when its next turn comes: the key its record was stored
    under (of a pool: the pool's), the sequence the handle holds and when the record was made. Identical
    conversations share a pool, each with its own handle: a turn takes back only its claimed record's."""
    h = hashlib.blake2b(record.tokens_digest or record.chain, digest_size=8)
    h.update(repr(record.created_at).encode())
    return f"{store_key}:{h.hexdigest()}"


@dataclass
class Job:
    key: str  # ``job_key``: the conversation's next turn cancels a write-back not yet sent
    handle: Handle
    token_ids: Sequence[int]  # the sequence the handle holds
    prefill_url: str  # the P to write back to
    decode_url: str  # the D holding the blocks: it releases a pin P would keep
    lacks: int  # tokens of the sequence P likely lacks (what it pulls)
    expires_at: float  # wall clock: the handle's last usable moment, as the gateway counts it
    queued_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    reclaimed: bool = False  # the conversation's next turn took the handle back: nothing to release
    held: bool = False  # counted in D's KV held by handles given up on (``Fleet.let_go``)


class ThinkTimes:
    """The gaps between a conversation's turn ending and its next turn arriving, as this gateway saw them."""

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=THINK_SAMPLES)

    def observe(self, gap_s: float) -> None:
        if gap_s >= 0:
            self._gaps.append(gap_s)

    def quantile(self, q: float = THINK_QUANTILE) -> float | None:
        """The ``q`` quantile of the gaps seen (None: too few yet)."""
        if len(self._gaps) < THINK_MIN_SAMPLES:
            return None
        xs = sorted(self._gaps)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


class WriteBacks:
    def __init__(
        self,
        engine: HandleRules,
        fleet: Fleet,
        metrics: GatewayMetrics,
        settings: WriteBackSettings,
        release: Callable[[Handle, str, str | None, int], None],
        model: Callable[[], str | None],
    ) -> None:
        self._engine = engine
        self._fleet = fleet
        self._metrics = metrics
        self.s = settings
        self._release = release  # a handle given up on: released through the releaser (why, D, its KV)
        self._model = model
        self._queue: asyncio.Queue[Job] = asyncio.Queue(QUEUE_SIZE)
        self._pending: dict[str, Job] = {}  # by conversation key, not yet sent
        self._in_flight: dict[str, int] = {}  # by prefill engine
        self.waiting = 0  # write-backs waiting for room at their P now
        self.think = ThinkTimes()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._metrics.write_backs.labels("dropped").inc()
            self._release(job.handle, "write_back_dropped", job.decode_url, len(job.token_ids))
            return
        # D's blocks stay pinned until P has read them (or a release tells D): D's KV in use until then
        job.held = True
        self._fleet.let_go(job.decode_url, len(job.token_ids))
        old = self._pending.pop(job.key, None)
        if old is not None:
            old.cancelled = True
        self._pending[job.key] = job

    def reclaim(self, key: str) -> Handle | None:
        """The conversation's next turn came before its write-back was sent: the write-back is dropped and
        the turn takes its handle back (still pinned on D, now the turn's to pull or release); None when
        there is none waiting (never written back, or already sent)."""
        job = self._pending.pop(key, None)
        if job is None:
            return None
        job.cancelled = job.reclaimed = True
        self._settle(job)  # a record pins it again
        self._metrics.write_backs.labels("reclaimed").inc()
        return job.handle

    async def run(self) -> None:
        await asyncio.gather(*(self._work() for _ in range(WORKERS)))

    async def drain(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._one(job)
            except Exception:
                log.exception("write_back.failed key=%s", job.key)
                self._give_up(job, "failed")
            finally:
                self._queue.task_done()

    def _room(self, url: str, lacks: int) -> bool:
        """Whether P may take a write-back now: fewer than the cap in flight, and room for what it lacks."""
        if self._in_flight.get(url, 0) >= self.s.max_in_flight:
            return False
        v = self._fleet.view(url)
        return v is not None and v.routable and room_for(v, lacks) <= self.s.prefill_max_kv_usage

    async def _one(self, job: Job) -> None:
        expires = time.monotonic() + (job.expires_at - time.time()) - EXPIRY_MARGIN_S
        until = min(job.queued_at + self.s.max_wait_s, expires)
        self.waiting += 1
        try:
            while not job.cancelled and not self._room(job.prefill_url, job.lacks):
                if time.monotonic() >= until:
                    self._give_up(job, "deferred")
                    return
                await asyncio.sleep(POLL_S)
        finally:
            self.waiting -= 1
        if job.cancelled:
            if not job.reclaimed:
                self._give_up(job, "cancelled")  # replaced by the conversation's next write-back
            return
        if self._pending.get(job.key) is job:
            del self._pending[job.key]
        await self._send(job)

    async def _send(self, job: Job) -> None:
        url = job.prefill_url
        self._in_flight[url] = self._in_flight.get(url, 0) + 1
        slot = self._fleet.hold(url)  # ours in flight there: not another client's in P's counts
        started = time.monotonic()
        try:
            call = WriteBack(
                job.handle, job.token_ids, self._model(), self.s.timeout_s, self.s.priority, job.decode_url
            )
            result = await self._engine.write_back(url, call)
        except UpstreamError as exc:
            log.warning("write_back.failed instance=%s error=%s", url, exc)
            self._give_up(job, "failed")
            return
        finally:
            slot.release()
            self._in_flight[url] -= 1
            self._settle(job)  # P read the blocks and told D, or it failed: given up on below
        self._metrics.write_backs.labels(result.value).inc()
        self._metrics.write_back_seconds.observe(time.monotonic() - job.queued_at)
        log.info(
            "write_back.done instance=%s tokens=%d lacks=%d result=%s ms=%.1f",
            url,
            len(job.token_ids),
            job.lacks,
            result.value,
            (time.monotonic() - started) * 1e3,
        )
        if result is WriteBackResult.PINNED:
            log.warning("write_back.pinned instance=%s: P finished the request before its abort", url)

    def _give_up(self, job: Job, why: str) -> None:
        if self._pending.get(job.key) is job:
            del self._pending[job.key]
        self._settle(job)
        self._metrics.write_backs.labels(why).inc()
        self._release(job.handle, f"write_back_{why}", job.decode_url, len(job.token_ids))

    def _settle(self, job: Job) -> None:
        """The job no longer holds D's blocks as a write-back (read by P, reclaimed, or handed to a release)."""
        if job.held:
            job.held = False
            self._fleet.let_go(job.decode_url, -len(job.token_ids))


def room_for(p: InstanceView, tokens: int) -> float:
    """P's KV usage now with ``tokens`` more (its usage alone where its KV size is not known)."""
    usage = p.kv_usage_now
    if p.capacity_tokens:
        usage += tokens / p.capacity_tokens
    return usage
