"""``lowrank-audit factorize SOURCE --plan P [--calibration C] -o DIR``: apply a plan and write the factorized model.

The plan is reviewed first (the same audit as ``lowrank-audit SOURCE --plan P``: patterns, ``0.5be`` and
``energy:0.95`` specs resolve to ranks there, and a rank above min(m, n) is bad input); then every planned layer is
replaced by two, initialised by the SVD or, with calibration, by the whitened truncation. A rank at or above a
layer's break-even (LR001: the factors store at least as much as the weight) is refused unless
``--allow-no-saving``; so are complex, quantized and other non-floating-point layers, and tied weights.

``DIR`` receives ``model.safetensors``, ``plan.json`` and the marker ``lowrank-audit-factorized.json``
(:func:`auditor.artifacts.folder.save_factorized`), written into a folder beside it and renamed into place; read them back
with ``auditor.folder.load_factorized(original_model, DIR)``. ``DIR`` must be new or empty; ``--force`` replaces
only a previous output of this command (its marker, and nothing else in it), never a folder holding an input, the
working folder or one above it, nor a symbolic link. Exit codes: 0 written, 2 bad input (one line, nothing written).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import AuditError, ExitCode, escape

if TYPE_CHECKING:
    from ..calibration.apply import Spelling
    from ..calibration.stage import Calibrated

FITS = ("sequential", "loss-aware", "independent")  # calibration/apply.py's Fit, written out: --help imports no torch
# the default fit is calibration/apply.py's DEFAULT_FIT (the library's too), read where the command runs


def _parser() -> argparse.ArgumentParser:
    from .argparser import _Parser
    from .shared_flags import add_shared

    p = _Parser(prog="lowrank-audit factorize", description_from=_description)
    add_shared(p, "model", "plan", "tie", plan={"required": True})
    p.add_argument("-o", "--output-dir", required=True, metavar="DIR", help="where to write the factorized model")
    p.add_argument("--force", action="store_true",
                   help="replace DIR when it holds a previous output of lowrank-audit factorize (and nothing else)")
    p.add_argument("--allow-no-saving", action="store_true",
                   help="write layers whose rank is at or above break-even (LR001), which store more than before")
    p.add_argument("--allow-miss", action="store_true",
                   help="exit 0 when the factorized model, measured on the held-out rows, misses the tolerance "
                        "(default: exit 1, the model still written)")
    add_shared(p, "calibration", "holdout", "calibration-length", "document-separator", "metric", "tolerance", "weights", "input-shape",
               "input-ids", "no-cache", "compute-dtype", "no-split", "confidence")
    p.add_argument("--fit", choices=FITS, default=None,
                   help="with --calibration, how the factors are fitted: sequential (default: each layer on the "
                        "inputs the factorized layers before it produce, anchored to the dense outputs, truncated "
                        "in the metric's gradient metric), loss-aware (each layer alone, truncated in that metric: "
                        "what the audit measures) or independent (each layer alone, inputs whitened: SVD-LLM)")
    p.add_argument("--refit-dense", action="store_true",
                   help="with the sequential fit, also refit the Linear layers the plan keeps dense, at full rank, on "
                        "the inputs the factorized layers give them, anchored to their dense outputs: their weights "
                        "change (not their shapes) to absorb part of the error passed on (plan.json lists them)")
    p.add_argument("--no-refine", action="store_true",
                   help="with the sequential fit, keep each layer's closed-form factors: no block refinement (by "
                        "default each repeated block's factors are then trained together on the block's output, "
                        "with early stopping on held-back fit rows; docs/calibration.md)")
    p.add_argument("--measure-speed", action="store_true",
                   help="time the dense and the factorized model end to end (and with --export the .pt2 in torch, "
                        "the ONNX in onnxruntime), each in a fresh process, at the example inputs on the CPU; peak "
                        "memory each (docs/performance.md)")
    from .recovery_flags import add_cli_arguments as recover_arguments
    from ..artifacts.export import add_cli_arguments as export_arguments

    recover_arguments(p)
    export_arguments(p)
    return p


def _description() -> str:
    """The command's description, naming the layer kinds it rewrites (from the registry, :mod:`auditor.kinds`)."""
    from .. import kinds

    return ("Apply a compression plan: each planned layer becomes two (SVD, or whitened with calibration); writes "
            f"model.safetensors and plan.json. A recovery fine-tune follows. Rewrites {kinds.rewritable_labels()} "
            "layers.")


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The run's inputs that are paths (a ``file.py:fn`` spec counts by its file): -o must never hold one."""
    from ..config import nearest_pyproject

    out: list[tuple[str, str]] = []
    settings = nearest_pyproject()
    for label, value in (("the model source", args.model), ("the plan", args.plan),
                         ("the settings file", str(settings) if settings else None),
                         ("the calibration", args.calibration), ("the held-out file", args.holdout),
                         ("the weights", args.weights), ("the metric", args.metric)):
        if label == "the metric" and value and ":" not in value:
            continue  # a metric's name (perplexity, kl), not a path
        if value:
            out += [(label, c) for c in dict.fromkeys([value, value.rpartition(":")[0]]) if c]
    return out


