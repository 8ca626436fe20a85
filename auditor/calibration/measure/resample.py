"""The bootstrap draws behind the verification intervals: rows, whole documents, or contiguous blocks of rows.

Three ways to resample ``n`` verification rows (windows of text, examples), each a list of row-index arrays a metric
is recomputed from (:meth:`~auditor.calibration.metrics.base.RowScorer.value`):

- :func:`row_draws`: rows drawn one at a time (the interval over these rows: the verification's first interval);
- :func:`document_draws`: whole documents drawn with replacement, every row of a drawn document taken (a cluster
  bootstrap), where the calibration says which rows belong together;
- :func:`block_draws`: contiguous runs of :func:`block_length` rows drawn with replacement (a moving-block
  bootstrap), where it does not: neighbouring windows of one text are alike, and a block keeps them together.

The last two carry the spread between documents the first leaves out: they are the interval for a document the tool
never read. Every draw is seeded, so an interval is the same on every run.

>>> block_length(np.array([1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]))
2
"""

from __future__ import annotations

import math

import numpy as np


def row_draws(n: int, resamples: int, seed: int) -> np.ndarray:
    """``resamples`` draws of ``n`` rows each, with replacement (one array, a draw per line)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def document_draws(documents: np.ndarray, resamples: int, seed: int) -> list[np.ndarray]:
    """``resamples`` draws of as many documents as there are, with replacement: each draw the rows of its documents,
    in the order drawn. ``documents``: one id per row (rows with the same id are one document)."""
    ids, inverse = np.unique(np.asarray(documents), return_inverse=True)
    members = [np.flatnonzero(inverse == k) for k in range(len(ids))]
    picks = np.random.default_rng(seed).integers(0, len(ids), size=(resamples, len(ids)))
    return [np.concatenate([members[k] for k in p]) for p in picks]


def autocorrelation(x: np.ndarray, lag: int) -> float:
    """The sample autocorrelation of ``x`` at ``lag`` (the lagged products over the variance, both about the mean,
    divided by ``n``); 0 for a constant series."""
    x = np.asarray(x, dtype=np.float64)
    d = x - x.mean()
    var = float(d @ d)
    if var == 0 or lag >= len(x):
        return 0.0
    return float(d[:-lag] @ d[lag:]) / var if lag > 0 else 1.0


def block_length(contributions: np.ndarray) -> int:
    """Rows per block for :func:`block_draws`, chosen from the per-row metric contributions: the larger of
    ``ceil(n^(1/3))`` (the rule of thumb for a moving-block bootstrap of a mean) and the first lag at which the
    autocorrelation falls below ``2 / sqrt(n)`` (where rows stop looking alike), at most ``n // 4`` so a draw holds
    at least four blocks (and at least 1). Non-finite contributions are left out of the autocorrelation."""
    c = np.asarray(contributions, dtype=np.float64)
    n = len(c)
    if n < 4:
        return 1
    finite = c[np.isfinite(c)]
    c = np.where(np.isfinite(c), c, float(np.median(finite)) if len(finite) else 0.0)
    bound = 2 / math.sqrt(n)
    cap = max(1, n // 4)
    lag = 1
    while lag < cap and abs(autocorrelation(c, lag)) >= bound:
        lag += 1
    return max(1, min(cap, max(lag, math.ceil(round(n ** (1 / 3), 9)))))


def block_draws(n: int, length: int, resamples: int, seed: int) -> list[np.ndarray]:
    """``resamples`` draws of ``ceil(n / length)`` blocks of ``length`` contiguous rows, each starting at a row drawn
    from ``0 .. n - length``, joined and cut to ``n`` rows."""
    length = max(1, min(length, n))
    k = -(-n // length)
    starts = np.random.default_rng(seed).integers(0, n - length + 1, size=(resamples, k))
    offsets = np.arange(length)
    return [(s[:, None] + offsets).reshape(-1)[:n] for s in starts]


def percentile_interval(values: np.ndarray, confidence: float, value: float) -> tuple[float, float]:
    """The draws' central ``confidence`` share (linear-interpolated percentiles), widened to hold ``value``."""
    a = (1 - confidence) / 2
    lo, hi = (float(x) for x in np.quantile(np.asarray(values, dtype=np.float64), [a, 1 - a]))
    return min(lo, value), max(hi, value)


__all__ = ["autocorrelation", "block_draws", "block_length", "document_draws", "percentile_interval", "row_draws"]
