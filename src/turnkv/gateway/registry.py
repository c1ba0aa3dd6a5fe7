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
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from turnkv.errors import UpstreamError
from turnkv.gateway.upstream import Upstream

log = logging.getLogger("turnkv.registry")
ROUTING = ("affinity", "least-loaded", "round-robin")
PLUGIN_HEADER = "x-turnkv-plugin"  # set by plugins/vllm-turnkv: "<version>; streams=chat,completions"
AFFINITY_SLACK = 8  # in-flight requests a preferred instance may have above the least busy one
MIN_EXPECTED_HITS = 256  # tokens of expected cache hits before the observed ones are compared with them
MISSES_TO_SUSPEND = 3  # first-token deadlines missed in a row before an engine is taken out of routing
SUSPEND_S = 30.0  # how long; then one more miss takes it out again
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")  # work done: moving means busy
_SCRAPED = (*_PROGRESS, "process_start_time_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
            "vllm:nixl_bytes_transferred_sum")


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
    progressed_at: float = 0.0  # monotonic; when its token counters last moved (it computed something)
    _work: float | None = field(default=None, repr=False)
    stream_handles: bool | None = None  # whether its SSE streams end with a KV handle (seen, or by version)
    # how much of the prefix-cache hit the gateway expects actually happens (1: all; 0: cache off or evicting)
    cache_factor: float = 1.0
    expected_hits: float = 0.0
    prefix_caching: bool = True  # from vllm:cache_config_info
    block_size_warned: bool = False
    _hits: float | None = field(default=None, repr=False)
    _xfer: tuple[float, float, float] | None = field(default=None, repr=False)  # count, bytes, seconds

    @property
    def routable(self) -> bool:
        """Healthy by its probe and not suspended for missing first-token deadlines."""
        return self.healthy and time.monotonic() >= self.suspended_until

    @property
    def busy(self) -> int:
        """Requests running there: the engine's own count, or this gateway's requests in flight when
        more (the engine's count is as old as the last scrape, and a burst since is only seen here)."""
        return max(self.running, self.in_flight)


def _version_tuple(v: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (v or "").split(".")[:2])
    except ValueError:
        return ()


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

    def supports_prompt_token_ids(self, inst: Instance) -> bool:
        """vLLM >= 0.32 takes the prompt as ``kv_transfer_params.prompt_token_ids`` on chat requests."""
        return _version_tuple(inst.version) >= (0, 32)

    # -- background refresh ------------------------------------------------------------------
    async def probe(self, upstream: Upstream, inst: Instance) -> None:
        try:
            status, _ = await upstream.get(inst.url, "/health")
            ok = status == 200
        except UpstreamError:
            ok = False
        if ok != inst.healthy:
            log.warning("instance.%s url=%s", "healthy" if ok else "unhealthy", inst.url)
        inst.healthy = ok
        if ok and inst.version is None:
            with contextlib.suppress(UpstreamError, ValueError):
                _, raw, headers = await upstream.probe(inst.url, "/version")
                inst.version = str(json.loads(raw).get("version"))
                self._capture_path(inst, headers.get(PLUGIN_HEADER, ""))

    def _capture_path(self, inst: Instance, plugin: str) -> None:
        """Whether this engine's SSE streams end with D's handle: vLLM >= 0.33, or turnkv's plugin."""
        if _version_tuple(inst.version) >= (0, 33) or "chat" in plugin.partition("streams=")[2].split(","):
            inst.stream_handles = True
        elif inst.role == "decode":
            log.warning("instance.no_stream_handles url=%s version=%s: streamed turns get no KV handle and run as "
                        "plain P/D, and D still pins their blocks for decoder_kv_blocks_ttl; install the turnkv "
                        "vLLM plugin (plugins/vllm-turnkv) or use vLLM >= 0.33", inst.url, inst.version)

    async def scrape(self, upstream: Upstream, inst: Instance) -> None:
        try:
            status, raw = await upstream.get(inst.url, "/metrics")
        except UpstreamError:
            return
        if status != 200:
            return
        self.apply_metrics(inst, raw.decode("utf-8", "replace"))

    def apply_metrics(self, inst: Instance, text: str) -> None:
        values: dict[str, float] = {}
        try:
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name in _SCRAPED:
                        values[s.name] = values.get(s.name, 0.0) + float(s.value)
                    elif s.name == "vllm:cache_config_info":
                        self._cache_config(inst, s.labels)
        except ValueError:
            return
        start = values.get("process_start_time_seconds")
        if start is not None:
            if inst.epoch is not None and start != inst.epoch:
                log.warning("instance.restarted url=%s", inst.url)
                inst.epoch = start
                self.on_restart(inst)
            inst.epoch = start
        work = sum(values.get(k, 0.0) for k in _PROGRESS)
        if inst._work is not None and work > inst._work:
            inst.progressed_at = time.monotonic()
        inst._work = work
        inst.running = int(values.get("vllm:num_requests_running", 0))
        inst.waiting = int(values.get("vllm:num_requests_waiting", 0))
        inst.kv_usage = values.get("vllm:kv_cache_usage_perc", 0.0)
        self._cache_factor(inst, values.get("vllm:prefix_cache_hits_total"))
        self.on_scraped(inst)
        count = values.get("vllm:nixl_xfer_time_seconds_count")
        if count is None:
            return
        cur = (count, values.get("vllm:nixl_bytes_transferred_sum", 0.0),
               values.get("vllm:nixl_xfer_time_seconds_sum", 0.0))
        prev, inst._xfer = inst._xfer, cur
        if prev is not None and cur[0] > prev[0]:
            dc = cur[0] - prev[0]
            self.on_link_sample(inst.role, (cur[1] - prev[1]) / dc, (cur[2] - prev[2]) / dc, dc)

    def _cache_config(self, inst: Instance, labels: dict[str, str]) -> None:
        if labels.get("enable_prefix_caching") == "False":
            inst.cache_factor = 0.0  # nothing the gateway expects P to have cached is there
            inst.prefix_caching = False
        bs = labels.get("block_size")
        blocks = labels.get("num_gpu_blocks")
        if bs and bs.isdigit() and blocks and blocks.isdigit():
            inst.capacity_tokens = int(blocks) * int(bs)
        if bs and bs.isdigit() and int(bs) != self.block_size and not inst.block_size_warned:
            inst.block_size_warned = True
            log.warning("instance.block_size_mismatch url=%s engine=%s gateway=%s", inst.url, bs, self.block_size)

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

    async def run(self, upstream: Upstream, health_s: float, scrape_s: float) -> None:
        """Probe health every ``health_s`` and read metrics every ``scrape_s``, until cancelled."""
        ticks = max(1, round(scrape_s / health_s))
        for n in itertools.count():
            insts = list(self.instances.values())
            await asyncio.gather(*(self.probe(upstream, i) for i in insts))
            if n % ticks == 0:
                await asyncio.gather(*(self.scrape(upstream, i) for i in insts))
            await asyncio.sleep(health_s)
