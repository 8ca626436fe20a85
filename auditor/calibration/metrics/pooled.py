"""``pooled`` (the default for a sentence encoder in the sentence-transformers layout: ``modules.json`` naming a
Pooling module, ``1_Pooling/config.json``): the cosine of each row's pooled embedding to the dense model's, read as
the distance 1 - cosine (a row is one sequence), averaged over the rows. The token states (``last_hidden_state``,
else the compared output) are pooled as sentence-transformers pools them: ``mean`` over the real positions
(``attention_mask`` != 0), ``cls`` (the first position), ``max`` over the real positions, several modes concatenated
in its order (cls, max, mean). ``2_Normalize`` changes no cosine, so it needs no reading. Zero on the dense model,
lower is better, it holds when it is at most the tolerance (0.01: a mean cosine of 0.99); a row with no real
position is not counted.

The distance is computed as ||a - b||^2 / 2 of the unit embeddings (equal to 1 - cosine, without the cancellation
of 1 - a number near 1), in float64. Its output-gradient sensitivity (``gradient = "embedding"``) projects the
unit embeddings at random: the predicted cost is the mean of ||de||^2 / 2, the distance itself to second order, and
adds up across layers as it is. Tier 1 ranks each layer for the layer-output error sqrt(2 t) at which a unit
vector's distance reaches the tolerance t."""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from ...errors import AuditError
from .base import Evaluating, Measurement, MetricKind, RowScorer, Scorer
from .common import main_output

if TYPE_CHECKING:
    from ..data.inputs import Batch

MODES = ("cls", "max", "mean")  # sentence-transformers' order when several are concatenated
DEFAULT_POOLING = ("mean",)


def token_states(out: object) -> torch.Tensor:
    """The token states a sentence encoder pools: ``last_hidden_state`` where the output has one, else the compared
    output (:func:`~.common.main_output`); (batch, positions, features), one line else."""
    y = getattr(out, "last_hidden_state", None)
    if not isinstance(y, torch.Tensor):
        y = main_output(out)
    if y.dim() != 3 or not y.is_floating_point():
        raise AuditError(f"the pooled-cosine metric pools token states (batch, positions, features); the model "
                         f"returned {y.dtype} {tuple(y.shape)}", "Use --metric output-error for this model")
    return y


def real_positions(b: Batch, y: torch.Tensor) -> torch.Tensor:
    """(batch, positions) booleans: ``attention_mask`` != 0 where the batch has a 2-D mask shaped like the states,
    else every position."""
    m = b.kwargs.get("attention_mask")
    if isinstance(m, torch.Tensor) and m.dim() == 2 and tuple(m.shape) == tuple(y.shape[:2]):
        return m != 0
    return torch.ones(y.shape[:2], dtype=torch.bool, device=y.device)


