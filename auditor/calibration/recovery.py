"""Recovery: a short distillation of a factorized model toward the dense one, measured on the held-out rows.

``recover(factorized, dense, calibration, steps=...)`` trains ``factorized`` in place on the calibration's *fit*
batches only, with the dense model's outputs as targets: the KL divergence KL(p_dense || p_factorized) of the output
distributions (softmax over the last dimension) when the model returns logits, the mean squared output error
otherwise. The held-out batches are only ever run under ``torch.no_grad`` to measure: the same :class:`Evaluator`
and metric the audit uses (relative output error against the dense model by default, or a user metric), plus the
distillation loss itself, before training, every ``eval_every`` steps and at the end.

- AdamW (no weight decay), linear warm-up over the first ``warmup`` steps (default 10%, at most 100), then linear
  decay to zero at ``steps``; the gradient norm is clipped at ``clip``.
- ``trainable="factors"``: only the two factor weights of each factorized layer (``layer.0.weight`` and
  ``layer.1.weight``); every other parameter, biases included, keeps its exact bits. ``"all"``: every floating-point
  parameter.
- bf16/fp16 parameters are trained through fp32 master copies (the model keeps its dtype; each step the masters are
  rounded into it); fp16 also gets a dynamic loss scale (a step whose gradients overflow is skipped and the scale
  halved).
- Deterministic under ``seed``: ``torch.manual_seed(seed)`` and a batch order drawn from a generator seeded with it
  (a fresh permutation of the fit batches each pass).
- The model stays in the mode it is in (eval for models the tool loads: dropout off, batch-norm statistics frozen).
- At every measurement the distillation loss over all fit rows is computed; the state with the lowest one (the
  factorized initialisation included, step 0) is what ``recover`` leaves in the model. Ctrl-C (KeyboardInterrupt)
  stops the run and keeps that best state; a loss or gradient that becomes NaN or infinite stops it too, saying at
  which step. ``Recovery.stopped`` says why a run ended early.

Bad settings raise :class:`AuditError` (one line): steps not a positive integer, a learning rate that is not a
positive finite number, an unknown ``trainable`` or ``objective``, a model with no factorized layer, a calibration
with no fit or no held-out batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch
from torch import nn

from .. import kinds
from .._env import scoped
from ..errors import AuditError
from ..options import DEFAULT_LR, OBJECTIVES, TRAINABLE, RecoveryOptions, positive_finite, positive_int
from .data.inputs import Batch, Calibration, model_device
from .measure.metric import Evaluator, Metric, main_output
from .references import evaluator_of
from .session import CalibrationSession

CACHE_BYTES = 256 << 20  # dense outputs on the fit rows are kept in memory up to this size, else recomputed
LOW = (torch.float16, torch.bfloat16)

Progress = Callable[[int, int, float], None]  # (steps done, steps, running loss)


@dataclass
class RecoveryPoint:
    """The model measured after ``step`` training steps (0: the factorized initialisation)."""

    step: int
    metric: float  # the held-out metric (relative output error, or the user metric)
    ok: bool  # whether it holds the tolerance
    top1: float | None  # top-1 agreement with the dense model on the held-out rows (default metric)
    loss: float  # the distillation loss on the held-out rows
    fit_loss: float  # the distillation loss on all fit rows (what picks the state kept)


@dataclass
class Recovery:
    """What a recovery did and measured; plain data (``to_dict`` for plan.json)."""

    steps: int  # asked for
    done: int  # steps taken
    lr: float
    trainable: str
    trainable_params: int
    objective: str  # "kl" | "mse"
    seed: int
    warmup: int
    clip: float
    master_fp32: bool
    metric: str
    higher_is_better: bool
    tolerance: float
    reference: float  # the dense model's metric value (0 for the relative output error)
    before: RecoveryPoint
    after: RecoveryPoint  # the state kept (``kept_step``)
    kept_step: int
    points: list[RecoveryPoint] = field(default_factory=list)  # every measurement, step 0 first
    stopped: str | None = None  # why the run ended before ``steps``, or None
    fit_rows: int = 0
    fit_batches: int = 0
    holdout_rows: int = 0
    skipped_steps: int = 0  # fp16 steps skipped for overflowing gradients
    seconds: float = 0.0  # training steps only (measurements excluded)
    rows_trained: int = 0  # fit rows the steps trained on (every batch stepped, repeats counted)
    tokens_trained: int = 0  # output positions the steps trained on (tokens of a language model, else examples)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.done if self.done else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["seconds_per_step"] = self.seconds_per_step
        return _finite(d)


def _finite(x: object) -> object:
    """JSON-safe: NaN and infinities become None (plan.json is read strictly)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def factor_modules(factorized: nn.Module, dense: nn.Module) -> dict[str, nn.Sequential]:
    """The factorized layers: module paths where ``dense`` has a weighted layer and ``factorized`` the two-module
    ``nn.Sequential`` that :func:`auditor.surgery.apply_plan` puts there."""
    dense_mods = dict(dense.named_modules())
    out: dict[str, nn.Sequential] = {}
    for path, mod in factorized.named_modules():
        if path and kinds.is_factor_pair(mod, dense_mods.get(path)):
            out[path] = mod
    return out


