"""What the findings mean for a run: the one-line verdict every report prints, the command line's exit code, and
which findings the command line treats as bad input. Plain functions of an Audit; no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import FailOn
from .errors import ExitCode
from .results import Severity

if TYPE_CHECKING:
    from .results import Audit, Finding


def verdict_line(audit: "Audit") -> str:
    """PASS / REVIEW / FAIL with the counts, and what the reviewed plan saves.

    >>> from auditor.results import Audit, Finding, Settings, TraceMethod
    >>> a = Audit("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings(),
    ...           findings=[Finding("LR003", "narrow", Severity.WARNING, "narrow")])
    >>> verdict_line(a)
    'REVIEW: 1 warning(s)'
    """
    r = audit.review
    saving = ""
    if r is not None and r.items:
        saving = (f"; the {'suggested' if r.suggested else 'planned'} ranks save "
                  f"{r.params_saved:,} parameters ({100 * r.share_saved:.1f}% of the model)")
    saving += plan_check_clause(audit)
    note = audit.calibration.recovery_note() if audit.calibration is not None else ""
    if note and r is not None and r.suggested:
        saving += f"; chosen after recovery: {note}"
    return verdict_head(audit) + saving


def verdict_head(audit: "Audit") -> str:
    """The verdict's first part, PASS / REVIEW / FAIL with the counts (the Markdown puts the saving and the
    measurement in its plan card instead)."""
    c = audit.counts
    if c.error:
        return f"FAIL: {c.error} error(s), {c.warning} warning(s)"
    if c.warning:
        return f"REVIEW: {c.warning} warning(s)"
    return "PASS: no errors or warnings"


def plan_check_clause(audit: "Audit") -> str:
    """"; measured all at once: <metric> V, within the tolerance T" (or "misses the tolerance T") when calibration measured the reviewed plan;
    "; not measured all at once" when calibration was given but the plan could not be measured; else empty."""
    cal = audit.calibration
    r = audit.review
    if cal is None or r is None or not r.items:
        return ""
    pc = cal.plan_check
    if pc is None or pc.layers == 0 or pc.measured != pc.measured:
        return "; not measured all at once"
    if pc.verification is not None and not cal.higher_is_better:
        return "; measured all at once: " + pc.verification.words(cal.tolerance, cal.metric)
    if cal.higher_is_better:
        return (f"; measured all at once: {cal.metric} {pc.measured:.4g} against the dense {cal.reference:.4g} "
                f"(tolerance {cal.tolerance:g}: {'holds' if pc.ok else 'misses'})")
    return (f"; measured all at once: {cal.metric} {pc.measured:.4g}, "
            + (f"within the tolerance {cal.tolerance:g}" if pc.ok else f"misses the tolerance {cal.tolerance:g}"))


def exit_code(audit: "Audit", fail_on: FailOn | str | None = None) -> ExitCode:
    """``ExitCode.FINDINGS`` when a finding is at or above ``fail_on`` (default: the audit's settings), else OK.

    >>> from auditor.results import Audit, Finding, Settings, TraceMethod
    >>> a = Audit("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings(),
    ...           findings=[Finding("LR003", "narrow", Severity.WARNING, "narrow")])
    >>> exit_code(a), exit_code(a, FailOn.WARNING), exit_code(a, "never")
    (<ExitCode.OK: 0>, <ExitCode.FINDINGS: 1>, <ExitCode.OK: 0>)
    """
    level = FailOn(fail_on) if fail_on is not None else audit.settings.fail_on
    if level is FailOn.NEVER:
        return ExitCode.OK
    floor = Severity.ERROR if level is FailOn.ERROR else Severity.WARNING
    return ExitCode.FINDINGS if audit.counts.at_least(floor) else ExitCode.OK


def input_errors(audit: "Audit") -> list["Finding"]:
    """Findings that the command line reports as bad input (exit 2, no report): each rule decides for its own."""
    from .rules import RULES

    return [f for f in audit.findings if f.code in RULES and RULES[f.code].input_error(f)]
