"""Closed-form arithmetic of low-rank factorization. Pure functions on integers; every other stage calls these.

Replacing a weight W (m x n) by A B with A (m x r) and B (r x n) stores r*(m+n) numbers instead of m*n, and a
matrix-vector product costs the same ratio of multiply-accumulates.

>>> break_even(4096, 4096)
2048.0
>>> break_even(4096, 1024)
819.2
>>> round(break_even(50_000, 768), 1)
756.4
>>> params_at_rank(4096, 4096, 256)
2097152
>>> compression(4096, 4096, 256)
8.0
>>> params_at_rank(50_000, 768, 128)   # an embedding V x H becomes V x E plus E x H
6498304
"""

from __future__ import annotations

import math


def break_even(m: int, n: int) -> float:
    """The rank m*n/(m+n) at which A B stores exactly as many numbers as W. At or above it nothing is saved."""
    if m <= 0 or n <= 0:
        raise ValueError(f"matrix sides must be positive, got {m} x {n}")
    return m * n / (m + n)


def max_useful_rank(m: int, n: int) -> int:
    """The largest integer rank strictly below break-even (0 when no rank saves anything)."""
    be = m * n  # compare r*(m+n) < m*n in integers: no float rounding at the boundary
    r = be // (m + n)
    if r * (m + n) == be:
        r -= 1
    return max(r, 0)


def saves(m: int, n: int, r: int) -> bool:
    """True when rank r stores strictly fewer numbers than the dense m x n matrix."""
    return r * (m + n) < m * n


def params_dense(m: int, n: int, groups: int = 1) -> int:
    return groups * m * n


def params_at_rank(m: int, n: int, r: int, groups: int = 1) -> int:
    """Numbers stored by the factors A (m x r) and B (r x n), once per group. Bias is untouched and not counted."""
    return groups * r * (m + n)


def compression(m: int, n: int, r: int) -> float:
    """m*n / (r*(m+n)); a square d-wide layer gives d/(2r)."""
    if r <= 0:
        raise ValueError(f"rank must be positive, got {r}")
    return m * n / (r * (m + n))


def macs_at_rank(m: int, n: int, r: int, macs_linear: int, lookups: int = 0) -> int:
    """Multiply-accumulates per forward after factorizing at rank r.

    ``macs_linear`` is the dense MAC count of the uses that multiply by W (Linear, Conv, matmul); they scale by
    r*(m+n)/(m*n). ``lookups`` counts rows gathered from an embedding table: a lookup costs nothing dense, but the
    factorized table adds the r x n projection, r*n MACs per looked-up row.
    """
    scaled_num = macs_linear * r * (m + n)
    den = m * n
    scaled = scaled_num // den if scaled_num % den == 0 else round(scaled_num / den)
    return int(scaled) + lookups * r * n


def energy_rank(cumulative: "list[float] | object", target: float) -> int:
    """Smallest rank r whose cumulative energy reaches ``target`` (1-based). ``cumulative`` is non-decreasing."""
    import numpy as np

    cum = np.asarray(cumulative)
    idx = int(np.searchsorted(cum, target, side="left"))
    return min(idx + 1, len(cum))


def relative_error(energy_kept: float) -> float:
    """Best rank-r relative Frobenius error sqrt(1 - E(r)) (Eckart-Young)."""
    return math.sqrt(max(0.0, 1.0 - energy_kept))
