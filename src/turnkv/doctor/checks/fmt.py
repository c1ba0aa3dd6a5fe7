"""Numbers as the report says them."""

from __future__ import annotations


def tokens(n: int | float | None) -> str:
    return "?" if n is None else f"{int(n):,}"


def gbps(bytes_per_s: float) -> str:
    g = bytes_per_s / 1e9
    return f"{g:.2f} GB/s" if g < 10 else f"{g:.0f} GB/s"


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    v = seconds * 1e3
    return f"{v:.1f} ms" if v < 100 else f"{v:,.0f} ms"
