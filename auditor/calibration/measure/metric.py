"""The model-level metric: how far a truncated model is from the dense one on the held-out batches.

A :class:`Metric` is what the user configured: a kind (a module of :mod:`auditor.calibration.metrics`, which says
what is measured, which way is better and how a value is judged), a tolerance, and for a user metric its function
and declared direction. The kinds built in: ``output`` (the relative output error, the default for models that are
not language models), ``perplexity`` (its relative increase, the default for a causal LM), ``masked`` (the
masked-token perplexity's relative increase, the default for a masked LM), ``kl`` (next-token KL), ``pooled`` (1 -
the cosine of a sentence encoder's pooled embedding, the default for a sentence-transformers directory) and ``user``
(``fn(model, batches) -> float``, higher-is-better unless declared otherwise). An :class:`Evaluator` measures models
with one on the held-out batches, against the dense model's reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from ...errors import AuditError, first_line
from .. import metrics
from ..data.inputs import Batch, Calibration, import_function, model_device
from ..data.text import model_vocab
from ..metrics.base import Measurement, MetricKind, Scorer
from ..metrics.common import main_output
from ..metrics.masked import NO_LABELS

UserMetric = Callable[[nn.Module, list[object]], float]
DEFAULT_TOLERANCE = 0.01


def load_metric(spec: str) -> UserMetric:
    """``file.py:fn`` or ``module:fn`` for --metric."""
    if ":" not in spec:
        raise AuditError(f"--metric {spec!r} is neither a metric name nor a function",
                         f"Use --metric {', '.join(metrics.names())}, or file.py:fn / module:fn")
    return import_function(spec)


@dataclass
class Metric:
    """What is measured, which way is better, and how much may be lost.

    ``kind``: a registered metric kind (:mod:`auditor.calibration.metrics`); empty: "user" with ``fn``, else
    "output". Every metric declares its direction in ``higher_is_better``: a built-in kind's own, which cannot be
    declared otherwise; a user metric is higher-is-better unless it says ``higher_is_better=False``. Judging a value
    (``holds``, ``cost``, ``used``) and the tier-1 target are the kind's."""

    fn: UserMetric | None = None  # a user metric; None: a built-in one
    tolerance: float = DEFAULT_TOLERANCE
    name: str = ""
    kind: str = ""
    higher_is_better: bool | None = None  # None: the kind's own (a user metric: True)
    pooling: tuple[str, ...] = ()  # a kind that pools (pooled-cosine): sentence-transformers' modes (empty: mean)

    def __post_init__(self) -> None:
        if not self.kind:
            self.kind = "user" if self.fn is not None else "output"
        self.pooling = (self.pooling,) if isinstance(self.pooling, str) else tuple(self.pooling)
        spec = self.spec
        if spec.takes_function != (self.fn is not None):
            raise ValueError(f"a {self.kind!r} metric {'needs' if spec.takes_function else 'takes no'} function")
        self.higher_is_better = spec.direction(self.higher_is_better)

    @property
    def spec(self) -> MetricKind:
        """The kind's module object: everything about this kind of metric (bound to ``pooling`` for a kind that
        pools)."""
        return metrics.for_kind(self.kind).bound(self.pooling)

    @property
    def output_error(self) -> bool:
        """The tier-1 layer-output errors predict it (in its units)."""
        return self.spec.layer_error_units

    @property
    def tier1_target(self) -> float:
        """The layer-output error tier 1 ranks for: the tolerance for a metric in those units, else 1%."""
        return self.spec.tier1_target(self.tolerance)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return getattr(self.fn, "__name__", "metric") if self.fn is not None else self.spec.label

    def holds(self, value: float, reference: float) -> bool:
        return self.spec.holds(value, reference, self.tolerance, bool(self.higher_is_better))

    def cost(self, value: float, reference: float) -> float:
        return self.spec.cost(value, reference, bool(self.higher_is_better))

    def used(self, value: float, reference: float) -> float:
        return self.spec.used(value, reference, bool(self.higher_is_better))

    @property
    def tolerance_cost(self) -> float:
        return self.spec.tolerance_cost(self.tolerance)

    def check_reportable(self) -> None:
        """The audit's reports read a metric judged against the dense value as higher-is-better: one line, else."""
        if not self.spec.reportable(bool(self.higher_is_better)):
            raise AuditError(f"metric {self.label} is declared lower-is-better; the audit's reports read a "
                             "user metric as higher-is-better", "Return the negative (e.g. -loss) from the "
                             "metric, or measure with the library calls (measure_floors, plan_for_budget)")


