"""The model-level metric: how far a truncated model is from the dense one on the held-out batches.

By default the relative error of the model's outputs against the dense model's, ||y - y_dense||_F / ||y_dense||_F
over every held-out output (logits for models that return them), with top-1 agreement shown beside it; it holds when
it is at most the tolerance. A user metric ``fn(model, batches) -> float`` is higher-is-better (accuracy, negative
loss); it holds when it is at least the dense model's value minus the tolerance, in the metric's own units. ``batches``
is a list of what the calibration source yielded: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import AuditError, first_line
from .inputs import Batch, Calibration, _import_fn, model_device

UserMetric = Callable[[nn.Module, list[Any]], float]
DEFAULT_TOLERANCE = 0.01


def main_output(out: Any) -> torch.Tensor:
    """The tensor a metric compares: the output itself, ``.logits``, or the first tensor of a tuple or dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    raise AuditError(f"the model returned {type(out).__name__}, with no tensor to compare",
                     "Give --metric module:fn that scores the model")


def load_metric(spec: str) -> UserMetric:
    """``file.py:fn`` or ``module:fn`` for --metric."""
    if ":" not in spec:
        raise AuditError(f"--metric {spec!r} does not name a function", "Use --metric file.py:fn or module:fn")
    return _import_fn(spec)


@dataclass
class Measurement:
    """One metric value, whether it holds, and (default metric) top-1 agreement with the dense model."""

    value: float
    ok: bool
    top1: float | None = None


@dataclass
class Metric:
    """What is measured and how much may be lost."""

    fn: UserMetric | None = None  # None: relative output error against the dense model
    tolerance: float = DEFAULT_TOLERANCE
    name: str = ""

    @property
    def higher_is_better(self) -> bool:
        return self.fn is not None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return getattr(self.fn, "__name__", "metric") if self.fn is not None else "relative output error"


def _user_batch(b: Batch) -> Any:
    if b.kwargs and not b.args:
        return dict(b.kwargs)
    if len(b.args) == 1 and not b.kwargs:
        return b.args[0]
    return b.args


class Evaluator:
    """Scores models on the calibration's held-out batches against the dense model's reference."""

    def __init__(self, dense: nn.Module, calibration: Calibration, metric: Metric | None = None) -> None:
        self.metric = metric or Metric()
        device = model_device(dense)
        self.batches = [b.to(device) for b in calibration.measure]
        self.user_batches = [_user_batch(b) for b in self.batches]
        self._ref: list[torch.Tensor] = []
        self.evaluations = 0
        if self.metric.fn is None:
            with torch.no_grad():
                self._ref = [main_output(dense(*b.args, **b.kwargs)).detach() for b in self.batches]
            self._ref_norm2 = sum(float(r.double().pow(2).sum()) for r in self._ref)
            self.reference = 0.0
        else:
            self.reference = self._user(dense)

    def _user(self, model: nn.Module) -> float:
        try:
            with torch.no_grad():
                v = float(self.metric.fn(model, self.user_batches))  # type: ignore[misc]
        except AuditError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's metric failed
            raise AuditError(f"metric {self.metric.label} raised {first_line(exc)}", "Fix the metric function") from None
        if not math.isfinite(v):
            raise AuditError(f"metric {self.metric.label} returned {v}", "Return a finite float, higher is better")
        return v

    def holds(self, value: float) -> bool:
        if self.metric.higher_is_better:
            return value >= self.reference - self.metric.tolerance
        return value <= self.metric.tolerance

    def cost(self, value: float) -> float:
        """What a planner adds up: squared relative error (errors combine roughly in quadrature), or the drop of a
        user metric below the dense value."""
        if self.metric.higher_is_better:
            return max(0.0, self.reference - value)
        return value * value

    def measure(self, model: nn.Module) -> Measurement:
        self.evaluations += 1
        if self.metric.fn is not None:
            v = self._user(model)
            return Measurement(v, self.holds(v))
        err2 = 0.0
        agree = rows = 0
        with torch.no_grad():
            for b, ref in zip(self.batches, self._ref):
                y = main_output(model(*b.args, **b.kwargs))
                err2 += float((y.double() - ref.double()).pow(2).sum())
                if ref.dim() >= 1 and ref.shape[-1] >= 2:
                    agree += int((y.argmax(-1) == ref.argmax(-1)).sum())
                    rows += ref[..., 0].numel()
        value = math.sqrt(err2 / self._ref_norm2) if self._ref_norm2 > 0 else math.sqrt(err2)
        return Measurement(value, self.holds(value), agree / rows if rows else None)
