"""turnkv's Prometheus metrics, in a registry owned by the app (no globals).

Under ``--workers N`` every worker writes its samples to files in a shared directory (prometheus_client's
multiprocess mode) and ``/metrics``, whichever worker answers it, reads them all: counters and histograms
are summed; each gauge says how its workers' values combine (``multiprocess_mode``), ignoring workers
that have exited.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


def turn_bucket(turn: int) -> str:
    if turn <= 5:
        return str(max(turn, 1))
    return "6-10" if turn <= 10 else "11+"


class GatewayMetrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._multiprocess_dir = multiprocess_dir
        self.ttft = Histogram(
            "turnkv_ttft_seconds",
            "Gateway-side time to first token",
            ["turn", "outcome"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "turnkv_prefill_seconds", "Prefill call duration", ["action"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.decisions = Counter(
            "turnkv_reuse_decisions", "Reuse decisions", ["outcome", "action", "reason"], registry=r
        )
        self.tokens = Counter(
            "turnkv_tokens",
            "Prompt tokens by how they were obtained (planned_pull: as planned; vLLM does not count pulls "
            "per request), and generated tokens",
            ["kind"],
            registry=r,
        )
        self.upstream_errors = Counter("turnkv_upstream_errors", "Engine call failures", ["leg", "kind"], registry=r)
        self.retries = Counter("turnkv_retries", "Retried engine calls", ["leg", "reason"], registry=r)
        self.redis_errors = Counter(
            "turnkv_redis_errors",
            "Conversation store failures by kind: timeout, connect_timeout, unreachable, error",
            ["op", "kind"],
            registry=r,
        )
        self.store_skipped = Counter(
            "turnkv_store_skipped",
            "Store calls not made because the store counts as down (the breaker is open)",
            ["op"],
            registry=r,
        )
        self.store_busy = Counter(
            "turnkv_store_busy",
            "Store calls that found every connection busy (load, not an outage; the turn ran without its record)",
            ["op"],
            registry=r,
        )
        self.store_up = Gauge(
            "turnkv_store_up", "1 when the conversation store answers", registry=r, multiprocess_mode="livemin"
        )
        self.captures = Counter("turnkv_handle_captures", "Decode handles captured or missed", ["result"], registry=r)
        self.render_mismatch = Counter(
            "turnkv_render_mismatch", "Turns whose rendered prompt differed from the decode engine's", registry=r
        )

        def shared(name: str, doc: str, label: str) -> Gauge:
            """A gauge every worker reports on its own schedule: the latest report stands. The same for
            all workers where it comes from the store (pinned memory); each worker's own estimate for
            the links, all three link gauges from one report."""
            return Gauge(name, doc, [label], registry=r, multiprocess_mode="livemostrecent")

        self.pinned_tokens = shared("turnkv_pinned_kv_tokens", "Decode KV tokens pinned by live handles", "decode")
        self.pinned_bytes = shared("turnkv_pinned_kv_bytes", "Decode KV bytes pinned by live handles", "decode")
        self.pinned_handles = shared("turnkv_pinned_handles", "Live handles per decode engine", "decode")
        self.pinned_capacity_bytes = shared(
            "turnkv_pinned_kv_capacity_bytes", "Decode engine KV capacity (0: not known)", "decode"
        )
        self.pinned_budget_bytes = shared(
            "turnkv_pinned_kv_budget_bytes", "Decode KV bytes stored handles may pin (0: no budget known)", "decode"
        )
        self.admission_waits = Counter(
            "turnkv_decode_admission_waits",
            "Turns that waited in the gateway for room on a decode engine's KV",
            ["decode"],
            registry=r,
        )
        self.admission_overflows = Counter(
            "turnkv_decode_admission_overflows",
            "Turns sent to a decode engine without room after waiting admission_overflow_s (P held their KV)",
            ["decode"],
            registry=r,
        )
        self.deadline_misses = Counter(
            "turnkv_first_token_deadline_misses", "Engine calls past their first-token deadline", ["leg"], registry=r
        )
        self.deadline_renewals = Counter(
            "turnkv_first_token_deadline_renewals",
            "First-token deadlines renewed because the engine was busy (its token counters moved), not stuck",
            ["leg"],
            registry=r,
        )
        self.template_class = Gauge(
            "turnkv_template_class",
            "1 for the chat template's audited class",
            ["class"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_restarts = Counter("turnkv_engine_restarts", "Engine restarts noticed", ["role"], registry=r)
        # direction: pull (D -> P, P's reads) or push (P -> D, D's reads); each worker learns the link itself
        self.link_bytes_per_s = shared("turnkv_link_bytes_per_second", "Estimated KV link bandwidth", "direction")
        self.link_fixed_s = shared("turnkv_link_fixed_seconds", "Estimated KV transfer fixed cost", "direction")
        self.link_samples = shared("turnkv_link_samples", "Transfer measurements behind the link estimate", "direction")
        # why: unused, superseded, not_needed, budget, pressure, failed_turn, prefill_failed, shutdown,
        # store_unavailable;
        # duplicate, dropped and failed count releases not sent or not answered
        self.rejections = Counter(
            "turnkv_rejected_requests",
            "Requests and connections refused at the edge, by reason (auth, overload, deadlines)",
            ["reason"],
            registry=r,
        )
        self.releases = Counter(
            "turnkv_handle_releases", "Handles given back to decode unused, by why", ["why"], registry=r
        )
        # why: unused (a stateless turn), not_needed (the policy does not keep it); released later (past
        # decode_memory.unused_share, or under pressure) they count in turnkv_handle_releases_total too
        self.unused_left = Counter(
            "turnkv_unused_handles_left",
            "Handles nobody will pull, left pinned for the decode engine's TTL to free (as plain P/D), by why",
            ["why"],
            registry=r,
        )
        self.store_up.set(1)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
