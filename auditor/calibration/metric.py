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


DETERMINISM = 1e-6  # two dense runs on one held-out batch may differ by this much (relative to the output's size)
_CHECKED: dict[tuple[Any, str, float], str] = {}  # (metric fn, calibration digest, tolerance) -> warning ("" none)


def _rank1_(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut every Linear, convolution and transformers Conv1D weight of ``model`` to rank 1 in place (the leading
    singular pair by 30 power iterations, seeded); returns (parameter, original) pairs to restore exactly."""
    from ..layers import hf_conv1d_type

    conv1d = hf_conv1d_type()
    kinds = (nn.Linear, nn.modules.conv._ConvNd) + ((conv1d,) if conv1d is not None else ())
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()  # a weight tied between modules is cut (and saved) once
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if not isinstance(mod, kinds) or not isinstance(w, torch.Tensor) or w.dim() < 2 \
                    or not w.is_floating_point() or w.numel() == 0 or id(w) in seen:
                continue
            seen.add(id(w))
            saved.append((w, w.detach().clone()))
            a = w.detach().reshape(w.shape[0], -1).double()
            v = torch.randn(a.shape[1], generator=g, dtype=torch.float64).to(a.device)
            u = a @ v
            for _ in range(30):
                u = a @ v
                u = u / u.norm().clamp_min(1e-300)
                v = a.T @ u
                v = v / v.norm().clamp_min(1e-300)
            sigma = u @ a @ v
            w.copy_((sigma * torch.outer(u, v)).reshape(w.shape).to(w.dtype))
    return saved


class Evaluator:
    """Scores models on the calibration's held-out batches against the dense model's reference.

    On construction the dense model is checked once: its forward must repeat (two runs on the first held-out batch
    within ``DETERMINISM`` relative: dropout left on, or noise, would make every measured floor meaningless), and a
    user metric must fall when the model is cut down (the dense model against every layer at rank 1: a metric that
    rises is lower-is-better, refused; one that stays within the tolerance is a warning on the calibration)."""

    def __init__(self, dense: nn.Module, calibration: Calibration, metric: Metric | None = None) -> None:
        self.metric = metric or Metric()
        device = model_device(dense)
        self.batches = [b.to(device) for b in calibration.measure]
        self.user_batches = [_user_batch(b) for b in self.batches]
        self._ref: list[torch.Tensor] = []
        self.evaluations = 0
        if self.metric.fn is None:
            with torch.no_grad():
                self._ref = [main_output(self._forward(dense, b, i)).detach() for i, b in enumerate(self.batches)]
            self._ref_norm2 = sum(float(r.double().pow(2).sum()) for r in self._ref)
            self.reference = 0.0
        else:
            self.reference = self._user(dense)
        self._check_repeats(dense)
        if self.metric.fn is not None:
            self._check_direction(dense, calibration)

    def _forward(self, model: nn.Module, b: Batch, i: int) -> Any:
        try:
            return model(*b.args, **b.kwargs)
        except Exception as exc:  # noqa: BLE001 - a batch the forward refuses: one line naming it
            raise AuditError(f"held-out batch {i} does not fit {type(model).__name__}.forward: {first_line(exc)}",
                             "Give every batch the inputs and width the model takes") from None

    def _check_repeats(self, dense: nn.Module) -> None:
        if not self.batches:
            return
        b = self.batches[0]
        with torch.no_grad():
            try:
                first = self._ref[0] if self._ref else main_output(self._forward(dense, b, 0)).detach()
                again = main_output(self._forward(dense, b, 0)).detach()
            except AuditError:
                if self.metric.fn is not None:
                    return  # the model returns no tensor: the user's metric scores it, as it will every time
                raise
        if first.shape != again.shape:
            diff = math.inf
        else:
            x, y = first.double(), again.double()
            both_nan = torch.isnan(x) & torch.isnan(y)
            d = torch.where(both_nan, torch.zeros_like(x), (x - y).abs())
            scale = float(torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).max()) if x.numel() else 0.0
            worst = float(d.max()) if d.numel() else 0.0
            diff = worst / scale if scale > 0 else worst
        if not diff <= DETERMINISM:
            mode = "it is in training mode (dropout on)" if dense.training or any(
                m.training for m in dense.modules()) else "noise in the forward, or a nondeterministic kernel"
            raise AuditError(f"the model's forward does not repeat: two runs on held-out batch 0 differ by {diff:.3g} "
                             f"relative (at most {DETERMINISM:g} allowed), so no measured floor would mean anything; "
                             f"likely {mode}", "Put the model in eval mode (model.eval()) and take random noise out "
                             "of the forward before measuring")

    def _check_direction(self, dense: nn.Module, calibration: Calibration) -> None:
        fn: Any = self.metric.fn
        try:
            hash(fn)
        except TypeError:
            fn = id(fn)
        key = (fn, calibration.digest, float(self.metric.tolerance))
        if key not in _CHECKED:
            saved = _rank1_(dense)
            if not saved:
                return
            try:
                cut = self._user(dense, finite=False)
            finally:
                with torch.no_grad():
                    for w, original in saved:
                        w.copy_(original)
            ref, tol, label = self.reference, self.metric.tolerance, self.metric.label
            if not math.isfinite(cut):  # e.g. a perplexity overflowing on the cut model: it fell, or says nothing
                _CHECKED[key] = ""
            elif cut > ref + tol:
                raise AuditError(f"metric {label} rises when the model is cut down ({cut:.6g} with every layer at "
                                 f"rank 1, {ref:.6g} dense): it looks lower-is-better (a loss or an error), and every "
                                 "floor would come out at the smallest rank",
                                 "--metric must be higher-is-better: return the negative (e.g. -loss)")
            else:
                _CHECKED[key] = ("" if cut < ref - tol else
                                 f"metric {label} barely moves when the model is cut down ({cut:.6g} with every layer at "
                                 f"rank 1, {ref:.6g} dense, tolerance {tol:g}): floors measured with it come out at "
                                 "the smallest ranks; use a metric that sees the model's quality, or a smaller "
                                 "--tolerance")
        if _CHECKED[key] and _CHECKED[key] not in calibration.warnings:
            calibration.warnings.append(_CHECKED[key])

    def _user(self, model: nn.Module, finite: bool = True) -> float:
        from ..load import _run_user_code

        label = self.metric.label

        def call() -> Any:
            with torch.no_grad():
                return self.metric.fn(model, self.user_batches)  # type: ignore[misc]

        out = _run_user_code(call, f"metric {label}", "raised", "Fix the metric function",
                             "Return a float from the metric instead of exiting")
        try:
            v = float(out)
        except (TypeError, ValueError, OverflowError):
            raise AuditError(f"metric {label} returned {type(out).__name__}, not a number",
                             "Return a float, higher is better") from None
        if finite and not math.isfinite(v):
            raise AuditError(f"metric {label} returned {v}", "Return a finite float, higher is better")
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
            for i, (b, ref) in enumerate(zip(self.batches, self._ref)):
                y = main_output(self._forward(model, b, i))
                err2 += float((y.double() - ref.double()).pow(2).sum())
                if ref.dim() >= 1 and ref.shape[-1] >= 2:
                    agree += int((y.argmax(-1) == ref.argmax(-1)).sum())
                    rows += ref[..., 0].numel()
        value = math.sqrt(err2 / self._ref_norm2) if self._ref_norm2 > 0 else math.sqrt(err2)
        return Measurement(value, self.holds(value), agree / rows if rows else None)
