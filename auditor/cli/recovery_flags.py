"""The recovery flags of both commands: ``lowrank-audit factorize ... --recover STEPS`` recovers the model it writes,
the audit's ``--recover`` every frontier plan of ``--budget`` (:mod:`auditor.calibration.recovery` trains)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..errors import AuditError

if TYPE_CHECKING:  # torch and the calibration package load when recovery runs, never for --help
    from torch import nn

    from ..calibration.data.inputs import Calibration
    from ..calibration.measure.metric import Metric

HELP_LR = 1e-4  # the --recover-lr default the help names: auditor.calibration.recovery.DEFAULT_LR (a test holds them equal)


def add_cli_arguments(p: Any, audit: bool = False) -> None:
    """The recovery flags: ``lowrank-audit factorize`` (``audit=False``) recovers the model it writes; the audit
    (``audit=True``) recovers every frontier plan of ``--budget`` and measures it again."""
    p.add_argument("--recover", metavar="STEPS", help=(
        "measure every frontier plan of --budget again after STEPS steps of recovery (distillation toward the dense "
        "model on the calibration's fit rows, from the whitened factors; needs --calibration and --budget)" if audit
        else "distil the factorized model toward the dense one for STEPS steps on the calibration's fit rows "
             "(needs --calibration)"))
    p.add_argument("--recover-lr", metavar="X", help=f"recovery learning rate (AdamW; default {HELP_LR:g})")
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
    from ..calibration.recovery import DEFAULT_LR, RecoverySettings

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
    RecoverySettings(**out).check()
    return out


def cli_recover(settings: dict[str, Any], factorized: nn.Module, dense: nn.Module, calibration: Calibration,
                metric: Metric | None, bar: Any = None) -> dict[str, Any]:
    """Run the recovery for the command line: a "recovery" phase of ``bar`` (an :class:`auditor.progress.Progress`;
    default: drawn when stderr is a terminal) with the running loss, one summary line; a loss that became NaN is bad
    input (nothing is written). Returns the plan.json entry."""
    from ..calibration.recovery import RecoverySettings, recover, summary
    from ..progress import Progress as Bar

    bar = bar if bar is not None else Bar()

    def report(done: int, total: int, loss: float) -> None:
        bar.update(done, total, note=f"loss {loss:.4g}")

    with bar.phase("recovery", total=settings["steps"], unit="step"):
        r = recover(factorized, dense, calibration, RecoverySettings(eval_every=max(1, settings["steps"] // 5),
                                                                     **settings),
                    metric=metric, progress=report if bar.enabled else None)
    if r.stopped is not None and not r.stopped.startswith("interrupted"):
        raise AuditError(f"recovery stopped: {r.stopped}", "Lower --recover-lr (or check the inputs); nothing was written")
    print(summary(r), file=sys.stderr)
    return r.to_dict()