def _check_dir(out: Path, args: argparse.Namespace) -> None:
    from ..artifacts.folder import previous_output
    from ..artifacts.outputs import check_folder_output

    check_folder_output(out, "-o", force=args.force, replaceable=previous_output, inputs=_inputs(args),
                        tool="lowrank-audit factorize")


def _compute_dtype(args: argparse.Namespace, plan: Any) -> str | None:
    """The dtype statistics are read in: ``--compute-dtype``, else the plan's ``compute_dtype`` (what the audit that
    emitted it used), else the model's own (None). A flag that contradicts the plan is refused: the factors would
    not be the ones the audit measured."""
    given = args.compute_dtype
    planned = getattr(plan, "compute_dtype", None)
    if given is not None and planned is not None and (given if given != "model" else None) != planned:
        raise AuditError(f"--compute-dtype {given} contradicts plan {args.plan}, whose ranks were measured with "
                         f"statistics read in {planned} (compute_dtype = \"{planned}\")",
                         f"Drop --compute-dtype (the plan's {planned} is used), or edit the plan's compute_dtype")
    if given is not None:
        return None if given == "model" else given
    return planned


def _level(level: float) -> float:
    if not 0 < level < 1:
        raise AuditError(f"--confidence {level:g} is not a level in (0, 1)", "Give e.g. --confidence 0.9")
    return float(level)


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The loaded source and its module (a weights-only checkpoint has none to factorize)."""
    from torch import nn

    from ..pipeline import load_model

    loaded = load_model(args.model, _load_options(args))
    if not isinstance(loaded.model, nn.Module):
        raise AuditError(f"{args.model} is a weights-only checkpoint: there is no module to factorize",
                         "Give the model's code (file.py:factory or a Hugging Face directory)")
    return loaded, loaded.model


def _load_options(args: argparse.Namespace) -> Any:
    from ..options import LoadOptions
    from ..sources import parse_shape

    return LoadOptions(
        input_shape=tuple(parse_shape(s, "--input-shape") for s in args.input_shape) if args.input_shape else None,
        input_ids=parse_shape(args.input_ids, "--input-ids") if args.input_ids else None, weights=args.weights)


def _options(args: argparse.Namespace, loaded: Any, plan: Any) -> Any:
    """The audit's options for the plan review and, with --calibration, the plan check; a calibration flag
    without --calibration is refused, naming the flags given."""
    from ..calibration.data.text import tokenizer_home
    from ..config import repo_settings
    from .argparser import cache_usable
    from .shared_flags import unescape
    from ..options import AuditOptions
    from ..rules import RULES

    settings, plan_may_relax = repo_settings(RULES.settings())  # the repository's settings, as for the audit
    cal = args.calibration is not None
    options = AuditOptions(name=loaded.name, source=loaded.source, progress=False,
                           cache=not args.no_cache and cache_usable(None),
                           settings=settings, plan_may_relax=plan_may_relax,
                           calibration=args.calibration,
                           holdout=args.holdout if args.holdout is not None else 0.25,
                           metric=args.metric if cal else None, tolerance=args.tolerance,
                           tokenizer=tokenizer_home(loaded.source) if cal else None,
                           calibration_length=args.calibration_length,
                           document_separator=unescape(args.document_separator),
                           compute_dtype=_compute_dtype(args, plan) if cal else None,
                           split=not args.no_split, ties=tuple(args.tie or ()),
                           **({"confidence": _level(args.confidence)} if args.confidence is not None else {}))
    given = [flag for flag, value in (("--holdout", args.holdout), ("--metric", args.metric),
                                      ("--tolerance", args.tolerance), ("--calibration-length", args.calibration_length),
                                      ("--document-separator", args.document_separator),
                                      ("--compute-dtype", args.compute_dtype), ("--no-split", args.no_split or None),
                                      ("--confidence", args.confidence), ("--fit", args.fit)) if value is not None]
    if not cal and given:
        raise AuditError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --calibration",
                         "Pass --calibration FILE")
    from ..calibration.apply import DEFAULT_FIT, check_fit

    check_fit(args.fit or DEFAULT_FIT.method, args.refit_dense, not args.no_refine, cal, _spelled(args))
    if args.no_split and args.confidence is not None:  # the level is the verification's, and --no-split has none
        raise AuditError(f"--confidence {args.confidence:g} means nothing with --no-split (no rows are kept apart "
                         "to verify on, so no interval is drawn)", "Drop one of --confidence and --no-split")
    return options


def _spelled(args: argparse.Namespace) -> "Spelling":
    """How this command names the fit's options and the plan in a refusal (the library names its keywords)."""
    from ..calibration.apply import Spelling

    return Spelling(fit="--fit {}", calibration="--calibration", no_calibration="no --calibration",
                    give_calibration="--calibration FILE", to_sequential="drop --fit or give --fit sequential",
                    refit="--refit-dense", no_refine="--no-refine", plan=f"plan {args.plan}",
                    no_saving=None if args.allow_no_saving else "--allow-no-saving")


