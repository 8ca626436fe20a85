"""What one metric is: :class:`MetricKind`, the object that holds everything about a kind of metric (its name and
label, its direction, how a value is judged against the tolerance and what the allocation adds up, its tier-1
target, what scores it), and the per-audit objects it makes: a :class:`Scorer` (the dense reference, measured once,
and every later measurement) and, for a metric summed row by row, a :class:`RowScorer` (the verification interval).

A metric module subclasses :class:`MetricKind` and hands an instance to :func:`auditor.calibration.metrics.register`
(docs/design.md, "Adding a metric"); nothing outside the metric modules asks which metric it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from torch import nn

if TYPE_CHECKING:
    import torch

    from ..data.inputs import Batch
    from .chunks import Scored

TIER1_TARGET = 0.01  # the layer-output error tier 1 ranks for when the metric is not in those units


@dataclass
class Measurement:
    """One metric value, whether it holds, top-1 agreement with the dense model (built-in metrics), and for
    perplexity the model's perplexity itself (``value`` is its relative increase)."""

    value: float
    ok: bool
    top1: float | None = None
    absolute: float | None = None


class Evaluating(Protocol):
    """What a scorer reads from the evaluator it measures through (:class:`auditor.calibration.measure.metric.Evaluator`):
    the held-out batches on the model's device, a forward that names a batch the model refuses, the configured metric
    (its function, tolerance and direction), and ``holds``."""

    batches: list[Batch]
    metric: Any

    def forward(self, model: nn.Module, b: Batch, i: int) -> object: ...

    def holds(self, value: float) -> bool: ...


class Scorer:
    """One metric on one evaluator's held-out batches: ``reference`` (the dense model's value) is measured when it
    is made; ``warnings`` are what the reference taught (the evaluator returns them to its caller)."""

    reference: float = 0.0
    outputs: list[object] = []  # the dense model's outputs, when the scorer keeps them (the repeat check reuses one)

    def __init__(self, ev: Evaluating) -> None:
        self.ev = ev
        self.warnings: list[str] = []

    def measure(self, model: nn.Module) -> Measurement:
        raise NotImplementedError

    def check(self, dense: nn.Module, digest: str) -> list[str]:
        """Checks of the dense model after its forward was found to repeat; warnings to return."""
        return []

    def judged(self, value: float, top1: float | None = None, absolute: float | None = None) -> Measurement:
        return Measurement(value, self.ev.holds(value), top1, absolute)


class RowScorer:
    """A metric summed row by row on the verification rows: ``sums(model)`` per-row arrays, ``value(sums, idx)``
    the metric from the rows ``idx`` (a bootstrap draw); ``baseline`` the dense value the report states beside it
    (None: the metric is zero on the dense model and needs none)."""

    reference: float = 0.0
    baseline: float | None = None
    last_top1: tuple[np.ndarray, np.ndarray] | None = None  # per row (agreeing, counted) positions of the last
    #                                                          model measured, where the metric counts them

    @property
    def first_output(self) -> object:
        """The dense model's output on the first batch where the scorer keeps it (None: it does not)."""
        return None

    def dense_sums(self) -> tuple[np.ndarray, ...] | None:
        """The dense model's own per-row sums where the metric has a dense value of its own (None: zero there)."""
        return None

    def absolute(self, sums: tuple[np.ndarray, ...]) -> float | None:
        """The measured model's own value from ``sums`` where the metric reports one (e.g. its perplexity)."""
        return None

    def sums(self, model: nn.Module) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def value(self, sums: tuple[np.ndarray, ...], idx: "slice | np.ndarray" = slice(None)) -> float:
        raise NotImplementedError


