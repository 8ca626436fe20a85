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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .calibration.inputs import Batch, Calibration, model_device
from .calibration.metric import Evaluator, Metric, main_output
from .calibration.session import CalibrationSession
from .errors import AuditError

TRAINABLE = ("factors", "all")
OBJECTIVES = ("auto", "kl", "mse")
DEFAULT_LR = 1e-4
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds_per_step"] = self.seconds_per_step
        return _finite(d)


def _finite(x: Any) -> Any:
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
    ``nn.Sequential`` that :func:`auditor.factorize.factorize` puts there."""
    dense_mods = dict(dense.named_modules())
    out: dict[str, nn.Sequential] = {}
    for path, mod in factorized.named_modules():
        old = dense_mods.get(path)
        if (path and isinstance(mod, nn.Sequential) and len(mod) == 2 and old is not None
                and not isinstance(old, nn.Sequential) and isinstance(getattr(old, "weight", None), torch.Tensor)
                and all(isinstance(getattr(m, "weight", None), nn.Parameter) for m in mod)):
            out[path] = mod
    return out


def _check_settings(steps: Any, lr: Any, trainable: Any, objective: Any, seed: Any, eval_every: Any,
                    warmup: Any, clip: Any) -> None:
    def positive_int(v: Any, what: str, fix: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise AuditError(f"{what} {v!r} is not a positive integer", fix)

    positive_int(steps, "recovery steps", "Give --recover a positive number of steps, e.g. --recover 200")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise AuditError(f"recovery learning rate {lr!r} is not a positive finite number",
                         f"Give e.g. --recover-lr {DEFAULT_LR:g}")
    if trainable not in TRAINABLE:
        raise AuditError(f"recovery trainable {trainable!r} is neither 'factors' nor 'all'",
                         "Give --recover-trainable factors (the factor weights only) or all")
    if objective not in OBJECTIVES:
        raise AuditError(f"recovery objective {objective!r} is not one of {', '.join(OBJECTIVES)}",
                         "Give auto, kl (output distributions) or mse (output values)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise AuditError(f"recovery seed {seed!r} is not an integer", "Give an integer seed")
    if eval_every is not None:
        positive_int(eval_every, "recovery eval_every", "Give a positive number of steps between measurements")
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise AuditError(f"recovery warm-up {warmup!r} is not a non-negative integer", "Give e.g. warmup=10")
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise AuditError(f"recovery gradient clip {clip!r} is not a positive finite number", "Give e.g. clip=1.0")


def _is_logits(out: Any, y: torch.Tensor) -> bool:
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

    def __init__(self, model: nn.Module, outs: dict[int, Any]) -> None:
        super().__init__()
        self.model = model
        self.outs = outs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        key = _key(Batch(args, kwargs))
        return self.outs[key] if key in self.outs else self.model(*args, **kwargs)


def _schedule(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor for step ``step`` (1-based): linear warm-up, then linear decay to 0 at ``steps``."""
    if warmup and step <= warmup:
        return step / warmup
    return max(0.0, (steps - step + 1) / max(1, steps - warmup))


