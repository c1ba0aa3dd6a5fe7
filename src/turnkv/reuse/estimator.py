"""Learns the cost model's parameters online, from what the engines and the gateway measure.

Link: each scrape of an engine's ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``
histograms gives, for the transfers since the last scrape, their mean size and mean time; a
weighted least-squares line through those points gives the fixed cost and the bandwidth. The two
directions are kept apart: P's histograms are its pulls from D, D's are its reads of P's blocks
after every P leg, and a link can be fast one way and slow the other. A direction never measured
borrows the other's estimate (P may never have pulled yet); the first pull then measures it.
A link measurement counts for ``max_age_s`` (when given): pulls measured slow while the link was
contended make the policy stop pulling, and with no pull there is no new measurement, so without an
age the slow figure would stand for good (seen in the goodput sweeps: a gateway that had nearly
stopped pulling recomputed ~1M tokens more on P than one that went on). Once its measurements are
older, a direction is estimated as if never measured, so the next turns where a pull pays pull again,
and measure the link as it is now.
A direction whose measurements all sit at about one size (pulls that fetch only the last answer's
blocks, P's cache holding the rest) cannot tell its fixed cost from its per-byte cost: put on the
bytes, a few milliseconds of fixed overhead made a 20 GB/s link read as 1-2.5 GB/s, and a whole-history
pull was then priced above P recomputing it (seen in the goodput sweeps). Where the other direction's
line is fitted from varied sizes, such a direction takes that bandwidth and the fixed cost its own
measurements imply at it: its estimate at the size it measured is unchanged, only what it extrapolates to
other sizes comes from a line that was actually determined.
Prefill: each prefill call the gateway makes gives (new tokens, context, seconds); a least-squares
fit of ``hop + a*new + b*new*(context + new/2)`` gives the per-token and attention terms.
Until enough varied points exist, the configured priors stand.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from turnkv.reuse.cost import CostParams, transfer_s
from turnkv.reuse.lstsq import lstsq

Point = tuple[float, float, float]  # a link measurement: mean bytes, mean seconds, transfers


class LinkEstimator:
    def __init__(
        self,
        prior_fixed_s: float,
        prior_bytes_per_s: float,
        window: int = 64,
        *,
        max_age_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prior = (prior_fixed_s, prior_bytes_per_s)
        self.max_age_s = max_age_s
        self._clock = clock
        # (bytes, seconds, count, when observed)
        self._points: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.version = 0  # counts the measurements taken: what was derived from fewer is out of date

    def observe(self, mean_bytes: float, mean_seconds: float, count: float) -> None:
        if mean_bytes > 0 and mean_seconds > 0 and count > 0:
            self._points.append((mean_bytes, mean_seconds, count, self._clock()))
            self.version += 1

    def changes_at(self) -> float:
        """When the oldest measurement counted now stops counting (``max_age_s``); infinity when never."""
        if self.max_age_s is None or not self._points:
            return math.inf
        return self._points[0][3] + self.max_age_s

    def fresh(self) -> list[Point]:
        """The measurements still counted (all of them without ``max_age_s``), oldest dropped for good."""
        if self.max_age_s is not None:
            oldest = self._clock() - self.max_age_s
            while self._points and self._points[0][3] < oldest:
                self._points.popleft()
        return [(b, s, c) for b, s, c, _ in self._points]

    @property
    def samples(self) -> int:
        return len(self.fresh())

    def params(self) -> tuple[float, float]:
        """(fixed seconds per transfer, bytes per second)."""
        pts = self.fresh()
        return self.estimate(pts, fitted(pts))

    def estimate(
        self, pts: list[Point], own: tuple[float, float] | None, other: tuple[float, float] | None = None
    ) -> tuple[float, float]:
        """(fixed seconds, bytes per second) from ``pts`` (``fresh``) and their line (``own``, ``fitted``):
        the prior without points; the line where it is determined; measurements of about one size with the
        bandwidth of the ``other`` direction's line, where that is determined, and the fixed cost they imply
        at it; else the prior's fixed cost and the bandwidth that leaves."""
        if not pts:
            return self.prior
        if own is not None:
            return own
        n = sum(c for _, _, c in pts)
        if other is not None:
            bw = other[1]
            return max(0.0, sum((s - b / bw) * c for b, s, c in pts) / n), bw
        fixed = self.prior[0]
        total_b = sum(b * c for b, _, c in pts)
        total_s = sum(max(s - fixed, 1e-6) * c for _, s, c in pts)
        return fixed, total_b / total_s


def fitted(pts: list[Point]) -> tuple[float, float] | None:
    """(fixed seconds, bytes per second) from a line through measurements of varied sizes; None when they
    are too few or all of about one size (the line is not determined)."""
    sizes = [p[0] for p in pts]
    if len(pts) >= 3 and max(sizes) > 2 * min(sizes):
        fit = lstsq([([1.0, b / 1e9], s, c) for b, s, c in pts])
        if fit is not None and fit[1] > 0:
            return max(fit[0], 0.0), 1e9 / fit[1]
    return None


