"""``output`` (the default for models that are not language models): the relative error of the model's outputs
against the dense model's, ||y - y_dense||_F / ||y_dense||_F over every held-out output (logits for models that return
them; positions with ``attention_mask`` 0 left out), with top-1 agreement shown beside it. Zero on the dense model,
lower is better; tier 1's layer-output errors are in its units, so it is also tier 1's target."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ...errors import AuditError
from .base import Evaluating, Measurement, MetricKind, RowScorer, Scorer
from .common import main_output, per_row, real_rows

if TYPE_CHECKING:
    from ..data.inputs import Batch


class _Scorer(Scorer):
    def __init__(self, ev: Evaluating, dense: nn.Module) -> None:
        super().__init__(ev)
        with torch.no_grad():
            self.outputs = _finite([main_output(ev.forward(dense, b, i)).detach() for i, b in enumerate(ev.batches)])
        self._norm2 = sum(float(real_rows(r, b).double().pow(2).sum()) for r, b in zip(self.outputs, ev.batches))
        self.reference = 0.0

    def measure(self, model: nn.Module) -> Measurement:
        err2 = 0.0
        agree = rows = 0
        with torch.no_grad():
            for i, (b, ref) in enumerate(zip(self.ev.batches, self.outputs)):
                y = main_output(self.ev.forward(model, b, i))
                _same_shape(y, ref, i)
                y, r = real_rows(y, b), real_rows(ref, b)
                err2 += float((y.double() - r.double()).pow(2).sum())
                if r.dim() >= 1 and r.shape[-1] >= 2:
                    agree += int((y.argmax(-1) == r.argmax(-1)).sum())
                    rows += r[..., 0].numel()
        value = math.sqrt(err2 / self._norm2) if self._norm2 > 0 else math.sqrt(err2)
        return self.judged(value, agree / rows if rows else None)


def _finite(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense model's held-out outputs, refused (one line naming the batch) where one holds NaN or Inf."""
    for i, r in enumerate(outputs):
        if r.is_floating_point() and not bool(torch.isfinite(r).all()):
            raise AuditError(f"the dense model's output on held-out batch {i} holds NaN or infinite values, "
                             "so the relative output error cannot be measured",
                             "Check the model's weights and that batch's inputs, or give a metric of your own")
    return outputs


def _same_shape(y: torch.Tensor, ref: torch.Tensor, i: int) -> None:
    if y.shape != ref.shape:
        raise AuditError(f"the model's output on held-out batch {i} is {tuple(y.shape)}, the dense "
                         f"model's {tuple(ref.shape)}", "Measure a model made from the dense one")


class _Rows(RowScorer):
    """Per row: the squared error and the dense output's squared norm."""

    def __init__(self, dense: nn.Module, batches: list[Batch]) -> None:
        self.batches = batches
        self._ref = _finite([main_output(dense(*b.args, **b.kwargs)).detach() for b in batches])
        self._den = np.concatenate([per_row(r.double(), b, lambda t: t.pow(2)).cpu().numpy()
                                    for r, b in zip(self._ref, batches)])

    @property
    def first_output(self) -> object:
        return self._ref[0] if self._ref else None

    def sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        num, agree, seen = [], [], []
        for i, (b, r) in enumerate(zip(self.batches, self._ref)):
            y = main_output(model(*b.args, **b.kwargs))
            _same_shape(y, r, i)
            num.append(per_row(y.double() - r.double(), b, lambda t: t.pow(2)).cpu().numpy())
            if r.dim() >= 2 and r.shape[-1] >= 2:  # classes on the last axis: top-1 agreement per row
                hit = (y.argmax(-1) == r.argmax(-1)).double()
                agree.append(per_row(hit, b, lambda t: t).cpu().numpy())
                seen.append(per_row(torch.ones_like(hit), b, lambda t: t).cpu().numpy())
        self.last_top1 = (np.concatenate(agree), np.concatenate(seen)) if agree and len(agree) == len(num) else None
        return np.concatenate(num), self._den

    def value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        num, den = sums
        d = float(den[idx].sum())
        return math.sqrt(float(num[idx].sum()) / d) if d > 0 else math.sqrt(float(num[idx].sum()))


class OutputError(MetricKind):
    kind = "output"
    names = ("output-error", "output")
    label = "relative output error"
    units = "a share of the dense output's norm"
    layer_error_units = True
    gradient = "output"
    verified_by_rows = True

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        return _Scorer(ev, dense)

    def row_scorer(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> RowScorer:
        return _Rows(dense, batches)


KIND = OutputError()
