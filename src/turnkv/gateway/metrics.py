"""turnkv's Prometheus metrics, in a registry owned by the app (no globals).

Under ``--workers N`` every worker writes its samples to files in a shared directory (prometheus_client's
multiprocess mode) and ``/metrics``, whichever worker answers it, reads them all: counters and histograms
are summed; each gauge says how its workers' values combine (``multiprocess_mode``), ignoring workers
that have exited.

Every counter starts with every label value the gateway can give it at 0 (``Vocabulary``, and the
configured engines for those labelled by engine): a series that appears only with its first increment
has nothing to increase from, so ``increase()`` and ``rate()`` would miss the first failure of each kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from turnkv.gateway.turn.results import Capture, Fallback
from turnkv.reuse.assess import Reason, TemplateClass
from turnkv.reuse.cost import Action

# no x_created series beside each counter and histogram: nothing reads them, and with every label value
# exported from the start they would double /metrics (process-wide, as prometheus_client has it)
disable_created_metrics()  # type: ignore[no-untyped-call]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


def turn_bucket(turn: int) -> str:
    if turn <= 5:
        return str(max(turn, 1))
    return "6-10" if turn <= 10 else "11+"


@dataclass(frozen=True)
class Vocabulary:
    """The label values each labelled counter can take: what ``GatewayMetrics`` exports at 0 from the
    start. A value the code counts and this misses shows up only at its second occurrence in
    ``increase()``; tests/integration/test_alerts.py fails on any such series."""

    legs: tuple[str, ...] = ("render", "prefill", "decode")
    # UpstreamError.kind, and the relay's own: a stream that broke or ended empty
    upstream_kinds: tuple[str, ...] = (
        "connect",
        "timeout",
        "first_token_deadline",
        "protocol",
        "status",
        "error",
        "stream",
        "empty_stream",
    )
    # a store operation, or one of its steps on another node of a Cluster (a pin's index entry and its removal,
    # evict's and prune's questions to the records)
    store_ops: tuple[str, ...] = (
        "claim",
        "put",
        "release",
        "pinned",
        "evict",
        "prune",
        "put_doc",
        "get_doc",
        "delete_doc",
        "ping",
        "index",
        "unpin",
        "strip",
        "holds",
    )
    store_error_kinds: tuple[str, ...] = ("timeout", "connect_timeout", "unreachable", "error")
    # what a plan's outcome and action can be together (TurnPlan.outcome)
    decisions: tuple[tuple[str, str], ...] = (
        ("full", Action.PULL.value),
        ("partial", Action.PULL.value),
        ("none", Action.PULL.value),
        ("none", Action.RECOMPUTE.value),
        ("stateless", Action.RECOMPUTE.value),
        ("decode_local", Action.DECODE_LOCAL.value),
    )
    token_kinds: tuple[str, ...] = ("prompt", "planned_pull", "computed", "generated")
    # edge refusals (error codes, connection caps, slow clients) and their type where an error has no code
    rejections: tuple[str, ...] = (
        "invalid_api_key",
        "insufficient_permissions",
        "server_overloaded",
        "rate_limit_exceeded",
        "shutting_down",
        "request_timeout",
        "client_closed_request",
        "request_too_large",
        "invalid_request_error",
        "connection_cap",
        "connection_cap_per_ip",
        "slow_reader",
        "header_timeout",
        "header_too_large",
    )
    releases: tuple[str, ...] = (
        "unused",
        "superseded",
        "pool_full",
        "not_needed",
        "budget",
        "pressure",
        "failed_turn",
        "prefill_failed",
        "shutdown",
        "store_unavailable",
        "duplicate",
        "dropped",
        "failed",
        "write_back_failed",
        "write_back_deferred",
        "write_back_cancelled",
        "write_back_dropped",
    )
    unused_left: tuple[str, ...] = ("unused", "not_needed")
    # a write-back's end: in P's prefix cache (or pinned there, P having finished it before its abort; that pin
    # released through D where P said its handle), or given up on (its handle then released, counted in
    # turnkv_handle_releases_total as write_back_<why>)
    write_backs: tuple[str, ...] = (
        *("cached", "pinned", "released", "failed", "deferred", "cancelled", "reclaimed", "dropped"),
    )
    roles: tuple[str, ...] = ("prefill", "decode")

    def retries(self) -> list[tuple[str, str]]:
        """(leg, why): a fallback's, an engine call's retried error kind, and a turn run again."""
        pairs = {(f.leg, f.why) for f in Fallback}
        pairs |= {(leg, kind) for leg in ("prefill", "decode") for kind in self.upstream_kinds[:6]}
        return sorted(pairs | {("turn", "rerun")})


VOCABULARY = Vocabulary()


class GatewayMetrics:
    def __init__(
        self,
        multiprocess_dir: str | None = None,
        *,
        prefill: Sequence[str] = (),
        decode: Sequence[str] = (),
        vocabulary: Vocabulary = VOCABULARY,
    ) -> None:
        """``prefill`` and ``decode``: the configured engines, whose series start at 0 too."""
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
        self.upstream_errors = Counter(
            "turnkv_upstream_errors",
            "Engine call failures, by leg, kind and engine (its URL; 'unknown' where the call named none)",
            ["leg", "kind", "engine"],
            registry=r,
        )
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
            "turnkv_store_up",
            "1 when every node of the conversation store answers (no node's breaker is open)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.store_breaker_open = Gauge(
            "turnkv_store_breaker_open",
            "1 while the breaker of this node of the store is open: its conversations run without their "
            "records (node: host:port of one Redis, of a Cluster master or of the master Sentinel names; memory)",
            ["node"],
            registry=r,
            multiprocess_mode="livemax",
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
        self.pins_over_budget = Counter(
            "turnkv_pins_over_budget",
            "Handles pinned past the decode memory budget because the engine's pin index could not be asked "
            "(its store node down)",
            registry=r,
        )
        self.write_backs = Counter(
            "turnkv_write_backs",
            "Handles written back from a decode engine to a prefill engine's prefix cache, by result",
            ["result"],
            registry=r,
        )
        self.write_back_seconds = Histogram(
            "turnkv_write_back_seconds",
            "From a turn's end to its KV in P's prefix cache (the wait for P's room included)",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.engine_up = Gauge(
            "turnkv_engine_up",
            "1 while the gateway counts an engine healthy (its health checks pass), 0 while it routes around it",
            ["role", "engine"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.inflight_turns = Gauge(
            "turnkv_inflight_turns",
            "Turns being served now (an autoscaler's signal)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.draining = Gauge(
            "turnkv_draining",
            "1 from a shutdown's start (SIGTERM): not ready, turns in flight finishing",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.store_up.set(1)
        self.draining.set(0)
        self._start_at_zero(vocabulary, list(prefill), list(decode))

    def _start_at_zero(self, v: Vocabulary, prefill: list[str], decode: list[str]) -> None:
        engines = [("prefill", u) for u in prefill] + [("decode", u) for u in decode]

        def zero(counter: Counter, label_sets: Iterable[tuple[str, ...]]) -> None:
            for labels in label_sets:
                counter.labels(*labels)

        zero(self.decisions, ((o, a, reason.value) for o, a in v.decisions for reason in Reason))
        zero(self.tokens, ((k,) for k in v.token_kinds))
        by_leg = {"render": prefill, "prefill": prefill, "decode": decode}
        zero(
            self.upstream_errors,
            ((leg, kind, url) for leg in v.legs for kind in v.upstream_kinds for url in [*by_leg[leg], "unknown"]),
        )
        zero(self.retries, v.retries())
        zero(self.redis_errors, ((op, kind) for op in v.store_ops for kind in v.store_error_kinds))
        zero(self.store_skipped, ((op,) for op in v.store_ops))
        zero(self.store_busy, ((op,) for op in v.store_ops))
        zero(self.captures, ((c.value,) for c in Capture))
        zero(self.admission_waits, ((u,) for u in decode))
        zero(self.admission_overflows, ((u,) for u in decode))
        zero(self.deadline_misses, ((leg,) for leg in v.roles))
        zero(self.deadline_renewals, ((leg,) for leg in v.roles))
        zero(self.engine_restarts, ((role,) for role in v.roles))
        zero(self.rejections, ((why,) for why in v.rejections))
        zero(self.releases, ((why,) for why in v.releases))
        zero(self.unused_left, ((why,) for why in v.unused_left))
        zero(self.write_backs, ((r,) for r in v.write_backs))
        for role, url in engines:
            self.engine_up.labels(role, url).set(1)
        for c in TemplateClass:
            self.template_class.labels(c.value).set(0)

    def upstream_error(self, leg: str, kind: str, engine: str | None) -> None:
        """One failed engine call (``engine``: its URL, where known)."""
        self.upstream_errors.labels(leg, kind, engine or "unknown").inc()

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
