"""The engines turnkv routes to: health, load, version and restarts, and which one a turn uses.

Picks are made on the current view: healthy instances first, the preferred one (the engine that
holds the conversation's KV or its prefix) unless it is much busier than the least busy, else the
least busy, round-robin among equals (``affinity``, the default; ``least-loaded`` and
``round-robin`` ignore the conversation, as benchmark baselines). Background probes refresh health,
version and the engines' own metrics (process start time, to notice restarts; NIXL transfer stats,
for the link estimate; prefix-cache settings and hits, for what P still holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from turnkv.engine.base import Engine, LoadSample, Transfers

log = logging.getLogger("turnkv.registry")
ROUTING = ("affinity", "least-loaded", "round-robin")
AFFINITY_SLACK = 8  # in-flight requests a preferred instance may have above the least busy one
MIN_EXPECTED_HITS = 256  # tokens of expected cache hits before the observed ones are compared with them
MISSES_TO_SUSPEND = 3  # first-token deadlines missed in a row before an engine is taken out of routing
SUSPEND_S = 30.0  # how long; then one more miss takes it out again



@dataclass
class Instance:
    url: str
    role: str
    healthy: bool = True
    in_flight: int = 0
    epoch: float | None = None  # process_start_time_seconds from its /metrics
    version: str | None = None
    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting: admitted but not scheduled (no free KV blocks, or a full batch)
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc
    capacity_tokens: int | None = None  # KV cache size: num_gpu_blocks x block_size (vllm:cache_config_info)
    deadline_misses: int = 0  # first-token deadlines missed in a row
    suspended_until: float = 0.0  # monotonic; out of routing until then (missed deadlines), whatever /health says
    stream_handles: bool | None = None  # whether its SSE streams end with a KV handle (seen, or by version)
    # how much of the prefix-cache hit the gateway expects actually happens (1: all; 0: cache off or evicting)
    cache_factor: float = 1.0
    expected_hits: float = 0.0
    prefix_caching: bool = True  # from vllm:cache_config_info
    block_size_warned: bool = False
    _hits: float | None = field(default=None, repr=False)
    takes_prompt_ids: bool = False  # by its version
    _xfer: Transfers | None = field(default=None, repr=False)

    @property
    def routable(self) -> bool:
        """Healthy by its probe and not suspended for missing first-token deadlines."""
        return self.healthy and time.monotonic() >= self.suspended_until

    @property
    def busy(self) -> int:
        """Requests running there: the engine's own count, or this gateway's requests in flight when
        more (the engine's count is as old as the last scrape, and a burst since is only seen here)."""
        return max(self.running, self.in_flight)


class Slot:
    """One request's place in an instance's in-flight count, given back once."""

    def __init__(self, inst: Instance) -> None:
        self._inst = inst
        self._held = True
        inst.in_flight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self._inst.in_flight -= 1


class Registry:
    def __init__(self, prefill: list[str], decode: list[str], block_size: int = 16,
                 routing: str = "affinity") -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}")
        self.block_size = block_size
        self.routing = routing
        self.instances: dict[str, Instance] = {}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for u in urls:
                self.instances[u] = Instance(u, role)
        self._rr = itertools.count()
        self.on_restart: Callable[[Instance], None] = lambda inst: None
        self.on_scraped: Callable[[Instance], None] = lambda inst: None  # after each read of its metrics
        # (role of the engine that read, mean bytes, mean seconds, transfers)
        self.on_link_sample: Callable[[str, float, float, float], None] = lambda r, b, s, c: None

    def role(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    def get(self, url: str | None) -> Instance | None:
        return self.instances.get(url) if url else None

    def pick(self, role: str, prefer: str | None = None, exclude: frozenset[str] = frozenset()) -> Instance | None:
        pool = [i for i in self.role(role) if i.url not in exclude]
        healthy = [i for i in pool if i.routable] or pool
        if not healthy:
            return None
        if self.routing == "round-robin":
            return healthy[next(self._rr) % len(healthy)]
        if self.routing == "least-loaded":
            prefer = None
        least = min(i.in_flight for i in healthy)
        preferred = self.get(prefer)
        if preferred is not None and preferred in healthy and preferred.in_flight <= least + AFFINITY_SLACK:
            return preferred
        ties = [i for i in healthy if i.in_flight == least]
        return ties[next(self._rr) % len(ties)]

    def saw_stream_handle(self, url: str, seen: bool) -> None:
        """Whether a stream of this engine that should have ended with a handle did: what its streams carry."""
        inst = self.get(url)
        if inst is not None:
            inst.stream_handles = seen

    def hold(self, inst: Instance) -> Slot:
        """Count a request in flight on ``inst`` until the slot is released."""
        return Slot(inst)

    @contextlib.contextmanager
    def busy(self, inst: Instance) -> Iterator[None]:
        inst.in_flight += 1
        try:
            yield
        finally:
            inst.in_flight -= 1

    def mark_failed(self, url: str) -> None:
        inst = self.instances.get(url)
        if inst is not None and inst.healthy:
            log.warning("instance.unhealthy url=%s", url)
            inst.healthy = False

    def missed_deadline(self, url: str) -> None:
        """A first-token deadline passed on this engine; a few in a row take it out of routing until its
        health probe passes again."""
        inst = self.instances.get(url)
        if inst is None:
            return
        inst.deadline_misses += 1
        if inst.deadline_misses >= MISSES_TO_SUSPEND and inst.routable:
            log.warning("instance.suspended url=%s reason=first_token_deadline misses=%d for_s=%.0f", url,
                        inst.deadline_misses, SUSPEND_S)
            inst.suspended_until = time.monotonic() + SUSPEND_S
            inst.deadline_misses = MISSES_TO_SUSPEND - 1

    def met_deadline(self, url: str | None) -> None:
        inst = self.get(url)
        if inst is not None:
            inst.deadline_misses = 0

    # -- background refresh ------------------------------------------------------------------
    async def probe(self, engine: Engine, inst: Instance) -> None:
        ok = await engine.health(inst.url)
        if ok != inst.healthy:
            log.warning("instance.%s url=%s", "healthy" if ok else "unhealthy", inst.url)
        inst.healthy = ok
        if ok and inst.version is None:
            info = await engine.info(inst.url, inst.role)
            if info is not None:
                inst.version = info.version
                inst.takes_prompt_ids = info.takes_prompt_ids
                if info.stream_handles:
                    inst.stream_handles = True

    async def scrape(self, engine: Engine, inst: Instance) -> None:
        sample = await engine.load(inst.url)
        if sample is not None:
            self.apply_load(inst, sample)

    def apply_load(self, inst: Instance, sample: LoadSample) -> None:
        if sample.prefix_caching_off:
            inst.cache_factor = 0.0  # nothing the gateway expects P to have cached is there
            inst.prefix_caching = False
        if sample.capacity_tokens is not None:
            inst.capacity_tokens = sample.capacity_tokens
        bs = sample.block_size
        if bs is not None and bs != self.block_size and not inst.block_size_warned:
            inst.block_size_warned = True
            log.warning("instance.block_size_mismatch url=%s engine=%s gateway=%s", inst.url, bs, self.block_size)
        start = sample.epoch
        if start is not None:
            if inst.epoch is not None and start != inst.epoch:
                log.warning("instance.restarted url=%s", inst.url)
                inst.epoch = start
                self.on_restart(inst)
            inst.epoch = start
        inst.running, inst.waiting, inst.kv_usage = sample.running, sample.waiting, sample.kv_usage
        self._cache_factor(inst, sample.prefix_cache_hits)
        self.on_scraped(inst)
        cur = sample.transfers
        if cur is None:
            return
        prev, inst._xfer = inst._xfer, cur
        if prev is not None and cur.count > prev.count:
            dc = cur.count - prev.count
            self.on_link_sample(inst.role, (cur.bytes - prev.bytes) / dc, (cur.seconds - prev.seconds) / dc, dc)

    @staticmethod
    def _cache_factor(inst: Instance, hits: float | None) -> None:
        """Compare the prefix-cache hits the engine reports with those the gateway expected of it."""
        if hits is None:
            return
        prev, inst._hits = inst._hits, hits
        if prev is None or hits < prev:  # first reading, or the engine restarted
            inst.expected_hits = 0.0
            return
        if inst.expected_hits >= MIN_EXPECTED_HITS and inst.prefix_caching:
            seen = min(1.0, (hits - prev) / inst.expected_hits)
            inst.cache_factor = 0.5 * inst.cache_factor + 0.5 * seen
            inst.expected_hits = 0.0

    def expect_hits(self, url: str | None, tokens: int) -> None:
        inst = self.get(url)
        if inst is not None:
            inst.expected_hits += tokens

    async def run(self, engine: Engine, health_s: float, scrape_s: float) -> None:
        """Probe health every ``health_s`` and read metrics every ``scrape_s``, until cancelled."""
        ticks = max(1, round(scrape_s / health_s))
        for n in itertools.count():
            insts = list(self.instances.values())
            await asyncio.gather(*(self.probe(engine, i) for i in insts))
            if n % ticks == 0:
                await asyncio.gather(*(self.scrape(engine, i) for i in insts))
            await asyncio.sleep(health_s)
