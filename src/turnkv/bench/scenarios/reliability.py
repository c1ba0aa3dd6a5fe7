"""The reliability suite: many concurrent streamed conversations through turnkv with Redis, for minutes,
with the processes' memory and open files sampled every second.

Simulated engines that cost next to nothing but time: a decode step on D takes ``DECODE_ITL_MS`` (plus the
simulator's per-sequence increment of 0.05 ms), prefill and the API hop almost nothing, so streams stay
open for seconds while the machine's CPU goes to the engines' and gateway's Python, Redis and the load
generator. ``N`` conversations
(``--conversations``, default 1000) are active at once, each of ``WORKLOAD.turns`` turns with think time
between them; one that ends is replaced by a new one until the duration (``--duration``) is over. A
short warm-up load runs first, so the state sampled before the load is that of a started, idle gateway.

What it decides is what the report flags: requests and errors by kind, turns that ran without state
because of the store (reason ``store_unavailable`` or ``store_busy``: should be none), reuse outcomes,
TTFT and ITL, and per process group RSS and open fds over time: their range during the load, what was
left once idle, and growth: the median of the last ``WINDOW_S`` seconds before the load stopped sending
new requests against the median of the first ``WINDOW_S`` seconds after warm-up (``warm_up_s``), flagged
past ``RSS_GROWTH`` and ``FD_GROWTH``.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.report import md_table
from turnkv.bench.sampler import Series
from turnkv.bench.scenarios.base import Bench, ConfigPlan, Deployment, Sampling
from turnkv.bench.stats import fmt_ms, summarize
from turnkv.bench.workload import WorkloadSpec

DEFAULT_STREAMS = 1000
DECODE_ITL_MS = 500.0
ENGINE = (
    "--vllm-compat",
    "0.33",
    "--time-scale",
    "1",
    "--prefill-floor-ms",
    "1",
    "--prefill-us-per-token",
    "1",
    "--api-overhead-ms",
    "0",
    "--link",
    "nvlink",
    "--num-gpu-blocks",
    "100000",  # 1.6M tokens: every conversation's handle fits, no pressure relief
)
WORKLOAD = WorkloadSpec(
    conversations=DEFAULT_STREAMS,
    turns=5,
    system_tokens=200,
    user_tokens=20,
    answer_tokens=24,
    think_time_s=1.5,
    rate=0.0,
    concurrency=DEFAULT_STREAMS,
    request_timeout_s=60.0,
    duration_s=180.0,
)
QUEUED_CONVERSATIONS_PER_STREAM = 20  # conversations queued per slot: a slot uses one per ~75 s
STORE_REASONS = ("store_unavailable", "store_busy")
WINDOW_S = 10.0
RSS_GROWTH = (0.10, 16.0)  # flagged past both: 10 % and 16 MiB
FD_GROWTH = (0.10, 32)  # 10 % and 32 descriptors


def benches(conversations: int | None = None) -> list[Bench]:
    n = conversations or DEFAULT_STREAMS
    wl = replace(WORKLOAD, concurrency=n, conversations=n * QUEUED_CONVERSATIONS_PER_STREAM)
    return [
        Bench(
            Deployment(
                "pd",
                engine_flags=ENGINE,
                decode_flags=("--decode-itl-ms", str(DECODE_ITL_MS)),  # P keeps the simulator's 8 ms
                gateway_flags=("--policy", "adaptive"),
                redis=True,
            ),
            (
                ConfigPlan(
                    f"reliability-{n}",
                    "reliability",
                    f"{n} concurrent streamed conversations through turnkv with Redis",
                    wl,
                    {"streams": n},
                ),
            ),
            # a few turns first, so that the idle state before the load is a started, warm gateway
            warmup=replace(wl, conversations=4, concurrency=4, turns=2, answer_tokens=2, think_time_s=0.0, seed=99),
            sample=Sampling(interval_s=1.0, settle_s=5.0),
        )
    ]


def error_kind(error: str) -> str:
    """The kind of a failed request: its HTTP status, or the exception's name, or the message."""
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    head = error.split(":", 1)[0]
    return head if " " not in head else error[:60]


def warm_up_s(load_s: float) -> float:
    return min(30.0, 0.25 * load_s)