def pool(y: torch.Tensor, keep: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """(batch, features x modes) pooled embeddings of token states ``y`` (float64), padding left out of mean and
    max, the modes concatenated in sentence-transformers' order."""
    y = y.double()
    k = keep[..., None]
    parts = []
    for mode in MODES:
        if mode not in modes:
            continue
        if mode == "cls":
            parts.append(y[:, 0])
        elif mode == "max":
            parts.append(y.masked_fill(~k, -math.inf).amax(1).nan_to_num(neginf=0.0))
        else:
            parts.append((y * k).sum(1) / k.sum(1).clamp_min(1))
    return torch.cat(parts, -1)


def unit_embeddings(out: object, b: Batch, modes: tuple[str, ...]) -> torch.Tensor:
    """The pooled embeddings scaled to unit length (float64); a row with no real position, or a zero embedding, is
    zero."""
    y = token_states(out)
    keep = real_positions(b, y)
    e = pool(y, keep, modes)
    e = torch.nn.functional.normalize(e, dim=-1)
    return e * keep.any(1, keepdim=True)


def counted(b: Batch, e: torch.Tensor) -> torch.Tensor:
    """(batch,) 1.0 for the rows that count (some real position), else 0."""
    m = b.kwargs.get("attention_mask")
    if isinstance(m, torch.Tensor) and m.dim() == 2 and m.shape[0] == e.shape[0]:
        return (m != 0).any(1).double()
    return torch.ones(e.shape[0], dtype=torch.float64, device=e.device)


def _finite(e: torch.Tensor, i: int) -> torch.Tensor:
    """The dense model's unit embeddings of held-out batch ``i``, refused (one line) where one holds NaN or Inf."""
    if not bool(torch.isfinite(e).all()):
        raise AuditError(f"the dense model's pooled embedding on held-out batch {i} holds NaN or infinite values, so "
                         "its cosine cannot be measured", "Check the model's weights and that batch's inputs")
    return e


def distances(e: torch.Tensor, ref: torch.Tensor, i: int) -> torch.Tensor:
    """(batch,) 1 - cosine of unit rows ``e`` to ``ref``, as ||e - ref||^2 / 2 (NaN rows stay NaN: a miss)."""
    if e.shape != ref.shape:
        raise AuditError(f"the model's pooled embedding on held-out batch {i} is {tuple(e.shape)}, the dense "
                         f"model's {tuple(ref.shape)}", "Measure a model made from the dense one")
    return (e - ref).pow(2).sum(-1) / 2


class _Rows(RowScorer):
    """Per row: 1 - cosine to the dense embedding, and whether the row counts."""

    def __init__(self, dense: nn.Module, batches: list[Batch], modes: tuple[str, ...],
                 forward: "Callable[[nn.Module, Batch, int], object] | None" = None) -> None:
        self.batches, self.modes = batches, modes
        self._forward = forward or (lambda model, b, i: model(*b.args, **b.kwargs))
        self._ref = [_finite(unit_embeddings(self._forward(dense, b, i), b, modes).detach(), i) for i, b in
                     enumerate(batches)]
        self._cnt = np.concatenate([counted(b, e).cpu().numpy() for b, e in zip(batches, self._ref)]) \
            if batches else np.zeros(0)

    def sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        d = []
        for i, (b, ref) in enumerate(zip(self.batches, self._ref)):
            e = unit_embeddings(self._forward(model, b, i), b, self.modes)
            d.append((distances(e, ref, i) * counted(b, ref)).detach().cpu().numpy())
        return (np.concatenate(d) if d else np.zeros(0)), self._cnt

    def value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        d, cnt = sums
        c = float(cnt[idx].sum())
        return float(d[idx].sum()) / c if c > 0 else math.nan


class _Scorer(Scorer):
    def __init__(self, ev: Evaluating, dense: nn.Module, modes: tuple[str, ...]) -> None:
        super().__init__(ev)
        with torch.no_grad():
            self._rows = _Rows(dense, ev.batches, modes, ev.forward)
        if not self._rows._cnt.sum():
            raise AuditError("the held-out batches hold no row with a real position to pool (every attention_mask "
                             "all 0)", "Give held-out rows with at least one real token")
        self.reference = 0.0

    def measure(self, model: nn.Module) -> Measurement:
        with torch.no_grad():
            return self.judged(self._rows.value(self._rows.sums(model)))


class PooledCosine(MetricKind):
    kind = "pooled"
    names = ("pooled-cosine", "pooled", "sentence-cosine")
    label = "pooled-embedding cosine distance"
    units = "1 - the mean cosine of the pooled embeddings"
    gradient = "embedding"
    predicted_words = "cosine distances"
    verified_by_rows = True
    pools = True
    modes: tuple[str, ...] = DEFAULT_POOLING

    def bound(self, pooling: tuple[str, ...]) -> "PooledCosine":
        """This kind pooling with ``pooling`` (sentence-transformers' modes; empty: mean), its label naming them
        ("pooled-embedding cosine distance (mean pooling)"); ValueError naming the modes it pools, for another."""
        modes = tuple(pooling) or DEFAULT_POOLING
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise ValueError(f"pooling mode {bad[0]!r} is not one the pooled-cosine metric pools ({', '.join(MODES)})")
        out = copy.copy(self)
        out.modes = tuple(m for m in MODES if m in modes)
        out.label = f"{type(self).label} ({'+'.join(out.modes)} pooling)"
        return out

    def tier1_target(self, tolerance: float) -> float:
        """The layer-output error at which a unit vector's distance ||de||^2 / 2 reaches the tolerance: sqrt(2 t)."""
        return math.sqrt(2.0 * max(tolerance, 0.0))

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        return _Scorer(ev, dense, self.modes)

    def row_scorer(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> RowScorer:
        return _Rows(dense, batches, self.modes)

    def embedding(self, out: object, b: Batch) -> torch.Tensor:
        return unit_embeddings(out, b, self.modes)


KIND = PooledCosine()
