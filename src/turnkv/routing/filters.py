"""Routing filters: which engines may serve a pick.

``not-tried`` drops the engines this turn already failed on. ``not-avoided`` and ``routable`` are soft:
they drop engines that missed a deadline in this turn, or that are down or suspended, unless that
would leave none; then every candidate stays, since trying one beats failing without trying.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnkv.routing.base import InstanceView, NoParams, RouteRequest


class NotTried:
    def __init__(self, params: NoParams) -> None:
        pass

    def filter(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        return [c for c in candidates if c.url not in req.exclude] if req.exclude else candidates


class NotAvoided:
    def __init__(self, params: NoParams) -> None:
        pass

    def filter(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        if not req.avoid:
            return candidates
        return [c for c in candidates if c.url not in req.avoid] or candidates


class Routable:
    def __init__(self, params: NoParams) -> None:
        pass

    def filter(self, req: RouteRequest, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        return [c for c in candidates if c.routable] or candidates