def _unverified(v: Any) -> str | None:
    """Why a verification cannot say the plan holds (a metric summed row by row measured on too few rows for an
    interval: one row, or none finite), or None when it can. A metric scored all at once never has one."""
    if v is None or v.high is not None or v.rows_needed is None:
        return None
    return (f"{v.rows:,} verification row{'s give' if v.rows != 1 else ' gives'} no interval, too few to say whether the "
            f"plan holds; about {v.rows_needed:,} verification rows (about {2 * v.rows_needed:,} held out) would")


def _measured(result: Any) -> dict[str, Any] | None:
    """plan.json's "measured": the plan check's number (on the verification rows, with its interval, when split);
    ``holds`` null and ``unverified`` saying why where the verification rows give no interval."""
    cr = result.calibration
    pc = cr.plan_check if cr is not None else None
    if pc is None:
        return None
    out = {"metric": cr.metric, "value": pc.measured, "holds": pc.ok, "tolerance": cr.tolerance,
           "predicted": pc.predicted, "top1": pc.top1, "calibration_digest": cr.digest, "fit": pc.fit}
    v = pc.verification
    if v is not None:  # measured on the verification rows, with its interval over them
        out.update(rows=v.rows, interval=[v.low, v.high], confidence=v.confidence, straddles=v.straddles)
        if v.unseen is not None:  # the interval for a document the tool never read, which the holding is judged on
            out.update(unseen_interval=[v.unseen.low, v.unseen.high], unseen=v.unseen.label)
        why = _unverified(v)
        if why is not None:
            out.update(holds=None, unverified=why)
    return out


def _not_the_audits(audited: Any, fit: str) -> str:
    """Why the audit's number for the plan is not this model's: it measured the model the default fit writes."""
    return (f"the audit measured this plan fitted {audited.fit} ({audited.measured:.4g}); that number does not apply "
            f"to this model, fitted {fit}: measured again on it")


@dataclass
class _Made:
    """A factorized model and what plan.json says of it."""

    loaded: Any  # the source (auditor.sources.Loaded)
    model: Any  # the dense module
    plan: dict[str, int]
    new: Any  # the factorized module
    session: Any  # the audit's calibration session, or None
    extra: dict[str, Any]  # plan.json's entries beside the plan
    result: Any  # the audit's result, its plan check measured on ``new``

    @property
    def calibration(self) -> Any:
        return self.session.calibration if self.session is not None else None