def recover(factorized: nn.Module, dense: nn.Module, calibration: "Calibration | CalibrationSession", *, steps: int,
            lr: float = DEFAULT_LR, trainable: str = "factors", seed: int = 0, eval_every: int | None = None,
            eval_at: Sequence[int] = (), objective: str = "auto", metric: Metric | None = None, warmup: int | None = None, clip: float = 1.0,
            progress: Progress | None = None) -> Recovery:
    """Distil ``factorized`` toward ``dense`` for ``steps`` steps on the calibration's fit batches (in place) and
    measure the held-out metric before, every ``eval_every`` steps, at the steps in ``eval_at`` and after; see the
    module docstring."""
    _check_settings(steps, lr, trainable, objective, seed, eval_every, warmup, clip)
    session = None
    if isinstance(calibration, CalibrationSession):  # its evaluator: the dense reference is not measured again
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
    if factorized is dense:
        raise AuditError("recover() was given the dense model as the factorized one",
                         "Pass factorize(model, plan) and the original model")
    factors = factor_modules(factorized, dense)
    if not factors:
        raise AuditError("the model has no factorized layer to recover",
                         "Factorize at least one layer (auditor.factorize.factorize) before recovering")
    lr = float(lr)
    extra = set(eval_at)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in extra):
        raise AuditError(f"recovery eval_at {sorted(extra, key=str)!r} holds a step that is not a positive integer",
                         "Give the steps to measure at as positive integers")
    warm = min(100, max(1, round(0.1 * steps))) if warmup is None else min(int(warmup), steps)
    device = model_device(factorized)
    fit = [b.to(device) for b in calibration.fit]

    # which parameters train
    if trainable == "factors":
        chosen = {id(m.weight): m.weight for mod in factors.values() for m in mod}
    else:
        chosen = {id(p): p for p in factorized.parameters() if p.is_floating_point()}
    params = list(chosen.values())
    flags = {id(p): p.requires_grad for p in factorized.parameters()}
    dense_flags = {id(p): p.requires_grad for p in dense.parameters()}
    ev = session.evaluator if session is not None else Evaluator(dense, calibration, metric)
    held = ev.batches  # the held-out batches (calibration.measure), on the model's device
    targets = _Targets(dense, fit)
    held_targets = _Targets(dense, held)
    with torch.no_grad():
        probe = factorized(*fit[0].args, **fit[0].kwargs)
    y0 = main_output(probe)
    if objective == "auto":
        objective = "kl" if _is_logits(probe, y0) else "mse"
    if tuple(y0.shape) != tuple(targets[0].shape):
        raise AuditError(f"the factorized model's output {tuple(y0.shape)} differs in shape from the dense model's "
                         f"{tuple(targets[0].shape)}", "Pass the factorized model and the model it was made from")
    master = any(p.dtype in LOW for p in params)
    fp16 = any(p.dtype == torch.float16 for p in params)
    if master:
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    else:
        masters = params
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.0)
    rows = [b.rows for b in fit]

    def fit_loss() -> float:
        total = 0.0
        with torch.no_grad():
            for i, b in enumerate(fit):
                total += float(distill_loss(main_output(factorized(*b.args, **b.kwargs)), targets[i], objective)) * rows[i]
        return total / sum(rows)

    def point(step: int) -> RecoveryPoint:
        """One pass over the held-out batches gives the distillation loss and, for the default metric, the
        Evaluator's measurement (it is handed the recorded outputs); a user metric runs the model itself."""
        outs: dict[int, Any] = {}
        total = 0.0
        with torch.no_grad():
            for i, b in enumerate(held):
                out = factorized(*b.args, **b.kwargs)
                total += float(distill_loss(main_output(out), held_targets[i], objective)) * b.rows
                key = _key(ev.batches[i]) if ev.metric.fn is None else None
                if key is not None:
                    outs[key] = out
        m = ev.measure(_Replay(factorized, outs) if ev.metric.fn is None else factorized)
        return RecoveryPoint(step, m.value, m.ok, m.top1, total / sum(b.rows for b in held), fit_loss())

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for p in params]

    points = [point(0)]
    best_loss, best_step, best_state = points[0].fit_loss, 0, snapshot()
    if not math.isfinite(best_loss):
        raise AuditError(f"the distillation loss of the factorized model is {best_loss} before any step",
                         "Check the model and the calibration inputs for NaN or infinite outputs")
    stopped: str | None = None
    done = skipped = 0
    bad_in_a_row = 0
    scale = 2.0 ** 16 if fp16 else 1.0
    good = 0
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    seconds = 0.0
    rows_trained = tokens_trained = 0
    running: float | None = None
    try:
        for p in factorized.parameters():
            p.requires_grad_(id(p) in chosen)
        for p in dense.parameters():
            p.requires_grad_(False)
        torch.manual_seed(seed)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if not order:
                order = torch.randperm(len(fit), generator=gen).tolist()
            i = order.pop(0)
            b = fit[i]
            for g in opt.param_groups:
                g["lr"] = lr * _schedule(step, steps, warm)
            for p in params:
                p.grad = None
            opt.zero_grad(set_to_none=True)
            with torch.enable_grad():
                tgt = targets[i]
                loss = distill_loss(main_output(factorized(*b.args, **b.kwargs)), tgt, objective)
                value = float(loss.detach())
                if not math.isfinite(value):
                    stopped = f"the loss became {value} at step {step} (lr {lr:g})"
                    break
                (loss * scale).backward()
            if master:
                for p, mp in zip(params, masters):
                    mp.grad = None if p.grad is None else p.grad.float() / scale
            grads = [mp.grad for mp in masters if mp.grad is not None]
            finite = all(bool(torch.isfinite(gr).all()) for gr in grads)
            if not finite:
                if fp16:  # an overflow of the loss scale: skip the step, halve the scale
                    skipped += 1
                    bad_in_a_row += 1
                    scale /= 2
                    good = 0
                    if bad_in_a_row >= 30:
                        stopped = f"the gradients overflowed fp16 30 steps in a row, up to step {step}"
                        break
                    done = step
                    seconds += time.perf_counter() - t0
                    continue
                stopped = f"the gradient became NaN or infinite at step {step} (lr {lr:g})"
                break
            bad_in_a_row = 0
            rows_trained += rows[i]
            tokens_trained += tgt.numel() // tgt.shape[-1] if tgt.dim() >= 2 else rows[i]
            torch.nn.utils.clip_grad_norm_(masters, clip)
            opt.step()
            if master:
                with torch.no_grad():
                    for p, mp in zip(params, masters):
                        p.copy_(mp)
            if fp16:
                good += 1
                if good >= 200 and scale < 2.0 ** 24:
                    scale *= 2
                    good = 0
            done = step
            running = value if running is None else 0.9 * running + 0.1 * value
            seconds += time.perf_counter() - t0
            if progress is not None:
                progress(step, steps, running)
            if (eval_every and step % eval_every == 0) or step in extra or step == steps:
                pt = point(step)
                points.append(pt)
                if not math.isfinite(pt.fit_loss):
                    stopped = f"the fit loss became {pt.fit_loss} at step {step} (lr {lr:g})"
                    break
                if pt.fit_loss < best_loss:
                    best_loss, best_step, best_state = pt.fit_loss, step, snapshot()
    except KeyboardInterrupt:
        stopped = f"interrupted after step {done}"
    finally:
        with torch.no_grad():
            for p, v in zip(params, best_state):
                p.copy_(v)
        for p in factorized.parameters():
            p.requires_grad_(flags.get(id(p), p.requires_grad))
        for p in dense.parameters():
            p.requires_grad_(dense_flags.get(id(p), p.requires_grad))
    after = next(p for p in points if p.step == best_step)
    if stopped is not None:
        stopped += f"; the best state so far (step {best_step}) is kept"
    return Recovery(
        steps=steps, done=done, lr=lr, trainable=trainable, trainable_params=sum(p.numel() for p in params),
        objective=objective, seed=seed, warmup=warm, clip=float(clip), master_fp32=master, metric=ev.metric.label,
        higher_is_better=ev.metric.higher_is_better, tolerance=ev.metric.tolerance, reference=ev.reference,
        before=points[0], after=after, kept_step=best_step, points=points, stopped=stopped,
        fit_rows=sum(rows), fit_batches=len(fit), holdout_rows=sum(b.rows for b in held), skipped_steps=skipped,
        seconds=seconds, rows_trained=rows_trained, tokens_trained=tokens_trained)


