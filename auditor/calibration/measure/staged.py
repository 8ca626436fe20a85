"""Tier 3's measurements at the cost they need: a plan measured on a few of the search rows first, and on more of
them only while those cannot tell which side of the tolerance the plan lies.

The search rows are cut into stages that double: the first ``MIN_HEAD`` rows (the head), then the next ``MIN_HEAD``,
then twice as many, and so on, the last stage ending at the last search row (fewer search rows than twice
``MIN_HEAD``: one stage). A plan is measured stage by stage, row by row (the per-row sums of
:class:`~auditor.calibration.measure.verify.Verifier`), and after each stage the bootstrap interval over the rows read so far
at ``STAGE_CONFIDENCE`` decides: an interval wholly within the tolerance holds, one wholly beyond it fails, and only a
plan whose interval still straddles it reads the next stage; its value is then the metric over every row read (the
stages' per-row sums joined: no row is run twice). A plan far from the tolerance reads the head alone; one at it
reads every search row. The dense model's per-row sums are computed once per stage (the head's when the evaluator is
built, a later stage's when a plan first needs it). The search only orders plans; the suggested plan is still verified
on every verification row with the audit's interval (``tiers.passes.verify``), which is what the report's verdict says.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from torch import nn

from ...errors import AuditError
from ..data.inputs import Batch
from .metric import Measurement, Metric, check_repeats
from .verify import Verifier, _slice

MIN_HEAD = 16  # rows in the head (and in the second stage; each later stage doubles the rows read)
STAGE_CONFIDENCE = 0.99  # the interval that decides a plan before the next stage


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


def stage_ends(rows: int) -> list[int]:
    """The rows read after each stage: ``MIN_HEAD``, then doubling, the last stage ending at ``rows`` (one stage
    when ``rows`` is under twice ``MIN_HEAD``)."""
    ends: list[int] = []
    end = MIN_HEAD
    while 2 * end <= rows and end < rows:
        ends.append(end)
        end *= 2
    return ends + [rows] if not ends or ends[-1] < rows else ends


def _stages(batches: list[Batch], rows: int) -> list[list[Batch]]:
    """The batches of each stage (:func:`stage_ends`); an unbatched example stays whole, in the stage it starts."""
    out: list[list[Batch]] = []
    rest, done = list(batches), 0
    for end in stage_ends(rows)[:-1]:
        part, rest = _cut(rest, end - done)
        done += sum(b.rows for b in part)
        if part:  # an unbatched example read whole by an earlier stage leaves this one nothing
            out.append(part)
    return [*out, rest] if rest else out


class StagedEvaluator:
    """Measures models on ``batches`` (the search rows) in stages against the dense model's per-row sums.

    ``measure(model)`` returns a :class:`~auditor.calibration.measure.metric.Measurement` (for perplexity the relative
    increase, as :class:`~auditor.calibration.measure.metric.Evaluator` gives); ``last_rows`` says how many rows the last
    measurement read. ``evaluations``: plans measured; ``full``: those measured on every row. Built-in metrics only
    (a user metric scores all batches at once: :class:`~auditor.calibration.measure.metric.Evaluator`)."""

    def __init__(self, dense: nn.Module, batches: list[Batch], metric: Metric) -> None:
        if not metric.spec.verified_by_rows:
            raise ValueError("a user metric is measured on every row at once (Evaluator)")
        self.metric = metric
        self.dense = dense
        self.rows = sum(b.rows for b in batches)
        self._parts = _stages(batches, self.rows) or [[]]
        head = self._parts[0]
        try:
            self.head = Verifier(dense, head, metric, STAGE_CONFIDENCE, unseen=False)
        except AuditError:
            raise
        except Exception:  # noqa: BLE001 - a batch the forward refuses: one line naming it (check_repeats's)
            if head:
                check_repeats(dense, head[0])
            raise
        if head:  # dropout left on, or noise: refused before any plan is measured (the output: its first run kept)
            check_repeats(dense, head[0], self.head.rows_scorer.first_output)
        self.repeats_checked = bool(head)  # on the first search rows: the references' evaluator need not again
        self._later: list[Verifier | None] = [None] * (len(self._parts) - 1)
        self.evaluations = 0
        self.full = 0
        self.last_rows = 0

    def stage(self, i: int) -> Verifier:
        """Stage ``i``'s verifier (0: the head), built (the dense model's per-row sums on its rows) when first
        needed; the KL's stages share the head's frozen dense copy."""
        if i == 0:
            return self.head
        if self._later[i - 1] is None:
            self._later[i - 1] = Verifier(self.dense, self._parts[i], self.metric, STAGE_CONFIDENCE,
                                          share=self.head, unseen=False)
        return self._later[i - 1]  # type: ignore[return-value]

    @property
    def stages(self) -> int:
        return len(self._parts)

    @property
    def built(self) -> list[Verifier]:
        """The stages built so far (the head first)."""
        return [self.head, *(v for v in self._later if v is not None)]

    @property
    def reference(self) -> float:
        """The dense model's value on every search row: its perplexity for perplexity (0 for the output error and
        the KL, which compare with the dense model itself)."""
        if self.head.rows_scorer.dense_sums() is None:
            return 0.0
        parts = [self.stage(i).rows_scorer.dense_sums() for i in range(self.stages)]
        value = self.head.rows_scorer.absolute(tuple(np.concatenate(x) for x in zip(*parts)))
        return math.nan if value is None else value

    def _decided(self, sums: tuple[np.ndarray, ...]) -> bool:
        v = self.head.judge(sums)
        tol = self.metric.tolerance
        return not math.isfinite(v.value) or (v.low is not None and (v.high <= tol or v.low > tol))

    def measure(self, model: nn.Module) -> Measurement:
        self.evaluations += 1
        sums, top, i = self._read(model, lambda s: not self._decided(s))
        self.full += i == self.stages and self.stages > 1
        return self._measurement(sums, top)

    def measure_rows(self, model: nn.Module, rows: int) -> Measurement:
        """``model`` on the first ``rows`` search rows, whatever its interval says: the stages a plan measured
        before read (``rows`` a stage's end, :func:`stage_ends`), so a baseline beside it reads exactly its rows."""
        self.evaluations += 1
        sums, top, _ = self._read(model, lambda s: len(s[-1]) < rows)
        return self._measurement(sums, top)

    def _read(self, model: nn.Module, more: Callable[[tuple[np.ndarray, ...]], bool],
              ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, np.ndarray] | None, int]:
        """(per-row sums, top-1 counts, stages read): the head, then the next stage while ``more(sums so far)``."""
        sums = self.head._sums(model)
        top = self.head.last_top1
        i = 1
        while i < self.stages and more(sums):
            part = self.stage(i)
            sums = tuple(np.concatenate([a, b]) for a, b in zip(sums, part._sums(model)))
            if top is not None and part.last_top1 is not None:
                top = (np.concatenate([top[0], part.last_top1[0]]), np.concatenate([top[1], part.last_top1[1]]))
            i += 1
        self.last_rows = len(sums[-1])
        return sums, top, i

    @property
    def rows_read(self) -> int:
        """The search rows the last measurement read (its stages)."""
        return self.last_rows

    def _measurement(self, sums: tuple[np.ndarray, ...], top: tuple[np.ndarray, np.ndarray] | None) -> Measurement:
        value = self.head._value(sums)
        top1 = float(top[0].sum() / top[1].sum()) if top is not None and top[1].sum() > 0 else None
        absolute = self.head.rows_scorer.absolute(sums) if math.isfinite(value) else None
        return Measurement(value, value <= self.metric.tolerance, top1, absolute)


__all__ = ["MIN_HEAD", "STAGE_CONFIDENCE", "StagedEvaluator", "stage_ends"]
