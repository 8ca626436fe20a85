"""The command line: ``lowrank-audit MODEL [options]`` and ``lowrank-audit rules [CODE]``.

Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input (one line on stderr, no report written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .config import FailOn
from .errors import AuditError, ExitCode
from .options import Tracer

if TYPE_CHECKING:
    from .options import AuditOptions, LoadOptions

FORMATS = ("text", "json", "md", "html", "pdf")  # the built-in reporters of auditor.render, in this order
STDOUT_FORMATS = ("json", "md")  # go to stdout when there is no --output-dir; text always does


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowrank-audit",
        description="Audit a PyTorch model before low-rank factorization: parameter shares, break-even ranks, "
                    "singular-value spectra, suggested ranks, and a review of a compression plan.",
        epilog="Sources: file.py:factory, package.module:factory, a Hugging Face directory or config.json, a "
               ".safetensors file or sharded directory (weights only), torchvision:NAME, timm:NAME. "
               "`lowrank-audit rules` lists the rules; `lowrank-audit factorize --help` applies a plan.",
    )
    p.add_argument("model", help="the model source")
    g = p.add_argument_group("inputs")
    g.add_argument("--input-shape", action="append", metavar="1,3,224,224",
                   help="a float input of this shape (repeat for several positional inputs)")
    g.add_argument("--input-ids", metavar="1,128", help="token ids of this shape, within the config's vocabulary")
    g.add_argument("--weights", metavar="PATH",
                   help="a state dict (safetensors, or .pt/.bin loaded weights_only), or a folder of them; "
                        "also accepted with a config.json")
    g.add_argument("--partial", action="store_true",
                   help="audit even when the checkpoint lacks some of the model's weights (they are listed)")
    g.add_argument("--tracer", choices=[t.value for t in Tracer], default=Tracer.AUTO.value,
                   help="auto: torch.fx.symbolic_trace, then torch.export, then a module walk (default)")
    g.add_argument("--structure-only", action="store_true",
                   help="build a Hugging Face config on the meta device: counts and shapes, no weights")
    g = p.add_argument_group("plan")
    g.add_argument("--plan", metavar="FILE", help="a compression plan to review (TOML or JSON)")
    g.add_argument("--emit-plan", metavar="FILE", help="write the suggested plan as an editable TOML file")
    g = p.add_argument_group("output")
    g.add_argument("--format", default="text", help=f"comma-separated, from {', '.join(FORMATS)} (default: text)")
    g.add_argument("-o", "--output-dir", metavar="DIR",
                   help="write reports here as lowrank-audit.{json,md,html,pdf}; without it json/md go to stdout")
    g.add_argument("--baseline", metavar="OLD.json", help="report what changed since an earlier JSON audit")
    g.add_argument("--fail-on", choices=[f.value for f in FailOn], help="exit 1 on findings at this level")
    g.add_argument("-q", "--quiet", action="store_true", help="no terminal table")
    g = p.add_argument_group("thresholds (override pyproject.toml and the plan)")
    g.add_argument("--energy", metavar="0.9,0.95,0.99", help="energy targets to report ranks for")
    g.add_argument("--target-energy", type=float, help="energy the suggested rank keeps (default 0.95)")
    g.add_argument("--align", type=int, help="round suggested ranks up to a multiple of this (default 8)")
    g.add_argument("--min-share", type=float, help="layers below this share of parameters are narrow")
    g.add_argument("--energy-floor", type=float, help="LR004 floor (default 0.90)")
    g.add_argument("--select", metavar="CODES", help="only these rules, e.g. LR001,LR004")
    g.add_argument("--ignore", metavar="CODES", help="never these rules")
    g = p.add_argument_group("calibration (measured rank floors; docs/calibration.md)")
    g.add_argument("--calibration", metavar="FILE|module:fn",
                   help="inputs to measure with: a safetensors/.pt file of tensors named after the forward's "
                        "inputs, batched along dim 0, or file.py:fn / module:fn returning batches")
    g.add_argument("--holdout", metavar="SHARE|FILE", help="share of the rows held out to measure (default 0.25), "
                                                            "or a second file held out whole")
    g.add_argument("--metric", metavar="module:fn",
                   help="fn(model, batches) -> float, higher is better (default: relative output error)")
    g.add_argument("--tolerance", type=float, help="allowed loss in the metric's units (default 0.01)")
    g.add_argument("--measure-floor", action="store_true",
                   help="tier 2: truncate each layer alone and bisect for its measured floor")
    g.add_argument("--budget", type=float, metavar="FRACTION",
                   help="tier 3: a plan removing this share of the parameters, checked all at once")
    g = p.add_argument_group("spectra")
    g.add_argument("--no-spectra", action="store_true", help="skip singular values (structure and counts only)")
    g.add_argument("--no-cache", action="store_true", help="do not read or write the spectrum cache")
    g.add_argument("--cache-dir", metavar="DIR", help="spectrum cache (default ~/.cache/lowrank-auditor)")
    g.add_argument("-j", "--jobs", type=int, metavar="N",
                   help="layers computed side by side, each with its share of the cores (default: cores, at most 4)")
    return p


def _rules_main(argv: Sequence[str]) -> int:
    from .rules import RULES, find_rule, rule_doc, rules_markdown
    from .rules.registry import BUILTIN_ORIGIN

    p = argparse.ArgumentParser(prog="lowrank-audit rules", description="List the rules, or print one.")
    p.add_argument("code", nargs="?", help="a rule code such as LR004, or its slug such as energy-below-floor")
    p.add_argument("--markdown", action="store_true", help="print docs/rules.md")
    a = p.parse_args(argv)
    try:
        if a.markdown:
            sys.stdout.write(rules_markdown())
            return 0
        if a.code:
            sys.stdout.write(rule_doc(find_rule(a.code)) + "\n")
            return 0
        for r in RULES.values():
            origin = "" if r.origin == BUILTIN_ORIGIN else f" (from {r.origin})"
            print(f"{r.code}  {r.slug:<30} {str(r.severity):<8} {r.summary}{origin}")
    except AuditError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rules":
        return _rules_main(argv[1:])
    if argv and argv[0] == "factorize":
        from .cli_factorize import main as factorize_main

        return factorize_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except AuditError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no report written", file=sys.stderr)
        return 130


def options_from(args: argparse.Namespace) -> tuple["AuditOptions", "LoadOptions"]:
    """The audit's and the loader's options from the flags: defaults < pyproject.toml < the plan < the flags
    (the plan's thresholds are applied between ``settings`` and ``overrides`` by the pipeline)."""
    from .config import Settings, from_pyproject
    from .load import parse_shape
    from .options import AuditOptions, LoadOptions

    if args.jobs is not None and args.jobs < 1:
        raise AuditError(f"--jobs {args.jobs}: at least one layer must run", "Pass --jobs 1 or more, or leave it out")
    settings = Settings().with_overrides(from_pyproject(), "pyproject.toml [tool.lowrank-auditor]")
    overrides = {k: v for k, v in {
        "energy_targets": args.energy, "target_energy": args.target_energy, "align": args.align,
        "min_share": args.min_share, "energy_floor": args.energy_floor, "select": args.select,
        "ignore": args.ignore, "fail_on": args.fail_on,
    }.items() if v is not None}
    audit_options = AuditOptions(
        settings=settings, overrides=overrides, overrides_origin="the command line", tracer=Tracer(args.tracer),
        spectra=not args.no_spectra, cache=not args.no_cache,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None, jobs=args.jobs, **calibration_options(args),
    )
    load_options = LoadOptions(
        input_shape=tuple(parse_shape(s, "--input-shape") for s in args.input_shape) if args.input_shape else None,
        input_ids=parse_shape(args.input_ids, "--input-ids") if args.input_ids else None,
        weights=args.weights, structure_only=args.structure_only, partial=args.partial,
    )
    return audit_options, load_options


def calibration_options(args: argparse.Namespace) -> dict:
    """The calibration flags as AuditOptions fields (checked there: --budget in (0, 1), the rest need data)."""
    if args.calibration is None:
        given = [f for f, v in (("--holdout", args.holdout), ("--metric", args.metric), ("--tolerance", args.tolerance),
                                ("--measure-floor", args.measure_floor or None), ("--budget", args.budget)) if v]
        if given:
            raise AuditError(f"{', '.join(given)} need(s) calibration data", "Pass --calibration FILE as well")
        return {}
    return {"calibration": args.calibration, "holdout": args.holdout if args.holdout is not None else 0.25,
            "metric": args.metric, "tolerance": args.tolerance, "measure_floor": args.measure_floor,
            "budget": args.budget}


def _terminal_width() -> int:
    """The terminal's width; 160 when stdout is not a terminal (a CI log is wide)."""
    import shutil

    return shutil.get_terminal_size((160, 24)).columns if sys.stdout.isatty() else 160


def run(args: argparse.Namespace) -> int:
    from . import baseline as baseline_mod
    from .pipeline import audit_source
    from .plan import emit_toml
    from .policy import exit_code, input_errors
    from .render import REPORTERS, RenderContext, atomic_write

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in REPORTERS]
    if bad:
        raise AuditError(f"unknown format {', '.join(bad)}", f"Choose from {', '.join(REPORTERS)}")
    if not args.output_dir and sum(f in STDOUT_FORMATS for f in formats) > 1:
        raise AuditError("json and md cannot both go to stdout", "Pass -o DIR to write them as files")
    options, load_options = options_from(args)
    base = baseline_mod.load(args.baseline) if args.baseline else None

    result = audit_source(args.model, plan=args.plan, options=options, load=load_options)
    for f in input_errors(result):
        raise AuditError(f"{f.code} {f.message}", f.fix)

    # Render everything first, then write each file atomically: no half-written report on failure.
    context = RenderContext(baseline=baseline_mod.compare(result, base) if base is not None else None,
                            width=_terminal_width())
    ordered = sorted(dict.fromkeys(formats), key=lambda f: f != "text")  # the table first, as before
    outputs = {fmt: REPORTERS[fmt].render(result, context) for fmt in ordered if fmt != "text" or not args.quiet}
    plan_text = emit_toml(result) if args.emit_plan else None

    out_dir = Path(args.output_dir) if args.output_dir else Path(".")
    for fmt, content in outputs.items():
        reporter = REPORTERS[fmt]
        if fmt == "text" or (fmt in STDOUT_FORMATS and not args.output_dir):
            sys.stdout.write(content if isinstance(content, str) else content.decode())
            continue
        path = out_dir / f"lowrank-audit{reporter.suffix}"
        with atomic_write(path, binary=reporter.binary) as fh:
            fh.write(content)
        print(f"wrote {path}", file=sys.stderr)
    if plan_text is not None:
        with atomic_write(args.emit_plan) as fh:
            fh.write(plan_text)
        print(f"wrote {args.emit_plan}", file=sys.stderr)
    return exit_code(result)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
