"""``user``: a metric function ``fn(model, batches) -> float`` in its own units, against the dense model's value. It
declares its direction: higher-is-better by default (accuracy, negative loss), holding when it is at least the dense
model's value minus the tolerance; or ``Metric(fn, higher_is_better=False)`` (a loss), holding when it is at most the
dense model's value plus the tolerance. ``batches`` is a list of what the calibration source yielded: a tensor, a
tuple of positional inputs, or a dict of keyword inputs.

The function must fall when the model is cut down: the dense model is measured with every layer at rank 1; a metric
that moves the wrong way is refused, one that stays within the tolerance is a warning."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ...errors import AuditError
from ..data.inputs import Batch
from .base import Evaluating, Measurement, MetricKind, Scorer

_CHECKED: dict[tuple[object, str, float, bool], str] = {}  # (fn, digest, tolerance, direction) -> warning ("" none)


def _user_batch(b: Batch) -> object:
    if b.kwargs and not b.args:
        return dict(b.kwargs)
    if len(b.args) == 1 and not b.kwargs:
        return b.args[0]
    return b.args


def _rank1_(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut the weight of every module of a kind that says so (``LayerKind.cut_to_rank1``: Linear, convolution,
    transformers' Conv1D) to rank 1 in place (the leading singular pair by 30 power iterations, seeded); returns
    (parameter, original) pairs to restore exactly. A packed (quantized) module's weight is no tensor: left as is."""
    from ...kinds.registry import kinds as registered

    kinds = tuple(t for k in registered() if k.cut_to_rank1 for t in k.finds)
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


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_parameter_registration_hooks",
                 "_global_module_registration_hooks", "_global_buffer_registration_hooks")


def fingerprint(model: nn.Module, content: bool) -> dict[str, object]:
    """What a metric may not change, by name: every module (identity, training flag, hook counts), every parameter
    and buffer (identity, storage, shape, dtype, in-place version counter), torch's global module hooks; with
    ``content`` also each tensor's values (float64 sum and sum of squares: a write through ``.data``, which the
    version counter does not see). Cheap without ``content`` (no tensor is read)."""
    from torch.nn.modules import module as module_mod

    out: dict[str, object] = {f"torch's {g}": len(getattr(module_mod, g, {}) or {}) for g in _GLOBAL_HOOKS}
    for name, m in model.named_modules(remove_duplicate=False):
        hooks = tuple(len(getattr(m, h, None) or {}) for h in _HOOKS)
        out[f"module {name or '(root)'}"] = (id(m), m.training, hooks)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        for name, t in tensors:
            key = (id(t), t.data_ptr(), tuple(t.shape), t.dtype, t._version)
            if content and t.numel():
                d = t.detach().double()
                key += (float(d.sum()), float((d * d).sum()))
            out[name] = key
    return out


def _changed(before: dict[str, object], after: dict[str, object]) -> str:
    """The first thing named in one fingerprint and not the same in the other ("" none)."""
    for k in [*before, *(k for k in after if k not in before)]:
        if before.get(k) != after.get(k):
            return k
    return ""


def _user_line(exc: BaseException, fn: object) -> str:
    """``file:line`` of the metric's own frame nearest the error (else the deepest frame), "" without one."""
    code = getattr(fn, "__code__", None)
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    own = [f for f in frames if code is not None and f[0] == code.co_filename]
    pick = (own or frames or [None])[-1]
    return f"{pick[0]}:{pick[1]}" if pick is not None else ""


