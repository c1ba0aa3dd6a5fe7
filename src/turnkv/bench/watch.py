"""Engine metrics read over a load, as time series: what a gauge held on average, not only at the end.

A thread reads each engine's /metrics every ``interval_s`` while the load runs and keeps the named
samples (their labels summed), with the seconds since it started. Bounded: each read has a short
timeout, and a read that fails is skipped.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

Series = list[tuple[float, float]]  # (seconds since the watch started, value)


class MetricWatch:
    def __init__(self, engines: Mapping[str, str], names: Sequence[str], interval_s: float = 0.5) -> None:
        self.engines = dict(engines)  # name -> base URL
        self.names = tuple(names)
        self.interval_s = interval_s
        self.series: dict[str, dict[str, Series]] = {e: {n: [] for n in self.names} for e in self.engines}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metric-watch", daemon=True)
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> dict[str, dict[str, Series]]:
        self._stop.set()
        self._thread.join(10)
        return self.series

    def _run(self) -> None:
        while not self._stop.is_set():
            for engine, url in self.engines.items():
                values = _read(url, self.names)
                t = round(time.perf_counter() - self._t0, 3)
                for name, v in values.items():
                    self.series[engine][name].append((t, v))
            self._stop.wait(self.interval_s)


def _read(url: str, names: Sequence[str]) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in names:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def time_average(series: Series) -> float | None:
    """A series' mean over time (each value held until the next reading); None when empty."""
    if not series:
        return None
    if len(series) == 1:
        return series[0][1]
    area = sum((t1 - t0) * v0 for (t0, v0), (t1, _) in zip(series, series[1:], strict=False))
    span = series[-1][0] - series[0][0]
    return area / span if span > 0 else series[-1][1]
