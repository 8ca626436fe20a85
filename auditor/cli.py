"""The command line: ``lowrank-audit MODEL [options]`` and ``lowrank-audit rules [CODE]``.

Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input (one line on stderr, no report written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .errors import AuditError, ExitCode

FORMATS = ("text", "json", "md", "html", "pdf")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowrank-audit",
        description="Audit a PyTorch model before low-rank factorization: parameter shares, break-even ranks, "
                    "singular-value spectra, suggested ranks, and a review of a compression plan.",
        epilog="Sources: file.py:factory, package.module:factory, a Hugging Face directory or config.json, a "
               ".safetensors file or sharded directory (weights only), torchvision:NAME, timm:NAME. "
               "`lowrank-audit rules` lists the rules.",
    )
    p.add_argument("model", help="the model source")
    g = p.add_argument_group("inputs")
    g.add_argument("--input-shape", action="append", metavar="1,3,224,224",
                   help="a float input of this shape (repeat for several positional inputs)")
    g.add_argument("--input-ids", metavar="1,128", help="token ids of this shape, within the config's vocabulary")
    g.add_argument("--weights", metavar="FILE", help="a state dict (safetensors, or .pt loaded weights_only)")
    g.add_argument("--tracer", choices=("auto", "symbolic", "export", "walk"), default="auto",
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
    g.add_argument("--fail-on", choices=("error", "warning", "never"), help="exit 1 on findings at this level")
    g.add_argument("-q", "--quiet", action="store_true", help="no terminal table")
    g = p.add_argument_group("thresholds (override pyproject.toml and the plan)")
    g.add_argument("--energy", metavar="0.9,0.95,0.99", help="energy targets to report ranks for")
    g.add_argument("--target-energy", type=float, help="energy the suggested rank keeps (default 0.95)")
    g.add_argument("--align", type=int, help="round suggested ranks up to a multiple of this (default 8)")
    g.add_argument("--min-share", type=float, help="layers below this share of parameters are narrow")
    g.add_argument("--energy-floor", type=float, help="LR004 floor (default 0.90)")
    g.add_argument("--select", metavar="CODES", help="only these rules, e.g. LR001,LR004")
    g.add_argument("--ignore", metavar="CODES", help="never these rules")
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
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except AuditError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted: no report written", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    from . import baseline as baseline_mod
    from .config import Settings, from_pyproject
    from .core import audit
    from .load import load_source, parse_shape
    from .plan import emit_toml
    from .render import atomic_write
    from .rules import RULES

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise AuditError(f"unknown format {', '.join(bad)}", f"Choose from {', '.join(FORMATS)}")
    if not args.output_dir and sum(f in ("json", "md") for f in formats) > 1:
        raise AuditError("json and md cannot both go to stdout", "Pass -o DIR to write them as files")
    if args.jobs is not None and args.jobs < 1:
        raise AuditError(f"--jobs {args.jobs}: at least one layer must run", "Pass --jobs 1 or more, or leave it out")

    settings = Settings().with_overrides(from_pyproject(), "pyproject.toml [tool.lowrank-auditor]")
    overrides = {k: v for k, v in {
        "energy_targets": args.energy, "target_energy": args.target_energy, "align": args.align,
        "min_share": args.min_share, "energy_floor": args.energy_floor, "select": args.select,
        "ignore": args.ignore, "fail_on": args.fail_on,
    }.items() if v is not None}
    shapes = [parse_shape(s, "--input-shape") for s in args.input_shape] if args.input_shape else None
    ids = parse_shape(args.input_ids, "--input-ids") if args.input_ids else None
    base = baseline_mod.load(args.baseline) if args.baseline else None

    loaded = load_source(args.model, input_shape=shapes, input_ids=ids, weights=args.weights,
                         structure_only=args.structure_only)
    result = audit(
        loaded.model, loaded.example_inputs, plan=args.plan, settings=settings, overrides=overrides,
        name=loaded.name, source=loaded.source, tracer=args.tracer, spectra=not args.no_spectra,
        cache=not args.no_cache, cache_dir=Path(args.cache_dir) if args.cache_dir else None, jobs=args.jobs,
    )
    for f in result.findings:
        if RULES[f.code].input_error(f):
            raise AuditError(f"{f.code} {f.message}", f.fix)

    # Render everything first, then write each file atomically: no half-written report on failure.
    outputs: dict[str, str | bytes] = {}
    for fmt in formats:
        if fmt == "json":
            data = result.to_dict()
            if base is not None:
                data["baseline"] = baseline_mod.compare(result, base)
            import json

            outputs["json"] = json.dumps(data, indent=2) + "\n"
        elif fmt == "md":
            from .render.markdown import render as md

            outputs["md"] = md(result, baseline=base)
        elif fmt == "html":
            outputs["html"] = result.to_html()
        elif fmt == "pdf":
            from .render.pdf import render_pdf

            outputs["pdf"] = render_pdf(result)
    plan_text = emit_toml(result) if args.emit_plan else None

    if "text" in formats and not args.quiet:
        sys.stdout.write(result.to_text())
    out_dir = Path(args.output_dir) if args.output_dir else Path(".")
    for fmt, content in outputs.items():
        if fmt in ("json", "md") and not args.output_dir:
            sys.stdout.write(content if isinstance(content, str) else content.decode())
            continue
        path = out_dir / f"lowrank-audit.{fmt}"
        with atomic_write(path, binary=isinstance(content, bytes)) as fh:
            fh.write(content)
        print(f"wrote {path}", file=sys.stderr)
    if plan_text is not None:
        with atomic_write(args.emit_plan) as fh:
            fh.write(plan_text)
        print(f"wrote {args.emit_plan}", file=sys.stderr)
    return result.exit_code()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