def repeatable(a: float, b: float, tolerance: float) -> bool:
    """Two calls on the same dense model agree: within a millionth of the value or a hundredth of the tolerance."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= max(1e-6 * max(abs(a), abs(b)), 0.01 * abs(tolerance), 1e-12)


class _Scorer(Scorer):
    def __init__(self, ev: Evaluating, dense: nn.Module) -> None:
        super().__init__(ev)
        self.batches = [_user_batch(b) for b in ev.batches]
        self.reference = self.call(dense, content=True)
        again = self.call(dense, content=True)
        if not repeatable(self.reference, again, float(ev.metric.tolerance)):
            raise AuditError(f"metric {ev.metric.label} is not repeatable: {self.reference:.6g}, then {again:.6g} "
                             "on the same dense model and batches, so no rank can be judged by it",
                             "Make the metric deterministic (seed any sampling; no dropout or random input)")

    def call(self, model: nn.Module, finite: bool = True, content: bool = False) -> float:
        """The metric on ``model``, refused (one line) when it raises, exits, returns no number, or leaves the
        model other than it found it (:func:`fingerprint`: weights, buffers, modules and hooks)."""
        label = self.ev.metric.label
        before = fingerprint(model, content)
        out = self._run(model)
        what = _changed(before, fingerprint(model, content))
        if what:
            raise AuditError(f"metric {label} changed the model it measures ({what}), so what it measured, and "
                             "any model written after it, would not be the model audited",
                             "A metric must only read the model: no in-place writes, new hooks or replaced "
                             "modules (work on copy.deepcopy(model) if it must change one)")
        try:
            v = float(out)
        except (TypeError, ValueError, OverflowError):
            raise AuditError(f"metric {label} returned {type(out).__name__}, not a number",
                             "Return a float, higher is better") from None
        if finite and not math.isfinite(v):
            raise AuditError(f"metric {label} returned {v}", "Return a finite float, higher is better")
        return v

    def _run(self, model: nn.Module) -> object:
        from ...sources.factory import run_user_code

        metric, where = self.ev.metric, [""]

        def call() -> object:
            try:
                with torch.no_grad():
                    return metric.fn(model, self.batches)  # type: ignore[misc]
            except Exception as exc:
                where[0] = _user_line(exc, metric.fn)
                raise

        try:
            return run_user_code(call, f"metric {metric.label}", "raised", "Fix the metric function",
                                  "Return a float from the metric instead of exiting")
        except AuditError as exc:
            if where[0]:
                raise AuditError(f"{exc.what} (at {where[0]})", exc.fix) from None
            raise

    def measure(self, model: nn.Module) -> Measurement:
        return self.judged(self.call(model))

    def check(self, dense: nn.Module, digest: str) -> list[str]:
        """The metric must fall when every layer is cut to rank 1 (cached per function, data and tolerance)."""
        metric = self.ev.metric
        fn: Callable[..., float] | None = metric.fn
        try:
            hash(fn)
        except TypeError:
            fn = id(fn)
        key = (fn, digest, float(metric.tolerance), bool(metric.higher_is_better))
        if key not in _CHECKED:
            saved = _rank1_(dense)
            if not saved:
                return []
            try:
                cut = self.call(dense, finite=False)
            finally:
                with torch.no_grad():
                    for w, original in saved:
                        w.copy_(original)
            _CHECKED[key] = self._moved(cut)
        return [_CHECKED[key]] if _CHECKED[key] else []

    def _moved(self, cut: float) -> str:
        """The warning for a metric ``cut`` on the rank-1 model ("" none); a refusal when it moved the wrong way."""
        metric = self.ev.metric
        ref, tol, label = self.reference, metric.tolerance, metric.label
        up = bool(metric.higher_is_better)
        worse, wrong = (ref - cut, cut - ref) if up else (cut - ref, ref - cut)  # how far it moved each way
        if not math.isfinite(cut):  # e.g. a perplexity overflowing on the cut model: it fell, or says nothing
            return ""
        if wrong > tol and up:
            raise AuditError(f"metric {label} rises when the model is cut down ({cut:.6g} with every layer at "
                             f"rank 1, {ref:.6g} dense): it looks lower-is-better (a loss or an error), and every "
                             "floor would come out at the smallest rank",
                             "--metric must be higher-is-better: return the negative (e.g. -loss), or declare "
                             "Metric(fn, higher_is_better=False)")
        if wrong > tol:
            raise AuditError(f"metric {label} falls when the model is cut down ({cut:.6g} with every layer at "
                             f"rank 1, {ref:.6g} dense), but it is declared lower-is-better: every floor would "
                             "come out at the smallest rank",
                             "Declare it higher-is-better (Metric(fn), the default), or return a loss")
        return ("" if worse > tol else
                f"metric {label} barely moves when the model is cut down ({cut:.6g} with every layer at "
                f"rank 1, {ref:.6g} dense, tolerance {tol:g}): floors measured with it come out at "
                "the smallest ranks; use a metric that sees the model's quality, or a smaller "
                "--tolerance")


class UserFunction(MetricKind):
    kind = "user"
    label = "metric"  # a function's own name, when it has one
    units = "the function's own"
    higher_is_better = None  # each metric declares it
    zero_on_dense = False
    takes_function = True

    def scorer(self, ev: Evaluating, dense: nn.Module) -> Scorer:
        return _Scorer(ev, dense)


KIND = UserFunction()