def summary(r: Recovery) -> str:
    """One line for the terminal: the held-out metric before and after, and what ran."""
    top = ""
    if r.before.top1 is not None and r.after.top1 is not None:
        top = f", top-1 {100 * r.before.top1:.1f}% -> {100 * r.after.top1:.1f}%"
    stop = f"; stopped: {r.stopped}" if r.stopped else ""
    return (f"recovery: {r.done} of {r.steps} steps ({r.objective}, {r.trainable}, lr {r.lr:g}, "
            f"{r.seconds_per_step:.3f} s/step), held-out {r.metric} {r.before.metric:.4g} -> {r.after.metric:.4g} "
            f"(kept step {r.kept_step}){top}{stop}")


# --- the command line (lowrank-audit factorize ... --recover STEPS) ---------------------------------------------

def add_cli_arguments(p: Any, audit: bool = False) -> None:
    """The recovery flags: ``lowrank-audit factorize`` (``audit=False``) recovers the model it writes; the audit
    (``audit=True``) recovers every frontier plan of ``--budget`` and measures it again."""
    p.add_argument("--recover", metavar="STEPS", help=(
        "measure every frontier plan of --budget again after STEPS steps of recovery (distillation toward the dense "
        "model on the calibration's fit rows, from the whitened factors; needs --calibration and --budget)" if audit
        else "distil the factorized model toward the dense one for STEPS steps on the calibration's fit rows "
             "(needs --calibration)"))
    p.add_argument("--recover-lr", metavar="X", help=f"recovery learning rate (AdamW; default {DEFAULT_LR:g})")
    p.add_argument("--recover-trainable", metavar="factors|all",
                   help="what recovery trains: the factor weights (default) or every parameter")
    p.add_argument("--recover-objective", metavar="auto|kl|mse",
                   help="KL of the output distributions (logits), output MSE, or auto (KL for logits)")


