"""``lowrank-audit check-plan PLAN... [--model SOURCE]``: review committed plan files (the pre-commit hook's command).

Without ``--model`` each plan is read as the audit reads it: TOML or JSON syntax, duplicate keys, ``[ranks]``,
``finetune`` and ``[thresholds]`` only, every rank spec valid (``64``, ``"0.5be"``, ``"energy:0.95"``). With
``--model`` each plan is reviewed against the model as ``lowrank-audit SOURCE --plan PLAN`` would, and every finding
is printed as ``PLAN:LINE: severity CODE message`` (the line of the layer's pattern in the plan).

Exit codes: 0 every plan passes, 1 findings at or above ``--fail-on`` (default error), 2 a plan (or the model) is
bad input; each problem is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import AuditError, ExitCode

if TYPE_CHECKING:
    from ..planning.plan import Plan


def _parser() -> argparse.ArgumentParser:
    from ..config import FailOn

    p = argparse.ArgumentParser(prog="lowrank-audit check-plan",
                                description="Check compression plan files; with --model, review them against it.")
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files (TOML, or JSON when named .json)")
    p.add_argument("--model", metavar="SOURCE", help="review each plan against this model (file.py:factory, a "
                                                     "Hugging Face directory, a checkpoint: as for the audit)")
    p.add_argument("--input-shape", action="append", metavar="1,3,224,224", help="as for the audit")
    p.add_argument("--input-ids", metavar="1,128", help="as for the audit")
    p.add_argument("--weights", metavar="PATH", help="as for the audit")
    p.add_argument("--structure-only", action="store_true", help="as for the audit (no spectra: specs only)")
    p.add_argument("--fail-on", choices=[f.value for f in FailOn], default=FailOn.ERROR.value,
                   help="exit 1 on findings at this level (default: error)")
    p.add_argument("--format", choices=["text", "github"], default="text",
                   help="text: PLAN:LINE: severity CODE message (default); github: workflow-command annotations "
                        "for a GitHub Actions log (every field escaped)")
    return p


def _review(model: str, plan: Path, args: argparse.Namespace) -> int:
    from ..sources import parse_shape
    from ..options import AuditOptions, LoadOptions
    from ..pipeline import audit_source
    from ..verdict.policy import exit_code, input_errors
    from ..artifacts.outputs import print_stdout, write_stdout
    from ..render.parts.safe import term
    from ..render.sarif import Locator

    load = LoadOptions(
        input_shape=tuple(parse_shape(s, "--input-shape") for s in args.input_shape) if args.input_shape else None,
        input_ids=parse_shape(args.input_ids, "--input-ids") if args.input_ids else None,
        weights=args.weights, structure_only=args.structure_only)
    from ..config import repo_settings
    from ..rules import RULES

    settings, plan_may_relax = repo_settings(RULES.settings())  # the repository's settings, as for the audit
    result = audit_source(model, plan=str(plan), options=AuditOptions(settings=settings, progress=False,
                                                                      plan_may_relax=plan_may_relax), load=load)
    for f in input_errors(result):
        raise AuditError(f"{f.code} {f.message}", f.fix)
    if args.format == "github":
        from ..render.sarif import github_annotations

        write_stdout(github_annotations(result))
        return int(exit_code(result, args.fail_on))
    locate = Locator(result)
    for f in result.findings:
        where = locate.where(f)
        line = where.line if where is not None and where.path == plan.resolve() else 1
        fix = f" (fix: {term(f.fix)})" if f.fix else ""
        print_stdout(f"{term(str(plan))}:{line}: {f.severity} {f.code} {term(f.message)}{fix}")
    return int(exit_code(result, args.fail_on))


def _check_thresholds(plan: "Plan") -> None:
    from ..config import check_plan_relaxes, repo_settings, validate
    from ..rules import RULES

    declared = RULES.settings()
    settings, plan_may_relax = repo_settings(declared)
    relaxed = settings.with_overrides(plan.thresholds, plan.source, declared, typed=True)
    if not plan_may_relax:
        from ..rules.runner import selected

        check_plan_relaxes(settings, relaxed, plan.source, lambda sel, ign: {r.code for r in selected(sel, ign)},
                           declared)
    validate(relaxed, declared)


def main(argv: Sequence[str]) -> int:
    from ..planning.plan import Plan

    args = _parser().parse_args(list(argv))
    code = 0
    for name in args.plans:
        plan = Path(name)
        try:
            loaded = Plan.load(plan)
            if loaded.thresholds:  # checked as the audit checks them: valid, and not silencing this plan's review
                _check_thresholds(loaded)
            if args.model:
                code = max(code, _review(args.model, plan, args))
        except AuditError as exc:
            print(f"error: {exc.line()}", file=sys.stderr)
            code = ExitCode.BAD_INPUT
    return int(code)