class MetricKind:
    """Everything about one kind of metric. Two families share their judging:

    - ``zero_on_dense`` (the built-ins so far): a distance from the dense model, zero on it, lower is better; it
      holds at most the tolerance, and the allocation adds up squared values (errors combine roughly in quadrature);
    - otherwise the metric is in its own units against the dense model's value (``reference``): it holds at most
      the tolerance worse than that value in its direction, and the allocation adds up how far it moved the wrong
      way.

    ``higher_is_better`` None: each configured metric declares it (a user function, higher by default)."""

    kind: str = ""  # the name ``Metric.kind`` holds
    names: tuple[str, ...] = ()  # what --metric NAME accepts
    label: str = ""  # the report's words for it
    units: str = ""  # what its values are, in words
    increase_of: str = ""  # its values are the relative increase of this dense quantity (the reports state both)
    higher_is_better: bool | None = False
    zero_on_dense: bool = True
    takes_function: bool = False  # configured with the user's ``fn(model, batches)``
    layer_error_units: bool = False  # tier 1's layer-output errors predict it in its own units
    gradient: str = ""  # the output-gradient sensitivity it takes: "likelihood", "output", "embedding", or "" (none)
    predicted_words: str = "model errors"  # its gradient-predicted single-layer costs, in the reports' words
    pools: bool = False  # reads a sentence encoder's pooling (``Metric.pooling``: sentence-transformers' modes)
    verified_by_rows: bool = False  # a row scorer: the held-out rows cut into search and verification parts, the
    # interval's upper end judged against the tolerance (so only for a zero_on_dense metric)

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        raise NotImplementedError(f"metric kind {self.kind!r} has no scorer")

    def row_scorer(self, dense: nn.Module, batches: list[Batch], like: RowScorer | None = None) -> RowScorer:
        """Per-row sums on ``batches``; ``like``: a scorer of the same dense model whose dense state it may share."""
        raise NotImplementedError(f"metric kind {self.kind!r} is not summed row by row")

    def bound(self, pooling: tuple[str, ...]) -> "MetricKind":
        """This kind as a configured metric uses it: with ``pooling`` (``Metric.pooling``) for a kind that ``pools``;
        a kind that does not takes none (ValueError)."""
        if pooling:
            raise ValueError(f"the {self.kind!r} metric pools nothing; pooling {tuple(pooling)!r} is for a metric that "
                             "pools (pooled-cosine)")
        return self

    def embedding(self, out: object, b: Batch) -> torch.Tensor:
        """(rows, features) unit-length row embeddings of a model's output and its batch, a zero row for a row that
        does not count: ``gradient == "embedding"`` kinds (their cost is the mean of ||de||^2 / 2 per row)."""
        raise NotImplementedError(f"metric kind {self.kind!r} has no row embedding")

    def scored_positions(self, y: torch.Tensor, b: Batch) -> Scored:
        """The scored positions of ``y`` and their targets, read a chunk at a time: ``gradient == "likelihood"``
        kinds."""
        raise NotImplementedError(f"metric kind {self.kind!r} scores no likelihood")

    def direction(self, declared: bool | None) -> bool:
        """The direction a configured metric has: the kind's own, or the declared one where the kind leaves it to
        each metric (True when undeclared). A built-in direction cannot be declared otherwise."""
        own = self.higher_is_better
        if declared is None:
            return True if own is None else own
        if not isinstance(declared, bool):
            raise ValueError(f"higher_is_better must be True or False, not {declared!r}")
        if own is not None and declared != own:
            raise ValueError(f"the {self.kind!r} metric is {'higher' if own else 'lower'}-is-better; it cannot be "
                             "declared otherwise")
        return declared

    def better(self) -> str:
        """Which way is better, in words: "higher" or "lower", or "declared by the metric (higher by default)" where
        the kind leaves the direction to each configured metric."""
        if self.higher_is_better is None:
            return "declared by the metric (higher by default)"
        return "higher" if self.higher_is_better else "lower"

    def holds(self, value: float, reference: float, tolerance: float, higher: bool) -> bool:
        """Within the tolerance, in the metric's direction."""
        if self.zero_on_dense:
            return value <= tolerance
        if higher:
            return value >= reference - tolerance
        return value <= reference + tolerance

    def used(self, value: float, reference: float, higher: bool) -> float:
        """How much of the tolerance a value uses: the value itself, or how far it moved from the dense value."""
        if self.zero_on_dense:
            return value
        return reference - value if higher else value - reference

    def cost(self, value: float, reference: float, higher: bool) -> float:
        """What a planner adds up for one measured value: the squared value (relative errors, the perplexity
        increase and the KL combine roughly in quadrature), or how far it moved the wrong way, in its units."""
        if self.zero_on_dense:
            return value * value
        return max(0.0, self.used(value, reference, higher))

    def tolerance_cost(self, tolerance: float) -> float:
        """The cost of a value right at the tolerance (what the allocation may add up)."""
        return tolerance * tolerance if self.zero_on_dense else tolerance

    def tier1_target(self, tolerance: float) -> float:
        """The layer-output error tier 1 ranks for: the tolerance where the metric is in those units, else 1%."""
        return tolerance if self.layer_error_units else TIER1_TARGET

    def limit(self, reference: float, tolerance: float, higher: bool) -> float:
        """The value at which the metric stops holding (what the reports draw as the tolerance line): the tolerance
        itself, or the dense value moved by the tolerance the wrong way."""
        if self.zero_on_dense:
            return tolerance
        return reference - tolerance if higher else reference + tolerance

    def display(self, higher: bool) -> str:
        """How the reports write its values: "percent" for a fraction every report writes as a percentage (a
        relative increase, or a metric in the layer-output error's units), else "number" (its own units: KL in
        nats, a user metric)."""
        return "percent" if not higher and (self.increase_of or self.layer_error_units) else "number"

    def reportable(self, higher: bool) -> bool:
        """The reports read a metric against the dense value as higher-is-better."""
        return self.zero_on_dense or higher