class PrefillEstimator:
    def __init__(self, prior: CostParams, window: int = 128, min_samples: int = 8) -> None:
        self.prior = prior
        self._min = min_samples
        self._points: deque[tuple[int, int, float]] = deque(maxlen=window)  # (new, context, seconds)
        self.version = 0

    def observe(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        if new_tokens > 0 and seconds > 0:
            self._points.append((new_tokens, context_tokens, seconds))
            self.version += 1

    @property
    def samples(self) -> int:
        return len(self._points)

    def params(self) -> tuple[float, float, float]:
        """(hop seconds, seconds per new token, seconds per new token per context token)."""
        p = self.prior
        pts = list(self._points)
        news = [n for n, _, _ in pts]
        if len(pts) < self._min or max(news) < 2 * min(news):
            return p.hop_s, p.prefill_per_token_s, p.prefill_attn_s
        rows = [([1.0, n / 1e3, n * (c + n / 2) / 1e9], s, 1.0) for n, c, s in pts]
        fit = lstsq(rows)
        if fit is None or fit[1] <= 0:
            return p.hop_s, p.prefill_per_token_s, p.prefill_attn_s
        return max(fit[0], 0.0), fit[1] / 1e3, max(fit[2], 0.0) / 1e9


@dataclass(frozen=True)
class LinkEstimate:
    fixed_s: float
    bytes_per_s: float
    samples: int  # this direction's own measurements (0 while it borrows the other's)


class CostEstimator:
    """The cost parameters a policy sees: priors refined by the link and prefill estimators."""

    def __init__(
        self, prior: CostParams, *, link_max_age_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.prior = prior
        self.pull = LinkEstimator(*prior.link(), max_age_s=link_max_age_s, clock=clock)  # D -> P, read by P
        self.push = LinkEstimator(*prior.link(push=True), max_age_s=link_max_age_s, clock=clock)  # P -> D
        self.prefill = PrefillEstimator(prior)
        self._clock = clock
        # params() as last computed, from the estimators' versions then, until a link point ages out
        self._params: tuple[tuple[int, int, int], float, CostParams] | None = None

    def observe_link(self, reader_role: str, mean_bytes: float, mean_seconds: float, count: float) -> None:
        """Transfers an engine made since the last scrape: a prefill engine reads D's blocks (pulls)."""
        link = self.pull if reader_role == "prefill" else self.push
        link.observe(mean_bytes, mean_seconds, count)

    def links(self) -> dict[str, LinkEstimate]:
        """The estimate per direction: a direction never measured borrows the other's, one measured at about
        one size takes the bandwidth of the other's line (``LinkEstimator.estimate``)."""
        pulls, pushes = self.pull.fresh(), self.push.fresh()
        pull_line, push_line = fitted(pulls), fitted(pushes)  # each direction's points read and fitted once
        pull = self.pull.estimate(pulls, pull_line, push_line)
        push = self.push.estimate(pushes, push_line, pull_line)
        if not pulls and pushes:
            pull = push
        if not pushes and pulls and self.prior.push_bytes_per_s is None:
            push = pull  # unless the operator said what P -> D is
        return {"pull": LinkEstimate(*pull, len(pulls)), "push": LinkEstimate(*push, len(pushes))}

    def observe_prefill(
        self, *, new_tokens: int, context_tokens: int, pulled_tokens: int, seconds: float, block_size: int
    ) -> None:
        """A prefill call's wall time; the estimated pull time is taken out first."""
        pull = transfer_s(self.params(), pulled_tokens, block_size) if pulled_tokens > 0 else 0.0
        self.prefill.observe(new_tokens, context_tokens, seconds - pull)

    def params(self) -> CostParams:
        """The priors refined by what was measured. Fitted again only once something changed (a measurement
        came, or one aged out): every turn asks, and a fit over the windows costs more than the rest of its
        planning."""
        versions = (self.pull.version, self.push.version, self.prefill.version)
        cached = self._params
        if cached is not None and cached[0] == versions and self._clock() < cached[1]:
            return cached[2]
        params = self._fit()
        self._params = (versions, min(self.pull.changes_at(), self.push.changes_at()), params)
        return params

    def _fit(self) -> CostParams:
        links = self.links()
        hop, per_token, attn = self.prefill.params()
        return replace(
            self.prior,
            link_fixed_s=links["pull"].fixed_s,
            link_bytes_per_s=links["pull"].bytes_per_s,
            push_fixed_s=links["push"].fixed_s,
            push_bytes_per_s=links["push"].bytes_per_s,
            hop_s=hop,
            prefill_per_token_s=per_token,
            prefill_attn_s=attn,
        )