@dataclass(frozen=True, kw_only=True)
class RecoverySettings(RecoveryOptions):
    """How a recovery trains and when it measures (see the module docstring): the audit's recovery options
    (:class:`~auditor.options.RecoveryOptions`: steps, lr, trainable, objective, seed) and when to measure, the
    warm-up and the clip; :meth:`check` refuses bad values with one line each, before any model is looked at."""

    eval_every: int | None = None  # measure every this many steps (and at the end)
    eval_at: Sequence[int] = ()  # and at these steps
    warmup: int | None = None  # warm-up steps (default 10% of the steps, 1..100)
    clip: float = 1.0  # the gradient norm's clip

    def check(self) -> None:
        super().check()
        if self.eval_every is not None:
            positive_int(self.eval_every, "recovery eval_every", "Give a positive number of steps between measurements")
        w = self.warmup
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise AuditError(f"recovery warm-up {w!r} is not a non-negative integer", "Give e.g. warmup=10")
        if not positive_finite(self.clip):
            raise AuditError(f"recovery gradient clip {self.clip!r} is not a positive finite number", "Give e.g. clip=1.0")

    def check_eval_at(self) -> None:
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.eval_at):
            raise AuditError(f"recovery eval_at {sorted(set(self.eval_at), key=str)!r} holds a step that is not a "
                             "positive integer", "Give the steps to measure at as positive integers")

    @property
    def warm(self) -> int:
        """The warm-up steps taken: ``warmup``, else 10% of the steps (at least 1, at most 100); never past steps."""
        return min(100, max(1, round(0.1 * self.steps))) if self.warmup is None else min(int(self.warmup), self.steps)

    def measures_at(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0) or step in self.eval_at or step == self.steps


def _is_logits(out: object, y: torch.Tensor) -> bool:
    """Whether the main output is a distribution's logits: named ``logits``, or a float tensor of two or more
    dimensions whose last one has two or more entries (classes, vocabulary)."""
    if not y.is_floating_point() or y.dim() < 1 or y.shape[-1] < 2:
        return False
    named = isinstance(getattr(out, "logits", None), torch.Tensor) or (
        isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor))
    return named or y.dim() >= 2


def distill_loss(y: torch.Tensor, ref: torch.Tensor, objective: str) -> torch.Tensor:
    """KL(p_ref || p_y) over the last dimension, averaged over every other position ("kl"), or the mean squared
    error ("mse"); computed in float32 whatever the model's dtype."""
    y, ref = y.float(), ref.float()
    if objective == "kl":
        logp = y.log_softmax(-1)
        logq = ref.log_softmax(-1)
        return nn.functional.kl_div(logp, logq, log_target=True, reduction="none").sum(-1).mean()
    return (y - ref).pow(2).mean()