def open_streams(records: Sequence[RequestRecord], at: Sequence[float]) -> list[int]:
    """Requests in flight (sent, answer not finished) at each of ``at`` (seconds from the load's start)."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.latency_ms is None:
            continue
        events += [(r.start_s, 1), (r.start_s + r.latency_ms / 1e3, -1)]
    events.sort()
    times = [t for t, _ in events]
    level, levels = 0, []
    for _, d in events:
        level += d
        levels.append(level)
    return [levels[i - 1] if (i := bisect.bisect_right(times, t)) else 0 for t in at]


@dataclass(frozen=True)
class Growth:
    name: str
    idle_before: tuple[float, int]
    rss_range: tuple[float, float]
    fd_range: tuple[int, int]
    after_warm_up: tuple[float, float]  # median RSS MiB, median fds
    end_of_load: tuple[float, float]
    idle_after: tuple[float, int]

    @property
    def rss_flag(self) -> bool:
        base, last = self.after_warm_up[0], self.end_of_load[0]
        return last - base > max(RSS_GROWTH[0] * base, RSS_GROWTH[1])

    @property
    def fd_flag(self) -> bool:
        base, last = self.after_warm_up[1], self.end_of_load[1]
        return last - base > max(FD_GROWTH[0] * base, FD_GROWTH[1])


def _median_in(s: Series, lo: float, hi: float) -> tuple[float, float]:
    idx = [i for i, t in enumerate(s.t) if lo <= t <= hi] or [min(range(len(s.t)), key=lambda i: abs(s.t[i] - lo))]
    return statistics.median(s.rss_mib[i] for i in idx), statistics.median(s.fds[i] for i in idx)


def growth(name: str, s: Series, load_start: float, load_end: float, steady_end: float | None = None) -> Growth:
    """What the samples of one group say about growth (see the module docstring). ``steady_end``: when
    the load stopped sending new requests (its last window is measured before the wind-down)."""
    during = [i for i, t in enumerate(s.t) if load_start <= t <= load_end] or list(range(len(s.t)))
    end = load_end if steady_end is None else min(load_end, steady_end)
    warm = load_start + warm_up_s(end - load_start)
    return Growth(
        name=name,
        idle_before=(s.rss_mib[0], s.fds[0]),
        rss_range=(min(s.rss_mib[i] for i in during), max(s.rss_mib[i] for i in during)),
        fd_range=(min(s.fds[i] for i in during), max(s.fds[i] for i in during)),
        after_warm_up=_median_in(s, warm, warm + WINDOW_S),
        end_of_load=_median_in(s, end - WINDOW_S, end),
        idle_after=(s.rss_mib[-1], s.fds[-1]),
    )


def resources(c: ConfigResult) -> tuple[dict[str, Series], float, float, float]:
    """The samples by group, when the load started and ended, and when it stopped sending new requests."""
    res: dict[str, Any] = c.meta.get("resources") or {}
    series = {k: Series.from_dict(v) for k, v in res.get("series", {}).items() if v["t"]}
    t0, t1 = float(res.get("load_start_s", 0.0)), float(res.get("load_end_s", 0.0))
    return series, t0, t1, min(t1, t0 + float(c.workload.get("duration_s", t1 - t0)))


def analyze(configs: Sequence[ConfigResult]) -> tuple[str, dict[str, list[str]]]:
    parts = ["## Reliability", ""]
    for c in configs:
        parts += _analyze_one(c)
    return "\n".join(parts) + "\n", {"reliability": [c.name for c in configs]}


def _analyze_one(c: ConfigResult) -> list[str]:
    recs = c.requests
    errors = Counter(error_kind(r.error) for r in recs if r.error is not None)
    reasons = Counter(r.decision.get("reason", "-") for r in recs)
    outcomes = Counter(r.decision.get("outcome", "-") for r in recs)
    by_store = sum(reasons[k] for k in STORE_REASONS)
    first = summarize(r for r in recs if r.turn == 1)
    later = summarize(r for r in recs if r.turn > 1)
    conversations = len({r.conversation for r in recs})
    streams = c.workload.get("concurrency")
    out = [
        f"### {c.name}",
        "",
        f"- {streams} conversations active at once; {conversations} conversations, {len(recs)} requests in "
        f"{c.wall_s:.0f} s; failed: {sum(errors.values())}"
        + (" (" + ", ".join(f"{k} {v}" for k, v in errors.most_common()) + ")" if errors else ""),
        f"- turns without state because of the store ({' / '.join(STORE_REASONS)}): **{by_store}**",
        "- reuse outcomes: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()),
        "- reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()),
        _cpu_line(c),
        "",
        md_table(
            ["turns", "n", "failed", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
            [
                [label, s.n, s.errors, fmt_ms(s.ttft_p50), fmt_ms(s.ttft_p99), fmt_ms(s.itl_p50), fmt_ms(s.itl_p99)]
                for label, s in (("first", first), ("later", later))
            ],
        ),
        "",
    ]
    series, t0, t1, steady = resources(c)
    if not series:
        return [*out, "No resource samples were recorded.", ""]
    warm = warm_up_s(steady - t0)
    rows = []
    flagged = []
    for name, s in series.items():
        g = growth(name, s, t0, t1, steady)
        if g.rss_flag:
            flagged.append(f"{name} RSS {g.after_warm_up[0]:.0f} -> {g.end_of_load[0]:.0f} MiB")
        if g.fd_flag:
            flagged.append(f"{name} fds {g.after_warm_up[1]:.0f} -> {g.end_of_load[1]:.0f}")
        rows.append(
            [
                name,
                f"{g.idle_before[0]:.0f} / {g.idle_before[1]}",
                f"{g.rss_range[0]:.0f}-{g.rss_range[1]:.0f}",
                f"{g.after_warm_up[0]:.0f} -> {g.end_of_load[0]:.0f}" + (" **GROWS**" if g.rss_flag else ""),
                f"{g.fd_range[0]}-{g.fd_range[1]}",
                f"{g.after_warm_up[1]:.0f} -> {g.end_of_load[1]:.0f}" + (" **GROWS**" if g.fd_flag else ""),
                f"{g.idle_after[0]:.0f} / {g.idle_after[1]}",
            ]
        )
    out += [
        f"Resources, sampled every second (load from {t0:.0f} s to {t1:.0f} s, new requests until {steady:.0f} s; "
        f"warm-up: its first {warm:.0f} s; growth: median of the last {WINDOW_S:.0f} s before {steady:.0f} s "
        f"against the {WINDOW_S:.0f} s after warm-up, "
        f"flagged past {RSS_GROWTH[0]:.0%} and {RSS_GROWTH[1]:.0f} MiB, or {FD_GROWTH[0]:.0%} and "
        f"{FD_GROWTH[1]} fds). The gateway row counts its workers.",
        "",
        md_table(
            [
                "process",
                "idle before: RSS MiB / fds",
                "RSS MiB during load",
                "RSS growth",
                "fds during load",
                "fd growth",
                "idle after: RSS MiB / fds",
            ],
            rows,
        ),
        "",
        "Growth: " + ("; ".join(flagged) if flagged else "none flagged (RSS and fds flat after warm-up)") + ".",
        "",
    ]
    return out


def _cpu_line(c: ConfigResult) -> str:
    wall = max(c.wall_s, 1e-9)
    gw, eng = c.meta.get("gateway_cpu_s"), c.meta.get("engine_cpu_s")
    if gw is None or eng is None:
        return "- CPU: not measured"
    return (
        f"- CPU over the load: gateway {gw:.1f} s ({gw / wall:.0%} of one core), simulated engines {eng:.1f} s "
        f"({eng / wall:.0%})"
    )


def plot(configs: Sequence[ConfigResult], path: Path) -> None:
    """RSS, open fds and the client's open streams over time, one column per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    withdata = [(c, *resources(c)) for c in configs]
    withdata = [w for w in withdata if w[1]]
    if not withdata:
        return
    fig, axes = plt.subplots(3, len(withdata), figsize=(7.5 * len(withdata), 8.5), squeeze=False, sharex="col")
    for col, (c, series, t0, t1, steady) in enumerate(withdata):
        rss_ax, fd_ax, st_ax = axes[0][col], axes[1][col], axes[2][col]
        for i, (name, s) in enumerate(series.items()):
            lw = 1.8 if name == "gateway" else 0.9
            rss_ax.plot(s.t, s.rss_mib, color=f"C{i}", lw=lw, label=name)
            fd_ax.plot(s.t, s.fds, color=f"C{i}", lw=lw, label=name)
        at = sorted({t for s in series.values() for t in s.t})
        st_ax.plot(at, open_streams(c.requests, [t - t0 for t in at]), color="k", lw=1.0)
        for ax in (rss_ax, fd_ax, st_ax):
            ax.axvspan(t0, t0 + warm_up_s(steady - t0), color="0.9", lw=0)
            ax.axvline(steady, color="0.5", ls=":", lw=0.8)
            ax.axvline(t1, color="0.5", ls="--", lw=0.8)
            ax.grid(True, alpha=0.3)
        rss_ax.set_ylabel("RSS MiB")
        fd_ax.set_ylabel("open fds")
        st_ax.set_ylabel("streams open (client)")
        st_ax.set_xlabel("s (grey: warm-up; dotted: no new requests; dashed: load ends)")
        rss_ax.set_title(c.name, fontsize=9)
        rss_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=70)
    plt.close(fig)