def is_causal_lm(model: nn.Module, batch: "Batch | None" = None) -> bool:
    """A causal language model: a Hugging Face ``*ForCausalLM`` / ``*LMHeadModel``, or (not a Hugging Face model) one
    that takes ``input_ids`` and returns logits over its vocabulary (the rows of its largest embedding) at every
    position of ``batch``. Masked LMs and encoders are not."""
    name = type(model).__name__
    if name.endswith("ForCausalLM") or name.endswith("LMHeadModel"):
        return True
    if getattr(model, "config", None) is not None or batch is None:
        return False
    ids = batch.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return False
    vocab = model_vocab(model)
    if vocab is None:
        return False
    try:
        with torch.no_grad():
            y = main_output(model(*batch.args, **batch.kwargs))
    except Exception:  # noqa: BLE001 - no logits to read: not a language model this test recognises
        return False
    return tuple(y.shape) == (*ids.shape, vocab) and y.is_floating_point()


def is_masked_lm(model: nn.Module) -> bool:
    """A masked language model: a Hugging Face ``*ForMaskedLM`` (BERT, RoBERTa, DistilBERT, ...)."""
    return type(model).__name__.endswith("ForMaskedLM")


DETERMINISM = 1e-6  # two dense runs on one held-out batch may differ by this much (relative to the output's size)


class PlanMeasurer(Protocol):
    """What tier 3 measures plans with: an :class:`Evaluator` (every held-out row for every plan) or a
    :class:`~auditor.calibration.measure.staged.StagedEvaluator` (a subsample first, more rows only near the
    tolerance)."""

    reference: float  # the dense model's value
    evaluations: int

    def measure(self, model: nn.Module) -> Measurement: ...

    @property
    def rows_read(self) -> int:
        """The held-out rows the last measurement read."""


class Evaluator:
    """Scores models on the calibration's held-out batches against the dense model's reference.

    On construction the dense model is checked once: its forward must repeat (two runs on the first held-out batch
    within ``DETERMINISM`` relative: dropout left on, or noise, would make every measured floor meaningless; skipped
    with ``repeats_checked``, where the caller checked it on the first of these rows), and the metric's own checks
    run (a user metric must fall when the model is cut down). What they warn about is in
    ``warnings``, for the caller to put on its calibration."""

    def __init__(self, dense: nn.Module, calibration: Calibration, metric: Metric | None = None,
                 repeats_checked: bool = False) -> None:
        self.metric = metric or Metric()
        if not calibration.holdout:
            raise AuditError(f"the calibration from {calibration.source} holds nothing out (--holdout 0): the "
                             f"measured numbers (tiers 2 and 3, the plan check) would come from the "
                             f"{calibration.fit_rows} rows the statistics were fitted on",
                             "Give a held-out share (--holdout 0.25) or a held-out file (--holdout FILE)")
        device = model_device(dense)
        self.batches = [b.to(device) for b in calibration.measure]
        self.evaluations = 0
        self.scorer: Scorer = self.metric.spec.scorer(self, dense)
        self.reference = self.scorer.reference
        self.warnings = list(self.scorer.warnings)
        if not repeats_checked:  # else the caller ran the check on these rows' dense model already
            self._check_repeats(dense)
        self.warnings += [w for w in self.scorer.check(dense, calibration.digest) if w not in self.warnings]

    def forward(self, model: nn.Module, b: Batch, i: int) -> object:
        return _forward(model, b, i)

    def _check_repeats(self, dense: nn.Module) -> None:
        if self.batches:
            kept = self.scorer.outputs
            check_repeats(dense, self.batches[0], kept[0] if kept else None, self.metric.spec.takes_function)

    def holds(self, value: float) -> bool:
        """Within the tolerance, in the metric's declared direction (the kind's judgement)."""
        return self.metric.holds(value, self.reference)

    def cost(self, value: float) -> float:
        """What a planner adds up for one measured value (the kind's: squared, or the drop in its units)."""
        return self.metric.cost(value, self.reference)

    def measure(self, model: nn.Module) -> Measurement:
        self.evaluations += 1
        return self.scorer.measure(model)

    @property
    def rows_read(self) -> int:
        """Every measurement reads every held-out row."""
        return sum(b.rows for b in self.batches)



