"""Routing pickers: which of the scored engines a pick returns.

``max-score``: the best score; among equal bests, the next in turn (one counter per picker, so equal
engines take turns).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from turnkv.routing.base import InstanceView, NoParams, RouteRequest


class MaxScore:
    def __init__(self, params: NoParams) -> None:
        self._turn = itertools.count()

    def pick(
        self, req: RouteRequest, candidates: Sequence[InstanceView], scores: Sequence[float]
    ) -> InstanceView | None:
        if not candidates:
            return None
        best = max(scores)
        ties = [c for c, s in zip(candidates, scores, strict=True) if s == best]
        return ties[0] if len(ties) == 1 else ties[next(self._turn) % len(ties)]