def _make(args: argparse.Namespace, loaded: Any, result: Any, calibrated: "Calibrated | None",
          recovery: Any) -> _Made:
    """Factorize with what the audit measured (the batches it read, the statistics it measured the plan with, its
    dense reference, its gradient pass's loss metric): :func:`auditor.pipeline.factorize_plan`, as the library does;
    then recover when asked."""
    from ..pipeline import factorize_plan
    from .recovery_flags import cli_recover
    from ..surgery import count_params

    model = loaded.model
    session = calibrated.session if calibrated is not None else None
    made_plan = factorize_plan(model, result, calibrated, fit=args.fit, refit_dense=args.refit_dense,
                               refine=not args.no_refine, spelled=_spelled(args))  # args.fit None: the default fit
    plan, new = made_plan.ranks, made_plan.model
    fit = made_plan.fit.method if session is not None else None
    extra: dict[str, Any] = {"init": "whitened" if session is not None else "svd", "params_before": count_params(model)}
    if fit is not None:
        extra["fit"] = fit
    if args.refit_dense:
        extra["refit_dense"] = _refitted(model, new)
    if fit == "sequential":
        extra["block_refinement"] = not args.no_refine
    audited = result.calibration.plan_check if result.calibration is not None else None
    if fit is not None and audited is not None and audited.layers and audited.fit != made_plan.fit.label:
        from dataclasses import replace

        from ..calibration.stage import check_factorized

        # the audit's number is of the default fit's model: this one is measured again, and plan.json says so
        result = replace(result, calibration=check_factorized(result.calibration, calibrated, model, new,
                                                              made_plan.fit.label))
    measured = _measured(result)
    if measured is not None:
        extra["measured"] = measured
        if audited is not None and audited.fit != measured["fit"]:
            measured["audit"] = {"fit": audited.fit, "value": audited.measured, "applies": False,
                                 "note": _not_the_audits(audited, made_plan.fit.label)}
    made = _Made(loaded, model, plan, new, session, extra, result)
    if recovery is not None:
        extra["recovery"] = cli_recover(recovery, new, model, session if session is not None else made.calibration,
                                        session.metric if session is not None else None)
    return made


def _refitted(model: Any, new: Any) -> list[str]:
    """The dense layers the sequential fit refitted: parameters the factorized copy holds under the same name and
    shape as the model, with other values (sorted)."""
    import torch

    old = dict(model.named_parameters())
    return sorted(name for name, p in new.named_parameters()
                  if name in old and p.shape == old[name].shape and not torch.equal(p.detach(), old[name].detach()))


def _write(out: Path, args: argparse.Namespace, made: _Made, formats: tuple[str, ...]) -> list[str]:
    """Write the folder (and the exported program) beside ``out``, then rename it into place: never a half-written
    directory. Returns the exported files."""
    from ..artifacts.export import cli_write
    from ..artifacts.folder import write_factorized
    from ..artifacts.outputs import write_folder

    exported: list[str] = []

    def write(stage: Any) -> None:
        from ..sources.checkpoint import check_mapped

        write_factorized(made.new, made.plan, stage, source=made.loaded.source, extra=made.extra)
        exported[:] = cli_write(stage, made.new, made.calibration, made.loaded.example_inputs, formats)
        check_mapped(made.loaded.model)  # the weights read from their file throughout: unchanged, or nothing lands

    write_folder(out, write, recheck=lambda: _check_dir(out, args))
    return exported


def _value(cr: Any, x: float | None) -> str:
    """A measured value in the metric's one unit (as the reports write it); an infinite one in words."""
    import math

    if x is not None and math.isinf(x):
        return "infinite (the factorized model breaks)"
    return cr.value_text(x)


def _refit_words(refit: list[str] | None) -> str:
    """", 4 dense weights refitted" for --refit-dense (plan.json names them), or nothing."""
    if refit is None:
        return ""
    return f", {len(refit)} dense weight{'s' if len(refit) != 1 else ''} refitted"


