"""Whether one more request to the engines may start now: an in-flight cap for the gateway, and one per tenant.

A request over a cap is refused at once (no queue: a queue is where a flood waits for the engines too),
with 503 when the gateway is full and 429 when the tenant is; both say when to retry. A request holds
its place until its answer has been sent, a stream's last byte included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from turnkv.errors import Overloaded, TenantLimit


class InFlightLimits:
    def __init__(self, max_inflight: int, per_tenant: int | None, retry_after_s: int) -> None:
        self.max_inflight = max_inflight
        self.per_tenant = per_tenant
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}

    def check(self, tenant: str) -> None:
        """Raise the refusal a request of ``tenant`` would get now, if any."""
        if self.per_tenant is not None and self.by_tenant.get(tenant, 0) >= self.per_tenant:
            raise TenantLimit(
                f"Too many requests in flight for this API key (limit {self.per_tenant}); retry "
                "after the ones running finish.",
                retry_after_s=self.retry_after_s,
            )
        if self.inflight >= self.max_inflight:
            raise Overloaded(
                "The gateway is serving as many requests as it takes; retry shortly.", retry_after_s=self.retry_after_s
            )

    @contextlib.contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        self.check(tenant)
        self.inflight += 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        try:
            yield
        finally:
            self.inflight -= 1
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]
