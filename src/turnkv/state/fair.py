"""Which pins an evict takes: the budget of a decode engine shared fairly among the tenants pinning on it.

Taking the pins idle longest first across everyone lets one tenant's many conversations push out every
other tenant's: each new pin of the busy tenant releases the pin idle longest, and a tenant that runs a
few slow agents always holds the oldest. So an evict keeping ``keep`` tokens treats ``keep / n`` as each
of the ``n`` tenants holding pins there as its share, and takes the pins idle longest among the tenants
holding more than their share only; the share is counted again after each pin taken (a tenant left with
none no longer counts). A tenant within its share loses nothing for another's turns; its own turns, once
over its share, take its own pins first. While the pins are over ``keep`` some tenant holds more than its
share, so the evict always ends within ``keep``. One tenant alone: idle longest first, as before.

The Redis index runs the same order in its evict script (``state.redis.pins``).
"""

from __future__ import annotations

from collections.abc import Sequence

from turnkv.state.base import PinEntry


def fair_evictions(entries: Sequence[PinEntry], keep: int) -> list[PinEntry]:
    """The entries to take, in the order taken, for at most ``keep`` tokens to stay pinned. One pass, idle
    longest first: a tenant passed over is within its share and stays so (what it holds only goes down as
    pins are taken, the share only up as tenants are left with none)."""
    held: dict[str, int] = {}
    for e in entries:
        held[e.tenant] = held.get(e.tenant, 0) + e.tokens
    total, tenants = sum(held.values()), len(held)
    out: list[PinEntry] = []
    for e in sorted(entries, key=lambda e: (e.stored_at, e.key)):
        if total <= keep:
            break
        if held[e.tenant] > keep / max(tenants, 1):
            out.append(e)
            held[e.tenant] -= e.tokens
            total -= e.tokens
            if held[e.tenant] <= 0:
                tenants -= 1  # left with none: no longer shares
    return out
