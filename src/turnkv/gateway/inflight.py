"""Whether a request to the engines may start now: two budgets, each with caps for the gateway, per peer
address and per tenant (``tally.Gate``).

A request whose headers came is *arriving* until its body is whole: a small budget (``max_arriving``), so
that clients that stall their uploads hold only that, never the places of requests that can run. A whole
request then takes its place *in flight* (``max_inflight``) until its answer has been sent, a stream's
last byte included. A request over a cap is refused at once (no queue: a queue is where a flood waits for
the engines too): 503 when the gateway is full, 429 when the address or tenant is over its own cap or
holds more than its share of the reserve; both say when to retry. Tenants count only when clients
authenticate (without keys a tenant is whatever token a client chose).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from turnkv.config import Limits
from turnkv.errors import Overloaded, TenantLimit
from turnkv.gateway.tally import Caps, Gate, Refusal, Tally

Keys = Mapping[str, str | None]  # {"ip": peer address, "tenant": tenant or None}
_WHO = {"ip": "this address", "tenant": "this API key"}


class RequestLimits:
    def __init__(self, limits: Limits, tally: Tally, *, tenants: bool) -> None:
        share = limits.reserve_share
        per_tenant = limits.max_inflight_per_tenant if tenants else None
        self.arriving = Gate("arriving", Caps.of(limits.max_arriving, share), tally)
        self.inflight = Gate(
            "inflight", Caps.of(limits.max_inflight, share, ip=limits.max_inflight_per_ip, tenant=per_tenant), tally
        )
        self.retry_after_s = limits.retry_after_s
        self.tenants = tenants

    def keys(self, ip: str | None, tenant: str) -> Keys:
        return {"ip": ip, "tenant": tenant if self.tenants else None}

    def _refuse(self, refusal: Refusal, whole: str, held: str) -> Overloaded:
        if refusal.kind is None:
            return Overloaded(f"The gateway is {whole}; retry shortly.", retry_after_s=self.retry_after_s)
        who = _WHO.get(refusal.kind, refusal.kind)
        return TenantLimit(f"Too many requests {held} from {who}; retry shortly.", retry_after_s=self.retry_after_s)

    def check(self, keys: Keys) -> None:
        """Raise the refusal a whole request of ``keys`` would get now, if any."""
        refusal = self.inflight.refusal(keys)
        if refusal is not None:
            raise self._refuse(refusal, "serving as many requests as it takes", "in flight")

    @contextlib.contextmanager
    def arrive(self, keys: Keys) -> Iterator[None]:
        """Hold a place among the requests still arriving while the body is read."""
        refusal = self.arriving.refusal(keys)
        if refusal is not None:
            raise self._refuse(refusal, "receiving as many requests as it takes", "still arriving")
        self.arriving.take(keys)
        try:
            yield
        finally:
            self.arriving.give(keys)

    @contextlib.contextmanager
    def hold(self, keys: Keys) -> Iterator[None]:
        """Hold a place in flight while the request is served."""
        self.check(keys)
        self.inflight.take(keys)
        try:
            yield
        finally:
            self.inflight.give(keys)
