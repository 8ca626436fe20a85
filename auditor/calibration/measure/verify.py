"""Search on one split, verify on another: the held-out rows cut in two, and a confidence interval over windows.

The held-out rows (windows of text, examples) are cut into a search part (the first ``SEARCH_SHARE`` of the rows,
contiguous: the text the search reads) and a verification part (the rest) that tiers 2 and 3 never touch. A plan is
verified by measuring it on every verification row and resampling the rows (the bootstrap over windows, ``RESAMPLES``
draws, seeded): the metric is recomputed from each draw's per-row sums (the squared error and the dense output's
squared norm; the cross-entropy and its positions for the model and the dense model; the KL and its positions), and
the interval is the draws' central ``confidence`` share (percentiles). A plan holds when the interval's upper end is
within the tolerance, misses when its lower end is beyond it, and straddles it otherwise.

The per-row sums are the metric kind's (:class:`~auditor.calibration.metrics.RowScorer`); a metric scored all
batches at once (a user metric ``fn(model, batches)``) gets its value on the verification rows and no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from ...calresults import UnseenInterval, Verification
from ..data.documents import document_cut
from ..data.inputs import Batch, Calibration, model_device
from .metric import Evaluator, Metric
from .resample import block_draws, block_length, document_draws, percentile_interval, row_draws

if TYPE_CHECKING:
    from ..metrics.base import RowScorer

SEARCH_SHARE = 0.5  # of the held-out rows, for the search; the rest verify
RESAMPLES = 2000
SEED = 0
MIN_ROWS = 8  # fewer verification rows than this: no interval worth the name
RESOLVE = 0.25  # an interval resolves the tolerance when its half-width is at most this share of it


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    return b.cut(lo, hi)


def search_rows(total: int, share: float = SEARCH_SHARE) -> int:
    """Of ``total`` held-out rows, how many :func:`split_rows` gives the search (without documents to cut on):
    ``share`` of them, rounded, at least one and leaving one; every row when there are fewer than two."""
    return total if total < 2 else min(total - 1, max(1, int(round(total * share))))


def split_rows(batches: list[Batch], share: float = SEARCH_SHARE,
               documents: "tuple[int, ...] | None" = None) -> tuple[list[Batch], list[Batch]]:
    """(search, verification) batches: the first ``share`` of the rows and the rest, cut inside a batch where the
    line falls there (on the nearest document boundary where ``documents`` says each row's). Fewer than two rows:
    both parts are every row (nothing to split; the report says so)."""
    total = sum(b.rows for b in batches)
    if total < 2:
        return list(batches), list(batches)
    cut = search_rows(total, share)
    if documents is not None and len(documents) == total and len(set(documents)) >= 2:
        cut = document_cut(list(documents), 1 - share)
    search: list[Batch] = []
    verify: list[Batch] = []
    seen = 0
    for b in batches:
        n = b.rows
        if seen + n <= cut:
            search.append(b)
        elif seen >= cut:
            verify.append(b)
        else:
            search.append(_slice(b, 0, cut - seen))
            verify.append(_slice(b, cut - seen, n))
        seen += n
    return search, verify


@dataclass(frozen=True)
class Documents:
    """Which rows belong together: one document id per row (None: the calibration does not say), what a document
    is ("files", "documents") and what a row is ("windows", "rows")."""

    ids: np.ndarray | None = None
    unit: str = "documents"
    row_unit: str = "rows"

    @property
    def count(self) -> int:
        return 0 if self.ids is None else len(np.unique(self.ids))


def unseen_interval(value_of: "Callable[[np.ndarray], float]", n: int, value: float, confidence: float,
                    documents: Documents | None) -> UnseenInterval:
    """The interval for text the tool never read, as much of it as the verification rows, from ``value_of(rows)``
    (the metric on a draw's rows): whole documents resampled where ``documents`` name two or more, else blocks of
    :func:`~.resample.block_length` rows chosen from the per-row values (each row's metric alone).

    A prediction interval, not one for the mean: two independent sets of draws, and the interval is ``value`` plus
    the central ``confidence`` share of their differences (the new text's value differs from the measured one by
    the sampling error of both, which the difference of two draws carries; an interval for the mean alone covers
    the value on other documents about as often as the row interval did: docs/calibration.md)."""
    if documents is not None and documents.count >= 2:
        a, b = (document_draws(documents.ids, RESAMPLES, SEED + k) for k in (0, 1))
        kind, groups, unit, block = "documents", documents.count, documents.unit, 0
    else:
        block = block_length(np.array([value_of(np.array([i])) for i in range(n)]))
        a, b = (block_draws(n, block, RESAMPLES, SEED + k) for k in (0, 1))
        kind, groups, unit = "blocks", -(-n // block), documents.row_unit if documents is not None else "rows"
    shifts = np.array([value_of(x) - value_of(y) for x, y in zip(a, b)])
    low, high = percentile_interval(value + shifts, confidence, value)
    return UnseenInterval(low, high, kind, groups, unit, block)


def verification_documents(cal: Calibration, search: list[Batch], verify: list[Batch]) -> Documents:
    """The verification rows' documents: the held-out rows' after the search part's, where the calibration says,
    and what a row is (:func:`row_unit`)."""
    held = cal.held_documents
    unit = row_unit(verify)
    if held is None:
        return Documents(None, cal.document_unit, unit)
    ids = np.array(held[sum(b.rows for b in search):])
    return Documents(ids - (ids.min() if len(ids) else 0), cal.document_unit, unit)


def row_unit(batches: list[Batch]) -> str:
    """What a row is: "windows" where the first input is token ids (an integer tensor of rows x positions), else
    "rows"."""
    ts = batches[0].tensors() if batches else []
    t = ts[0][1] if ts else None
    token_ids = t is not None and t.dim() == 2 and not t.dtype.is_floating_point and t.dtype != torch.bool
    return "windows" if token_ids else "rows"


def with_holdout(cal: Calibration, batches: list[Batch]) -> Calibration:
    """``cal`` measuring on ``batches`` (the same fit rows, digest and warnings list)."""
    return replace(cal, holdout=batches, warnings=cal.warnings)


class Verifier:
    """Measures models on the verification rows, row by row, against the dense model's per-row sums."""

    def __init__(self, dense: nn.Module, batches: list[Batch], metric: Metric, confidence: float = 0.9,
                 share: "Verifier | None" = None, documents: Documents | None = None, unseen: bool = True) -> None:
        """``share``: another verifier of the same dense model whose dense state (the KL's frozen copy) this one
        reuses instead of copying the model again. ``documents``: which verification rows belong together (one id
        per row, and what the documents and rows are): whole documents are resampled for the unseen interval where
        it names two or more, else blocks of rows; ``unseen`` False: no unseen interval (the
        staged search's verifiers, which judge the search rows' own mean)."""
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), not {confidence!r}")
        self.metric = metric
        self.confidence = confidence
        self.documents = documents
        self.unseen = unseen
        device = model_device(dense)
        self.batches = [b.to(device) for b in batches]
        self.rows = sum(b.rows for b in self.batches)
        self.evaluations = 0
        self._at_once: Evaluator | None = None
        with torch.no_grad():
            if metric.spec.verified_by_rows:  # summed row by row: resampled for the interval
                like = share._rows if share is not None else None
                self._rows: "RowScorer" = metric.spec.row_scorer(dense, self.batches, like)
                self.reference = self._rows.reference
            else:  # scored all at once: its value on these rows, no interval
                self._rows = None
                self._at_once = Evaluator(dense, Calibration([], list(batches)), metric)
                self.reference = self._at_once.reference

    def _sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        with torch.no_grad():
            return self._rows.sums(model)

    def _value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        return self._rows.value(sums, idx)

    @property
    def last_top1(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Per row (agreeing, counted) positions of the last model measured, where the metric counts them."""
        return None if self._rows is None else self._rows.last_top1

    @property
    def rows_scorer(self) -> "RowScorer":
        """The metric's row scorer (None for a metric scored all at once)."""
        return self._rows

    def measure(self, model: nn.Module) -> Verification:
        """The metric on every verification row, with the bootstrap interval over rows at ``confidence``."""
        self.evaluations += 1
        tol = self.metric.tolerance
        if self._at_once is not None:
            m = self._at_once.measure(model)
            return Verification(m.value, None, None, self.confidence, self.rows, m.ok, False, self._needed(None))
        return self.judge(self._sums(model))

    def judge(self, sums: tuple[np.ndarray, ...]) -> Verification:
        """The value of per-row sums (:meth:`_sums`) over every row, with the bootstrap interval over rows."""
        tol = self.metric.tolerance
        value = self._value(sums)
        self.rows = n = len(sums[-1])  # the outputs' rows (windows, examples): what is resampled
        lo = hi = None
        unseen = None
        if n >= 2 and math.isfinite(value):  # an infinite or undefined value has no interval
            vals = np.array([self._value(sums, d) for d in row_draws(n, RESAMPLES, SEED)])
            lo, hi = percentile_interval(vals, self.confidence, value)
            unseen = None if not self.unseen else unseen_interval(lambda idx: self._value(sums, idx), n, value, self.confidence, self.documents)
        jlo, jhi = (unseen.low, unseen.high) if unseen is not None else (lo, hi)  # judged on the wider question
        ok = jhi <= tol if jhi is not None else value <= tol  # one row: no interval (a warning says so)
        straddles = jhi is not None and jlo <= tol < jhi
        needed = (self._needed(None if jhi is None else (jhi - jlo) / 2, value if straddles else None)
                  if math.isfinite(value) else None)
        return Verification(value, lo, hi, self.confidence, self.rows, ok, straddles, needed,
                            reference=self._rows.baseline, unseen=unseen)

    def _needed(self, half: float | None, straddling: float | None = None) -> int | None:
        """Verification rows that would resolve the tolerance, when these do not (None when they do, or nothing
        can be said): a half-width at most ``RESOLVE`` of the tolerance and, for a value whose interval straddles
        it, at most the value's distance from it (the interval shrinks as one over the square root of the rows)."""
        tol = self.metric.tolerance
        if half is None:
            return None if self._rows is None else max(MIN_ROWS, 2 * self.rows)
        want = RESOLVE * tol
        if straddling is not None and straddling != tol:
            want = min(want, abs(straddling - tol))
        if self.rows >= MIN_ROWS and half <= want:
            return None
        return max(MIN_ROWS, int(math.ceil(self.rows * (half / want) ** 2))) if half > 0 else MIN_ROWS


__all__ = ["Documents", "MIN_ROWS", "RESAMPLES", "SEARCH_SHARE", "Verifier", "row_unit", "search_rows", "split_rows",
           "unseen_interval", "verification_documents", "with_holdout"]
