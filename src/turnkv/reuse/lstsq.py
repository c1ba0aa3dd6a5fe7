"""Least squares for the small fits this project makes (the online cost estimator, the step-time fit
of GPU measurements): a handful of columns, so normal equations solved by Gaussian elimination, with
no numerical library at run time."""

from __future__ import annotations

from collections.abc import Sequence

Row = tuple[Sequence[float], float, float]  # (features, target, weight)


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a small dense system; None when it is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-18:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def lstsq(rows: Sequence[Row], *, scale_columns: bool = False) -> list[float] | None:
    """Weighted least squares over ``rows``; None when the rows do not determine the coefficients.

    With ``scale_columns`` each column is divided by its largest magnitude first (for features that span
    many orders of magnitude), and a column that is zero in every row gets coefficient 0 instead of
    making the system singular."""
    k = len(rows[0][0])
    scale = [max(abs(x[j]) for x, _, _ in rows) or 1.0 for j in range(k)] if scale_columns else [1.0] * k
    ata = [[0.0] * k for _ in range(k)]
    atb = [0.0] * k
    for x, y, w in rows:
        z = [x[j] / scale[j] for j in range(k)]
        for i in range(k):
            atb[i] += w * z[i] * y
            for j in range(k):
                ata[i][j] += w * z[i] * z[j]
    if scale_columns:
        for i in range(k):
            if ata[i][i] == 0.0:
                ata[i][i] = 1.0
    sol = solve(ata, atb)
    return None if sol is None else [c / s for c, s in zip(sol, scale, strict=True)]