class _Targets:
    """The dense model's outputs on the fit batches: cached when they fit in CACHE_BYTES, else recomputed."""

    def __init__(self, dense: nn.Module, batches: list[Batch]) -> None:
        self.dense = dense
        self.batches = batches
        self.cache: list[torch.Tensor] | None = None
        first = self._run(0)
        if first.numel() * first.element_size() * len(batches) <= CACHE_BYTES:
            self.cache = [first] + [self._run(i) for i in range(1, len(batches))]

    def _run(self, i: int) -> torch.Tensor:
        b = self.batches[i]
        with torch.no_grad():
            return main_output(self.dense(*b.args, **b.kwargs)).detach()

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.cache[i] if self.cache is not None else self._run(i)


def _key(b: Batch) -> int | None:
    ts = b.tensors()
    return id(ts[0][1]) if ts else None


class _Replay(nn.Module):
    """Returns the output recorded for a batch (matched by its first input tensor), or runs the model."""

    def __init__(self, model: nn.Module, outs: dict[int, object]) -> None:
        super().__init__()
        self.model = model
        self.outs = outs

    def forward(self, *args: object, **kwargs: object) -> object:
        key = _key(Batch(args, kwargs))
        return self.outs[key] if key in self.outs else self.model(*args, **kwargs)