def _say(out: Path, made: _Made, result: Any, exported: list[str]) -> None:
    """What was written, on stderr: the parameters before and after, the plan check, the files."""
    from ..surgery import count_params

    before, after = count_params(made.model), count_params(made.new)
    change = (f"{100 * (before - after) / before:.1f}% removed" if after <= before else
              f"{100 * (after - before) / before:.1f}% more, ranks at or above break-even")
    print(f"factorized {len(made.plan)} layers of {escape(made.loaded.name)}: {before:,} -> {after:,} parameters "
          f"({change}), {made.extra['init']} initialisation"
          f"{', ' + made.extra['fit'] + ' fit' if 'fit' in made.extra else ''}"
          f"{' (closed form: --no-refine)' if made.extra.get('block_refinement') is False else ''}"
          f"{_refit_words(made.extra.get('refit_dense'))}", file=sys.stderr)
    cr = result.calibration
    pc = cr.plan_check if cr is not None else None
    audit = (made.extra.get("measured") or {}).get("audit")
    if audit is not None:
        print(f"note: {audit['note']}", file=sys.stderr)
    if pc is not None:
        pred = f"predicted {_value(cr, pc.predicted)} (layer-level), " if pc.predicted is not None else ""
        v = pc.verification
        why = _unverified(v)
        if why is not None:
            print(f"{cr.metric} on the held-out part: {pred}measured {_value(cr, v.value)}: UNVERIFIED, {why}",
                  file=sys.stderr)
        elif v is not None:
            print(f"{cr.metric} on the held-out part: {pred}measured " + v.words(cr.tolerance), file=sys.stderr)
        else:
            print(f"{cr.metric} on the held-out part: {pred}measured {_value(cr, pc.measured)} "
                  f"({'holds' if pc.ok else 'misses'} the tolerance {cr.tolerance_text()})", file=sys.stderr)
    print(f"wrote {escape(str(out / 'model.safetensors'))} and {escape(str(out / 'plan.json'))}; a recovery "
          "fine-tune follows (load with auditor.folder.load_factorized(model, DIR))", file=sys.stderr)
    if exported:
        print(f"wrote {', '.join(escape(str(out / f)) for f in exported)}: loads with plain torch "
              "(torch.export.load; see README.md)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """The command: every check that needs no model first, then the audit (plan review, plan check), factorize,
    recover, write, say."""
    from .recovery_flags import cli_settings
    from ..artifacts.export import cli_formats
    from ..pipeline import audit_session
    from ..planning.plan import Plan
    from ..surgery import check_targets

    out = Path(args.output_dir)
    _check_dir(out, args)
    recovery, formats = cli_settings(args), cli_formats(args)  # checked before any work
    plan_obj = Plan.coerce(args.plan)
    loaded, model = _load(args)
    options = _options(args, loaded, plan_obj)
    check_targets(model, list(plan_obj.ranks))  # complex, quantized, unsupported or tied: before any calibration
    result, calibrated = audit_session(model, loaded.example_inputs, plan=plan_obj, options=options)
    made = _make(args, loaded, result, calibrated, recovery)
    result = made.result
    exported = _write(out, args, made, formats)
    _say(out, made, result, exported)
    if getattr(args, "measure_speed", False):
        _speed(args, loaded, made.plan, out, exported)
    stopped = str(made.extra.get("recovery", {}).get("stopped") or "")
    if stopped.startswith("interrupted"):
        return 130
    return ExitCode.FINDINGS if _misses(result, made) and not args.allow_miss else ExitCode.OK


def _misses(result: Any, made: _Made) -> bool:
    """Whether the written model misses the tolerance on the held-out rows (after the recovery fine-tune when one
    ran; the verification interval's upper end when the rows were split), said in one line on stderr."""
    cr = result.calibration
    pc = cr.plan_check if cr is not None else None
    if pc is None or pc.layers == 0:
        return False
    after = (made.extra.get("recovery") or {}).get("after") or {}
    ok = after["ok"] if "ok" in after else pc.verification.ok if pc.verification is not None else pc.ok
    if not ok:
        print(f"the factorized model misses the tolerance {cr.tolerance:g}{' after recovery' if 'ok' in after else ''}"
              ": exit 1 (--allow-miss exits 0; raise the ranks, or --recover)", file=sys.stderr)
    return not ok


def _speed(args: argparse.Namespace, loaded: Any, plan: dict[str, int], out: Path, exported: list[str]) -> None:
    """--measure-speed: the dense model, the factorized one and each exported program, end to end in fresh
    processes timed side by side; one line each on stderr (a failure is a note: the files are written)."""
    import torch

    from ..speed.model import measure_subprocesses
    from ..speedresults import seconds

    load = _load_options(args)
    programs = [(str(out / f), f.rsplit(".", 1)[1]) for f in exported if f.endswith((".pt2", ".onnx"))]
    names = ["dense", "factorized", *(f"{Path(p).name} ({'onnxruntime' if k == 'onnx' else 'torch'})"
                                      for p, k in programs)]
    try:
        runs = measure_subprocesses(args.model, load, [{}, plan], "cpu",
                                    torch.get_num_threads(), programs=programs)
    except RuntimeError as exc:
        print(f"note: speed not measured: {exc}", file=sys.stderr)
        return
    n = torch.get_num_threads()
    print(f"speed on cpu ({n} thread{'s' if n != 1 else ''}), median ±half the IQR per forward, peak RSS:",
          file=sys.stderr)
    for name, r in zip(names, runs):
        ratio = runs[0].timing.median / r.timing.median if r.timing.median else float("inf")
        print(f"  {name}: {seconds(r.timing.median)} ±{seconds(r.timing.iqr / 2)}, x time {ratio:.2f}, "
              f"peak {(r.peak_bytes or 0) / 2**20:,.0f} MiB", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    from .argparser import UsageError

    try:
        args = _parser().parse_args(list(argv))
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        return run(args)
    except AuditError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
