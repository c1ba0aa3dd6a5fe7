#!/usr/bin/env python3
"""What gpu/load.py reads besides its own requests: the engines' and the gateway's /metrics over time (a
sampler thread, at most one reading per interval, downsampled into a timeline), the gateway's labelled
counters and their deltas, what its ``/ready`` says of the engines' GPUs, and a summary of its log's turn
events (outcome, action, reason, capture; per turn group; warnings)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from typing import Any

import devlib

D_SERIES = {
    "d_kv": "vllm:kv_cache_usage_perc",
    "d_run": "vllm:num_requests_running",
    "d_wait": "vllm:num_requests_waiting",
}
P_SERIES = {"p_kv": "vllm:kv_cache_usage_perc", "p_wait": "vllm:num_requests_waiting"}
GW_SERIES = {
    "pinned": "turnkv_pinned_kv_bytes",
    "budget": "turnkv_pinned_kv_budget_bytes",
    "capacity": "turnkv_pinned_kv_capacity_bytes",
    "handles": "turnkv_pinned_handles",
}
GW_COUNTERS = (
    "turnkv_handle_releases_total",
    "turnkv_first_token_deadline_misses_total",
    "turnkv_handle_captures_total",
    "turnkv_reuse_decisions_total",
    "turnkv_upstream_errors_total",
    "turnkv_retries_total",
)
MAX_TIMELINE_POINTS = 1500  # per mode, after downsampling


# -- /metrics sampling -------------------------------------------------------------------------------


def sums(url: str, series: dict[str, str], timeout: float = 2.0) -> dict[str, float]:
    try:
        text = devlib.get(url, "/metrics", timeout=timeout).raw
    except OSError:
        return {}
    names = tuple(series.values())
    sums: dict[str, float] = {}
    for name, _, value in devlib.metric_samples(text, names):
        sums[name] = sums.get(name, 0.0) + value
    return {k: sums[v] for k, v in series.items() if v in sums}


class Sampler:
    """Reads the engines' and the gateway's /metrics every ``interval`` in its own thread, until
    stopped or ``max_samples`` were taken (each read has a 2 s timeout)."""

    def __init__(self, d: str, p: str | None, gw: str | None, t0: float, interval: float, max_samples: int) -> None:
        self.d, self.p, self.gw, self.t0 = d, p, gw, t0
        self.interval = interval
        self.max_samples = max_samples
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while len(self.samples) < self.max_samples:
            t = time.perf_counter()
            row: dict[str, float] = {"t": round(t - self.t0, 2)}
            row.update(sums(self.d, D_SERIES))
            if self.p:
                row.update(sums(self.p, P_SERIES))
            if self.gw:
                row.update(sums(self.gw, GW_SERIES))
            self.samples.append(row)
            if self._stop.wait(max(0.0, self.interval - (time.perf_counter() - t))):
                return


def timeline(samples: list[dict[str, float]], max_points: int = MAX_TIMELINE_POINTS) -> dict[str, list[Any]]:
    """Columns of the samples; where there are too many, each bucket of consecutive samples keeps its
    first time and the largest value of each series (a short peak stays visible)."""
    k = max(1, math.ceil(len(samples) / max_points))
    keys = sorted({key for s in samples for key in s} - {"t"})
    cols: dict[str, list[Any]] = {"t": []}
    for key in keys:
        cols[key] = []
    for i in range(0, len(samples), k):
        bucket = samples[i : i + k]
        cols["t"].append(bucket[0]["t"])
        for key in keys:
            vals = [s[key] for s in bucket if key in s]
            cols[key].append(round(max(vals), 4) if vals else None)
    return cols


# -- the gateway's counters and log -------------------------------------------------------------------


def gateway_counters(url: str) -> dict[str, dict[str, float]]:
    """The gateway's counters of interest, per family and label set (``k=v,k=v``)."""
    try:
        text = devlib.get(url, "/metrics", timeout=5).raw
    except OSError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in devlib.metric_samples(text, GW_COUNTERS):
        if name not in GW_COUNTERS:
            continue  # _created samples
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out.setdefault(name, {})[key] = value
    return out


def gpus_told(url: str, timeout_s: float = 6.0) -> dict[str, Any]:
    """What the gateway's ``/ready`` says of the engines' GPUs (each engine's ``gpus``, the ``shared_gpu``
    setting and the pairs it makes share one), once it has read both engines' (bounded: the fleet reads
    ``/version`` at its first health probe); {} when it could not be read."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while True:
        try:
            body = json.loads(devlib.get(url, "/ready", timeout=5).raw)
        except (OSError, ValueError):
            body = {}
        engines = [*body.get("prefill", []), *body.get("decode", [])]
        if (engines and all(e.get("gpus") for e in engines)) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return {
        "gpus": {e.get("url"): e.get("gpus") for e in engines},
        "shared_gpu": body.get("shared_gpu"),
    }


def counter_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for fam, vals in after.items():
        d = {k: v - before.get(fam, {}).get(k, 0.0) for k, v in vals.items()}
        d = {k: round(v, 3) for k, v in d.items() if v}
        if d:
            out[fam] = d
    return out


def gateway_log_summary(name: str, start: int, max_bytes: int = 64 * 1024 * 1024) -> dict[str, Any]:
    """The turn events the gateway logged after byte ``start`` (counts of outcome, action, reason and
    capture, per turn group), and its other events at warning level or above, by name."""
    f = devlib.log_dir() / f"{name}.log"
    counts: dict[str, Counter[str]] = {k: Counter() for k in ("outcome", "action", "reason", "capture")}
    by_group: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    turns = 0
    if not f.exists():
        return {}
    for ev in devlib.log_events(name, start, max_bytes):
        if ev.get("event") == "turn":
            turns += 1
            for k, c in counts.items():
                c[str(ev.get(k))] += 1
            group = "turn 1" if ev.get("turn") in (None, 0, 1) else "later turns"
            by_group[f"{group}: {ev.get('outcome')}/{ev.get('reason')}/{ev.get('capture')}"] += 1
        elif ev.get("level") in ("warning", "error", "critical"):
            warnings[str(ev.get("event"))[:80]] += 1
    return {
        "turn_events": turns,
        **{k: dict(c.most_common()) for k, c in counts.items()},
        "by_turn_group": dict(by_group.most_common(40)),
        "warnings": dict(warnings.most_common(40)),
    }
