"""``perplexity`` (the default for a causal LM): next-token cross-entropy on the held-out text, pads and masked
positions (``attention_mask`` 0, ``labels`` -100) left out. The measured value is the relative increase of the
perplexity over the dense model's (``reference``): zero on the dense model, lower is better, it holds when it is at
most the tolerance (0.02 = +2%). :mod:`.masked` is the same measurement at a masked LM's masked positions."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ...errors import AuditError
from .base import Evaluating, Measurement, MetricKind, RowScorer, Scorer
from .chunks import Scored
from .common import check_targets, kept_row_sums, next_token_scored, next_token_targets, main_output

if TYPE_CHECKING:
    from ..data.inputs import Batch


_EXP_MAX = 709.0  # math.exp overflows a float beyond about 709.78


def _exp(x: float) -> float:
    """``exp(x)``, infinite rather than an ``OverflowError`` where a loss is too large for a float (a plan that
    breaks the model); NaN stays NaN."""
    return math.inf if x > _EXP_MAX else math.exp(x)


def _expm1(x: float) -> float:
    """``exp(x) - 1`` with :func:`_exp`'s overflow to infinity."""
    return math.inf if x > _EXP_MAX else math.expm1(x)


def _dense_value(value: float, kind: "Perplexity") -> float:
    """The dense model's held-out perplexity, refused in one line where it is not a positive finite number."""
    if not (math.isfinite(value) and value > 0):
        raise AuditError(f"the dense model's held-out {kind.what} is {value}",
                         "Check the held-out text and the model's weights (a NaN or infinite logit)")
    return value


class _Scorer(Scorer):
    def __init__(self, ev: Evaluating, dense: nn.Module, kind: "Perplexity") -> None:
        super().__init__(ev)
        self.kind = kind
        self.warnings = kind.warnings_for(ev.batches)
        self.reference = _dense_value(self.perplexity(dense), kind)

    def perplexity(self, model: nn.Module) -> float:
        """Held-out perplexity, streamed batch by batch in float64 sums."""
        nll = 0.0
        count = 0
        with torch.no_grad():
            for i, b in enumerate(self.ev.batches):
                y = main_output(self.ev.forward(model, b, i))
                if isinstance(y, torch.Tensor) and y.dim() == 3:
                    check_targets(b, y.shape[-1], self.kind.scored, i)
                sc = self.kind.scored_positions(y, b)
                nll -= float(sc.picked().double().sum())
                count += len(sc)
        if count == 0:
            raise AuditError(*self.kind.nothing_scored)
        return _exp(nll / count)

    def measure(self, model: nn.Module) -> Measurement:
        ppl = self.perplexity(model)
        v = ppl / self.reference - 1.0 if math.isfinite(ppl) else math.inf
        return self.judged(v, None, ppl)


class _Rows(RowScorer):
    """Per row: the summed cross-entropy of the model and of the dense model, and the positions scored."""

    def __init__(self, dense: nn.Module, batches: list[Batch], kind: "Perplexity") -> None:
        self.batches, self.kind = batches, kind
        self._ref_nll, self._cnt = self._nll(dense)
        nll, cnt = self._ref_nll, self._cnt
        self.reference = self.baseline = (_dense_value(_exp(float(nll.sum() / cnt.sum())), kind) if cnt.sum() > 0
                                          else math.nan)

    def _nll(self, model: nn.Module) -> tuple[np.ndarray, np.ndarray]:
        nll, cnt = [], []
        for i, b in enumerate(self.batches):
            y = main_output(model(*b.args, **b.kwargs))
            check_targets(b, y.shape[-1], self.kind.scored, i)
            keep = self.kind.counted(b)
            nll.append(kept_row_sums(-self.kind.scored_positions(y, b).picked(), keep))  # its shape checked
            cnt.append(keep.sum(1).double().cpu().numpy())
        return np.concatenate(nll), np.concatenate(cnt)

    def sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        nll, cnt = self._nll(model)
        return nll, self._ref_nll, cnt

    def dense_sums(self) -> tuple[np.ndarray, ...]:
        return self._ref_nll, self._ref_nll, self._cnt

    def absolute(self, sums: tuple[np.ndarray, ...]) -> float | None:
        nll, _, cnt = sums
        c = float(cnt.sum())
        return _exp(float(nll.sum()) / c) if c > 0 else None

    def value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        nll, ref, cnt = sums
        c = float(cnt[idx].sum())
        if c <= 0:
            return math.nan
        return _expm1((float(nll[idx].sum()) - float(ref[idx].sum())) / c)


class Perplexity(MetricKind):
    kind = "perplexity"
    names = ("perplexity", "ppl")
    label = "perplexity increase"
    units = "a relative increase of the held-out perplexity"
    gradient = "likelihood"
    predicted_words = "cross-entropy increases"
    verified_by_rows = True
    increase_of = "perplexity"
    what = "perplexity"  # the dense value, in the refusal of a non-finite one
    scored = "next-token"  # which tokens, in the refusal of ids beyond the logits
    nothing_scored = ("the held-out batches hold no next-token position to score (every target masked or "
                      "padding)", "Give held-out text of at least two real tokens per row")

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        return _Scorer(ev, dense, self)

    def row_scorer(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> RowScorer:
        return _Rows(dense, batches, self)

    def scored_positions(self, y: torch.Tensor, b: Batch) -> Scored:
        return next_token_scored(y, b)

    def counted(self, b: Batch) -> torch.Tensor:
        """Which positions count, per row (rows, positions - 1): those predicting a next token that counts."""
        return next_token_targets(b)[1]

    def warnings_for(self, batches: list[Batch]) -> list[str]:
        return []


KIND = Perplexity()