def _schedule(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor for step ``step`` (1-based): linear warm-up, then linear decay to 0 at ``steps``."""
    if warmup and step <= warmup:
        return step / warmup
    return max(0.0, (steps - step + 1) / max(1, steps - warmup))


STEPPED, SKIPPED, STOP = "stepped", "skipped", "stop"  # what one training step did


def _calibration_of(calibration: object, dense: nn.Module,
                    metric: Metric | None) -> tuple[Calibration, CalibrationSession | None]:
    """The calibration to train and measure on, and the session it came in (whose evaluator is reused: the dense
    reference is not measured again), refused with one line when it has no fit or no held-out rows."""
    session = None
    if isinstance(calibration, CalibrationSession):
        session = CalibrationSession.of(calibration, dense, metric=metric)
        calibration = session.calibration
    if not isinstance(calibration, Calibration):
        raise AuditError(f"recovery calibration is a {type(calibration).__name__}",
                         "Pass a Calibration (auditor.calibration.load_calibration)")
    if not calibration.fit:
        raise AuditError("the calibration has no fit batches to train on", "Give more calibration rows")
    if not calibration.holdout:
        raise AuditError("the calibration holds nothing out: recovery would be measured on the rows it trains on",
                         "Give a held-out share (--holdout 0.25) or a held-out file")
    return calibration, session


def _factors_of(factorized: nn.Module, dense: nn.Module) -> dict[str, nn.Sequential]:
    if factorized is dense:
        raise AuditError("recover() was given the dense model as the factorized one",
                         "Pass factorize(model, plan) and the original model")
    factors = factor_modules(factorized, dense)
    if not factors:
        raise AuditError("the model has no factorized layer to recover",
                         "Factorize at least one layer (auditor.factorize(model, plan)) before recovering")
    return factors


@dataclass
class _Measure:
    """What recovery measures the factorized model with: the fit batches (and the dense outputs on them, the
    targets), the held-out batches of the evaluator (and the dense outputs there), the objective."""

    factorized: nn.Module
    fit: list[Batch]
    targets: _Targets
    ev: Evaluator
    held_targets: _Targets
    objective: str

    @property
    def held(self) -> list[Batch]:
        return self.ev.batches  # the held-out batches (calibration.measure), on the model's device

    @property
    def rows(self) -> list[int]:
        return [b.rows for b in self.fit]

    def loss(self, b: Batch, target: torch.Tensor) -> torch.Tensor:
        return distill_loss(main_output(self.factorized(*b.args, **b.kwargs)), target, self.objective)

    def fit_loss(self) -> float:
        total = 0.0
        rows = self.rows
        with torch.no_grad():
            for i, b in enumerate(self.fit):
                total += float(self.loss(b, self.targets[i])) * rows[i]
        return total / sum(rows)

    def point(self, step: int) -> RecoveryPoint:
        """One pass over the held-out batches gives the distillation loss and, for the default metric, the
        Evaluator's measurement (it is handed the recorded outputs); a user metric runs the model itself."""
        outs: dict[int, object] = {}
        total = 0.0
        ev, held = self.ev, self.held
        with torch.no_grad():
            for i, b in enumerate(held):
                out = self.factorized(*b.args, **b.kwargs)
                total += float(distill_loss(main_output(out), self.held_targets[i], self.objective)) * b.rows
                key = _key(ev.batches[i]) if ev.metric.fn is None else None
                if key is not None:
                    outs[key] = out
        m = ev.measure(_Replay(self.factorized, outs) if ev.metric.fn is None else self.factorized)
        return RecoveryPoint(step, m.value, m.ok, m.top1, total / sum(b.rows for b in held), self.fit_loss())


def _measure(factorized: nn.Module, dense: nn.Module, calibration: Calibration, ev: Evaluator,
             objective: str) -> _Measure:
    """The batches and targets on the model's device; ``objective`` "auto" becomes "kl" for logits, else "mse". The
    factorized model's output must have the dense model's shape. ``ev``: the dense reference the held-out metric is
    measured against."""
    fit = [b.to(model_device(factorized)) for b in calibration.fit]
    targets = _Targets(dense, fit)
    held_targets = _Targets(dense, ev.batches)
    with torch.no_grad():
        probe = factorized(*fit[0].args, **fit[0].kwargs)
    y0 = main_output(probe)
    if objective == "auto":
        objective = "kl" if _is_logits(probe, y0) else "mse"
    if tuple(y0.shape) != tuple(targets[0].shape):
        raise AuditError(f"the factorized model's output {tuple(y0.shape)} differs in shape from the dense model's "
                         f"{tuple(targets[0].shape)}", "Pass the factorized model and the model it was made from")
    return _Measure(factorized, fit, targets, ev, held_targets, objective)


class _Optimizer:
    """AdamW over the trained parameters, through fp32 master copies when they are bf16/fp16, with a dynamic loss
    scale for fp16 (a step whose gradients overflow is skipped and the scale halved; 200 good steps double it)."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params = params
        self.master = any(p.dtype in LOW for p in params)
        self.fp16 = any(p.dtype == torch.float16 for p in params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in params] if self.master else params
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.0)
        self.scale = 2.0 ** 16 if self.fp16 else 1.0
        self.good = self.skipped = self.bad_in_a_row = 0

    def zero_grad(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=True)

    def finite_gradients(self) -> bool:
        """The gradients unscaled into the masters; whether they are all finite."""
        if self.master:
            for p, mp in zip(self.params, self.masters):
                mp.grad = None if p.grad is None else p.grad.float() / self.scale
        return all(bool(torch.isfinite(mp.grad).all()) for mp in self.masters if mp.grad is not None)

    def overflowed(self) -> bool:
        """An fp16 overflow: the step is skipped and the scale halved; True while fewer than 30 came in a row."""
        self.skipped += 1
        self.bad_in_a_row += 1
        self.scale /= 2
        self.good = 0
        return self.bad_in_a_row < 30

    def step(self, clip: float) -> None:
        self.bad_in_a_row = 0
        torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self.opt.step()
        if self.master:
            with torch.no_grad():
                for p, mp in zip(self.params, self.masters):
                    p.copy_(mp)
        if self.fp16:
            self.good += 1
            if self.good >= 200 and self.scale < 2.0 ** 24:
                self.scale *= 2
                self.good = 0


@dataclass
class _Progress:
    """A run's counters, the best state so far (lowest fit loss) and why it stopped."""

    points: list[RecoveryPoint]
    best_state: list[torch.Tensor]
    best_step: int = 0
    done: int = 0
    seconds: float = 0.0
    rows_trained: int = 0
    tokens_trained: int = 0
    running: float | None = None
    stopped: str | None = None

    @property
    def best_loss(self) -> float:
        return next(p for p in self.points if p.step == self.best_step).fit_loss


def _snapshot(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _train_step(run: _Measure, opt: _Optimizer, settings: RecoverySettings, step: int, i: int,
                state: _Progress) -> str:
    """One step on fit batch ``i``: "stepped", "skipped" (an fp16 overflow) or "stop" (``state.stopped`` says
    why)."""
    lr = float(settings.lr)
    b, tgt = run.fit[i], run.targets[i]
    opt.zero_grad(lr * _schedule(step, settings.steps, settings.warm))
    with torch.enable_grad():
        loss = run.loss(b, tgt)
        value = float(loss.detach())
        if not math.isfinite(value):
            state.stopped = f"the loss became {value} at step {step} (lr {lr:g})"
            return STOP
        (loss * opt.scale).backward()
    if not opt.finite_gradients():
        if not opt.fp16:
            state.stopped = f"the gradient became NaN or infinite at step {step} (lr {lr:g})"
            return STOP
        if not opt.overflowed():  # an overflow of the loss scale: the step is skipped
            state.stopped = f"the gradients overflowed fp16 30 steps in a row, up to step {step}"
            return STOP
        state.done = step
        return SKIPPED
    state.rows_trained += b.rows
    state.tokens_trained += tgt.numel() // tgt.shape[-1] if tgt.dim() >= 2 else b.rows
    opt.step(settings.clip)
    state.done = step
    state.running = value if state.running is None else 0.9 * state.running + 0.1 * value
    return STEPPED


def _measured(run: _Measure, params: list[nn.Parameter], settings: RecoverySettings, step: int,
              state: _Progress) -> bool:
    """A measurement at ``step``: kept as the best state when its fit loss is the lowest; False when it is not
    finite (``state.stopped`` says so)."""
    pt = run.point(step)
    state.points.append(pt)
    if not math.isfinite(pt.fit_loss):
        state.stopped = f"the fit loss became {pt.fit_loss} at step {step} (lr {float(settings.lr):g})"
        return False
    if pt.fit_loss < state.best_loss:
        state.best_step, state.best_state = step, _snapshot(params)
    return True


def _train(run: _Measure, opt: _Optimizer, settings: RecoverySettings, state: _Progress,
           progress: Progress | None) -> None:
    """The steps, each on the next fit batch of a fresh permutation per pass (seeded), timed without the
    measurements; stops early as ``state.stopped`` says."""
    gen = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    torch.manual_seed(settings.seed)
    for step in range(1, settings.steps + 1):
        t0 = time.perf_counter()
        if not order:
            order = torch.randperm(len(run.fit), generator=gen).tolist()
        i = order.pop(0)
        outcome = _train_step(run, opt, settings, step, i, state)
        if outcome == STOP:
            return
        state.seconds += time.perf_counter() - t0
        if outcome == SKIPPED:
            continue  # an fp16 overflow: no progress report, no measurement
        if progress is not None:
            progress(step, settings.steps, state.running)
        if settings.measures_at(step) and not _measured(run, opt.params, settings, step, state):
            return


def _trained_params(factorized: nn.Module, factors: dict[str, nn.Sequential], trainable: str) -> list[nn.Parameter]:
    if trainable == "factors":
        chosen = {id(m.weight): m.weight for mod in factors.values() for m in mod}
    else:
        chosen = {id(p): p for p in factorized.parameters() if p.is_floating_point()}
    return list(chosen.values())


def _run(run: _Measure, dense: nn.Module, params: list[nn.Parameter], settings: RecoverySettings,
         progress: Progress | None) -> tuple[_Progress, _Optimizer]:
    """Measure at step 0, train with only ``params`` requiring gradients, and leave the best state in the model
    (on Ctrl-C too); every parameter's ``requires_grad`` is restored."""
    factorized = run.factorized
    chosen = {id(p) for p in params}
    flags = {id(p): p.requires_grad for p in factorized.parameters()}
    dense_flags = {id(p): p.requires_grad for p in dense.parameters()}
    opt = _Optimizer(params, float(settings.lr))
    state = _Progress([run.point(0)], _snapshot(params))
    if not math.isfinite(state.best_loss):
        raise AuditError(f"the distillation loss of the factorized model is {state.best_loss} before any step",
                         "Check the model and the calibration inputs for NaN or infinite outputs")
    try:
        for p in factorized.parameters():
            p.requires_grad_(id(p) in chosen)
        for p in dense.parameters():
            p.requires_grad_(False)
        _train(run, opt, settings, state, progress)
    except KeyboardInterrupt:
        state.stopped = f"interrupted after step {state.done}"
    finally:
        with torch.no_grad():
            for p, v in zip(params, state.best_state):
                p.copy_(v)
        for p in factorized.parameters():
            p.requires_grad_(flags.get(id(p), p.requires_grad))
        for p in dense.parameters():
            p.requires_grad_(dense_flags.get(id(p), p.requires_grad))
    return state, opt


@scoped  # the seed it sets is the run's: the host's torch random state is left as found
def recover(factorized: nn.Module, dense: nn.Module, calibration: "Calibration | CalibrationSession",
            settings: RecoverySettings | None = None, *, metric: Metric | None = None,
            progress: Progress | None = None, evaluator: Evaluator | None = None, **keywords: object) -> Recovery:
    """Distil ``factorized`` toward ``dense`` for ``settings.steps`` steps on the calibration's fit batches (in place)
    and measure the held-out metric before, every ``eval_every`` steps, at the steps in ``eval_at`` and after; see
    the module docstring. The settings come as a :class:`RecoverySettings` or as its fields' keywords
    (``recover(f, d, cal, steps=200, lr=1e-4)``). ``evaluator``: the dense reference to measure against (an audit's
    references'; None: one measured here, on a session's search rows or the calibration's held-out rows)."""
    if settings is None:
        if "steps" not in keywords:
            raise AuditError("recover() needs the number of steps", "Give steps=200, say")
        settings = RecoverySettings(**keywords)
    elif keywords:
        settings = replace(settings, **keywords)
    settings = replace(settings, eval_at=tuple(settings.eval_at))  # read more than once (a generator would not be)
    settings.check()
    calibration, session = _calibration_of(calibration, dense, metric)
    factors = _factors_of(factorized, dense)
    settings.check_eval_at()
    if evaluator is None:
        evaluator = evaluator_of(session) if session is not None else Evaluator(dense, calibration, metric)
    run = _measure(factorized, dense, calibration, evaluator, settings.objective)
    params = _trained_params(factorized, factors, settings.trainable)
    state, opt = _run(run, dense, params, settings, progress)
    return _result(run, settings, params, state, opt)


def _result(run: _Measure, settings: RecoverySettings, params: list[nn.Parameter], state: _Progress,
            opt: _Optimizer) -> Recovery:
    stopped = state.stopped
    if stopped is not None:
        stopped += f"; the best state so far (step {state.best_step}) is kept"
    ev = run.ev
    return Recovery(
        steps=settings.steps, done=state.done, lr=float(settings.lr), trainable=settings.trainable,
        trainable_params=sum(p.numel() for p in params), objective=run.objective, seed=settings.seed,
        warmup=settings.warm, clip=float(settings.clip), master_fp32=opt.master, metric=ev.metric.label,
        higher_is_better=ev.metric.higher_is_better, tolerance=ev.metric.tolerance, reference=ev.reference,
        before=state.points[0], after=next(p for p in state.points if p.step == state.best_step),
        kept_step=state.best_step, points=state.points, stopped=stopped, fit_rows=sum(run.rows),
        fit_batches=len(run.fit), holdout_rows=sum(b.rows for b in run.held), skipped_steps=opt.skipped,
        seconds=state.seconds, rows_trained=state.rows_trained, tokens_trained=state.tokens_trained)


def summary(r: Recovery) -> str:
    """One line for the terminal: the held-out metric before and after, and what ran."""
    top = ""
    if r.before.top1 is not None and r.after.top1 is not None:
        top = f", top-1 {100 * r.before.top1:.1f}% -> {100 * r.after.top1:.1f}%"
    stop = f"; stopped: {r.stopped}" if r.stopped else ""
    return (f"recovery: {r.done} of {r.steps} steps ({r.objective}, {r.trainable}, lr {r.lr:g}, "
            f"{r.seconds_per_step:.3f} s/step), held-out {r.metric} {r.before.metric:.4g} -> {r.after.metric:.4g} "
            f"(kept step {r.kept_step}){top}{stop}")