REPEAT_CHUNK = 1 << 22  # values compared at once (float64): a large vocabulary's logits are never copied whole


def _repeat_gap(first: torch.Tensor, again: torch.Tensor) -> float:
    """The largest difference of two runs' outputs relative to the first's largest finite value (NaN where both are
    NaN, and the same infinity, count as equal; another shape: infinite), compared in float64 a chunk at a time; 0
    at once where the two are equal element for element in their own dtype, as a deterministic forward's are (one
    pass, no float64 copy: the 135M shape's 5 x 512 x 49,152 logits took 8 s in float64 chunks)."""
    if first.shape != again.shape:
        return math.inf
    if first.dtype == again.dtype and torch.equal(first, again):
        return 0.0
    xs, ys = first.reshape(-1), again.reshape(-1)
    worst = scale = 0.0
    for i in range(0, xs.numel(), REPEAT_CHUNK):
        x, y = xs[i:i + REPEAT_CHUNK].double(), ys[i:i + REPEAT_CHUNK].double()
        same = (torch.isnan(x) & torch.isnan(y)) | (x == y)  # the same infinity: equal
        worst = max(worst, float(torch.where(same, torch.zeros_like(x), (x - y).abs()).max()))
        scale = max(scale, float(torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).max()))
    return worst / scale if scale > 0 else worst


def check_repeats(dense: nn.Module, b: Batch, first: torch.Tensor | None = None, user_fn: bool = False) -> None:
    """Refuse a dense model whose forward does not repeat: two runs on held-out batch ``b`` (``first``: the dense
    output already computed on it) within ``DETERMINISM`` relative. ``user_fn``: a user metric scores the model, so
    a forward that returns no tensor is not an error."""
    with torch.no_grad():
        try:
            if first is None:
                first = main_output(_forward(dense, b, 0)).detach()
            again = main_output(_forward(dense, b, 0)).detach()
        except AuditError:
            if user_fn:
                return  # the model returns no tensor: the user's metric scores it, as it will every time
            raise
    diff = _repeat_gap(first, again)
    if not diff <= DETERMINISM:
        mode = "it is in training mode (dropout on)" if dense.training or any(
            m.training for m in dense.modules()) else "noise in the forward, or a nondeterministic kernel"
        raise AuditError(f"the model's forward does not repeat: two runs on held-out batch 0 differ by {diff:.3g} "
                         f"relative (at most {DETERMINISM:g} allowed), so no measured floor would mean anything; "
                         f"likely {mode}", "Put the model in eval mode (model.eval()) and take random noise out "
                         "of the forward before measuring")


def _forward(model: nn.Module, b: Batch, i: int) -> object:
    """The model on held-out batch ``i``; a batch the forward refuses is one line naming it."""
    try:
        return model(*b.args, **b.kwargs)
    except Exception as exc:  # noqa: BLE001 - a batch the forward refuses: one line naming it
        raise AuditError(f"held-out batch {i} does not fit {type(model).__name__}.forward: {first_line(exc)}",
                         "Give every batch the inputs and width the model takes") from None

__all__ = ["DEFAULT_TOLERANCE", "DETERMINISM", "Evaluator", "Measurement", "Metric", "NO_LABELS", "UserMetric",
           "check_repeats", "is_causal_lm", "is_masked_lm", "load_metric", "main_output"]