def cli_settings(args: Any) -> dict[str, Any] | None:
    """The recovery settings from the command line, checked before any work: None without --recover."""
    given = [f for f in ("recover_lr", "recover_trainable", "recover_objective") if getattr(args, f, None) is not None]
    if getattr(args, "recover", None) is None:
        if given:
            raise AuditError(f"--{given[0].replace('_', '-')} needs --recover STEPS", "Add --recover 200, say")
        return None
    if getattr(args, "calibration", None) is None:
        raise AuditError("--recover needs --calibration: recovery trains on its fit rows and measures on the "
                         "held-out ones", "Pass --calibration FILE")
    text = str(args.recover).strip()
    try:
        steps = int(text)
    except ValueError:
        raise AuditError(f"--recover {args.recover!r} is not a whole number of steps", "Give e.g. --recover 200") from None
    lr: Any = DEFAULT_LR
    if args.recover_lr is not None:
        try:
            lr = float(str(args.recover_lr).strip())
        except ValueError:
            raise AuditError(f"--recover-lr {args.recover_lr!r} is not a number", f"Give e.g. --recover-lr {DEFAULT_LR:g}") from None
    out = {"steps": steps, "lr": lr, "trainable": args.recover_trainable or "factors",
           "objective": args.recover_objective or "auto"}
    _check_settings(out["steps"], out["lr"], out["trainable"], out["objective"], 0, None, None, 1.0)
    return out


def cli_recover(settings: dict[str, Any], factorized: nn.Module, dense: nn.Module, calibration: Calibration,
                metric: Metric | None, bar: Any = None) -> dict[str, Any]:
    """Run the recovery for the command line: a "recovery" phase of ``bar`` (an :class:`auditor.progress.Progress`;
    default: drawn when stderr is a terminal) with the running loss, one summary line; a loss that became NaN is bad
    input (nothing is written). Returns the plan.json entry."""
    import sys

    from .progress import Progress as Bar

    bar = bar if bar is not None else Bar()

    def report(done: int, total: int, loss: float) -> None:
        bar.update(done, total, note=f"loss {loss:.4g}")

    with bar.phase("recovery", total=settings["steps"], unit="step"):
        r = recover(factorized, dense, calibration, steps=settings["steps"], lr=settings["lr"],
                    trainable=settings["trainable"], objective=settings["objective"], metric=metric,
                    eval_every=max(1, settings["steps"] // 5), progress=report if bar.enabled else None)
    if r.stopped is not None and not r.stopped.startswith("interrupted"):
        raise AuditError(f"recovery stopped: {r.stopped}", "Lower --recover-lr (or check the inputs); nothing was written")
    print(summary(r), file=sys.stderr)
    return r.to_dict()
