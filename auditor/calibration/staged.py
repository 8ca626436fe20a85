"""Tier 3's measurements at the cost they need: a plan measured on a subsample of the search rows first, and on the
rest of them only when the subsample cannot tell which side of the tolerance the plan lies.

The search rows are cut into a head (the first ``HEAD_SHARE`` of them, at least ``MIN_HEAD`` rows) and a tail (the
rest). A plan is measured on the head, row by row (the per-row sums of :class:`~auditor.calibration.verify.Verifier`),
and the head's bootstrap interval over rows at ``STAGE_CONFIDENCE`` decides: an interval wholly within the tolerance
holds, one wholly beyond it fails, and only a plan whose interval straddles it (its value near the tolerance) is
measured on the tail too; its value is then the metric over every search row (the head's per-row sums joined to the
tail's: no row is run twice). The dense model's per-row sums are computed once (the head's when the evaluator is
built, the tail's when a plan first needs them). The search only orders plans; the suggested plan is still verified
on every verification row with the audit's interval (``stage._verify``), which is what the report's verdict says.
"""

from __future__ import annotations

import math

import numpy as np
from torch import nn

from ..errors import AuditError
from .inputs import Batch
from .metric import Measurement, Metric, check_repeats
from .verify import Verifier, _slice

HEAD_SHARE = 0.25  # of the search rows, measured for every plan
MIN_HEAD = 16  # rows at least in the head; fewer search rows than twice this: every plan on all of them
STAGE_CONFIDENCE = 0.99  # the head's interval that decides a plan without the tail


def _cut(batches: list[Batch], rows: int) -> tuple[list[Batch], list[Batch]]:
    """(head, tail): the first ``rows`` rows and the rest, a batch cut where the line falls inside it when its
    tensors are batched (2-D or more: rows first); an unbatched example (a 1-D tensor) is never cut."""
    head: list[Batch] = []
    tail: list[Batch] = []
    seen = 0
    for b in batches:
        n = b.rows
        ts = b.tensors()
        if seen >= rows:
            tail.append(b)
        elif seen + n <= rows or not ts or ts[0][1].dim() < 2:
            head.append(b)
        else:
            head.append(_slice(b, 0, rows - seen))
            tail.append(_slice(b, rows - seen, n))
        seen += n
    return head, tail


class StagedEvaluator:
    """Measures models on ``batches`` (the search rows) in two stages against the dense model's per-row sums.

    ``measure(model)`` returns a :class:`~auditor.calibration.metric.Measurement` (for perplexity the relative
    increase, as :class:`~auditor.calibration.metric.Evaluator` gives); ``rows`` of the last measurement say how many
    rows it read. ``evaluations``: plans measured; ``full``: those measured on every row. Built-in metrics only (a
    user metric scores all batches at once: :class:`~auditor.calibration.metric.Evaluator`)."""

    def __init__(self, dense: nn.Module, batches: list[Batch], metric: Metric) -> None:
        if metric.kind == "user":
            raise ValueError("a user metric is measured on every row at once (Evaluator)")
        self.metric = metric
        self.dense = dense
        self.rows = sum(b.rows for b in batches)
        head_rows = max(MIN_HEAD, int(math.ceil(HEAD_SHARE * self.rows)))
        if head_rows * 2 > self.rows:
            head, self._tail_batches = list(batches), []
        else:
            head, self._tail_batches = _cut(batches, head_rows)
        try:
            self.head = Verifier(dense, head, metric, STAGE_CONFIDENCE)
        except AuditError:
            raise
        except Exception:  # noqa: BLE001 - a batch the forward refuses: one line naming it (check_repeats's)
            if head:
                check_repeats(dense, head[0])
            raise
        if head:  # dropout left on, or noise: refused before any plan is measured (the output: its first run kept)
            check_repeats(dense, head[0], self.head._ref[0] if self.head._ref else None)
        self._tail: Verifier | None = None
        self.evaluations = 0
        self.full = 0
        self.last_rows = 0

    @property
    def tail(self) -> Verifier | None:
        """The tail's verifier, built (the dense model's per-row sums on the tail) when first needed."""
        if self._tail is None and self._tail_batches:
            self._tail = Verifier(self.dense, self._tail_batches, self.metric, STAGE_CONFIDENCE,
                                  frozen=self.head._dense)  # KL: the head's frozen dense copy, not a second one
        return self._tail

    @property
    def reference(self) -> float:
        """The dense model's value on every search row: its perplexity for perplexity (0 for the output error and
        the KL, which compare with the dense model itself)."""
        if self.metric.kind not in ("perplexity", "masked"):
            return 0.0
        parts = [self.head] + ([self.tail] if self.tail is not None else [])
        nll = sum(float(p._ref_nll.sum()) for p in parts)
        cnt = sum(float(p._cnt.sum()) for p in parts)
        return math.exp(nll / cnt) if cnt > 0 else math.nan

    def measure(self, model: nn.Module) -> Measurement:
        self.evaluations += 1
        tol = self.metric.tolerance
        sums = self.head._sums(model)
        top = self.head.last_top1
        v = self.head.judge(sums)
        decided = v.low is not None and (v.high <= tol or v.low > tol)
        tail = None if decided or not math.isfinite(v.value) else self.tail
        if tail is not None:
            more = tail._sums(model)
            sums = tuple(np.concatenate([a, b]) for a, b in zip(sums, more))
            if top is not None and tail.last_top1 is not None:
                top = (np.concatenate([top[0], tail.last_top1[0]]), np.concatenate([top[1], tail.last_top1[1]]))
            self.full += 1
        self.last_rows = len(sums[-1])
        value = self.head._value(sums)
        top1 = float(top[0].sum() / top[1].sum()) if top is not None and top[1].sum() > 0 else None
        absolute = None
        if self.metric.kind in ("perplexity", "masked") and math.isfinite(value):
            nll, ref, cnt = sums
            absolute = math.exp(float(nll.sum()) / float(cnt.sum()))
        return Measurement(value, value <= tol, top1, absolute)


__all__ = ["HEAD_SHARE", "MIN_HEAD", "STAGE_CONFIDENCE", "StagedEvaluator"]
