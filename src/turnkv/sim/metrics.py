"""The vLLM metric names a simulated engine exposes at /metrics, in a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket lists as vLLM registers them (vLLM's v1/metrics/loggers.py, and the NIXL connector's stats).
_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(2**i) for i in range(11, 35, 2))  # 2^11 ... 2^33
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)

# vLLM's (v1/metrics/loggers.py): inter-token latency, and request_latency_buckets for queue and prefill
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**lv)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**lv)
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries (tokens)"
        ).labels(**lv)
        self.external_hits = counter("vllm:external_prefix_cache_hits", "External prefix cache hits (tokens)").labels(
            **lv
        )
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source", [*labels, "source"], registry=r)
        self.tokens_local_compute = by_source.labels(**lv, source="local_compute")
        self.tokens_local_cache_hit = by_source.labels(**lv, source="local_cache_hit")
        self.tokens_external = by_source.labels(**lv, source="external_kv_transfer")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed").labels(**lv)
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed").labels(**lv)
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "KV transfer time", labels, buckets=_XFER_TIME_BUCKETS, registry=r
        ).labels(**lv)
        self.xfer_bytes = Histogram(
            "vllm:nixl_bytes_transferred", "KV bytes per transfer", labels, buckets=_BYTES_BUCKETS, registry=r
        ).labels(**lv)
        self.failed_transfers = counter("vllm:nixl_num_failed_transfers", "Failed KV transfers").labels(**lv)
        self.kv_expired = counter("vllm:nixl_num_kv_expired_reqs", "Requests whose KV expired").labels(**lv)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", labels, buckets=_TTFT_BUCKETS, registry=r
        ).labels(**lv)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency", labels, buckets=_ITL_BUCKETS, registry=r
        ).labels(**lv)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in WAITING phase for request",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        ).labels(**lv)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time spent in PREFILL phase for request",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        ).labels(**lv)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", labels, registry=r).labels(**lv)
        self.running = Gauge("vllm:num_requests_running", "Running requests", labels, registry=r).labels(**lv)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting requests", labels, registry=r).labels(**lv)
        self.process_start = Gauge(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", registry=r
        )
        self.process_start.set(time.time())
        self.success = Counter("vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r)
        self.preemptions = counter("vllm:num_preemptions", "Preempted requests").labels(**lv)
        # the simulator's own (no vLLM name): what D-side handles pin now, and the most they ever pinned
        self.pinned_tokens = Gauge("sim:pinned_tokens", "KV tokens pinned by decode-side handles", registry=r)
        self.pinned_peak = Gauge(
            "sim:pinned_tokens_peak", "Most KV tokens decode-side handles pinned at once", registry=r
        )
        # ... and what its prefix cache keeps and loses: blocks holding an entry now (in use or free), and
        # entries evicted so far (a free block that held one handed to another request)
        self.cached_blocks = Gauge("sim:prefix_cache_blocks", "Blocks holding a prefix-cache entry", registry=r)
        self.evictions = Counter("sim:prefix_cache_evictions", "Prefix-cache entries evicted", registry=r)
        self._peak = 0
        self._lv = lv

    def pinned(self, tokens: int) -> None:
        self.pinned_tokens.set(tokens)
        if tokens > self._peak:
            self._peak = tokens
            self.pinned_peak.set(tokens)

    def cache_config(self, info: dict[str, str]) -> None:
        """vLLM's ``vllm:cache_config_info``: a gauge set to 1 whose labels are the CacheConfig fields."""
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*info, "engine"],
            registry=self.registry,
        ).labels(**info, engine="").set(1)

    def finished(self, reason: str) -> None:
        self.success.labels(**self._lv, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
