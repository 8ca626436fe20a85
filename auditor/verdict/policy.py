"""What the findings mean for a run: the one-line verdict every report prints, the command line's exit code, and
which findings the command line treats as bad input. Plain functions of an Audit; no torch."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Callable

from ..config import FailOn
from ..errors import ExitCode
from ..results import Severity

if TYPE_CHECKING:
    from ..calresults import CalibrationReport, PlanCheck, Verification
    from ..results import AuditResult, Finding


class Status(StrEnum):
    """What a report's verdict says, for people and CI alike (the JSON's ``status``).

    ``unmeasured``: no error or warning, but nothing measured the plan (a data-free audit, or a plan reviewed
    without calibration data, or one calibration could not apply): its ranks are energy-based estimates. Exit
    code 0 like ``pass`` unless ``--fail-on unmeasured`` asks otherwise.
    """

    PASS = "pass"
    REVIEW = "review"
    FAIL = "fail"
    UNMEASURED = "unmeasured"


def measured(audit: "AuditResult") -> bool:
    """Whether calibration data measured what the report suggests or reviews: the plan applied all at once on the
    held-out rows (or the suggested ranks chosen by a plan search that measured them), or nothing to measure (the
    plan factorizes nothing). False for a data-free audit."""
    cal = audit.calibration
    if cal is None:
        return False
    r = audit.review
    if r is None or not r.items:
        return True
    pc = cal.plan_check
    if pc is not None and pc.layers > 0 and pc.measured == pc.measured:
        v = pc.verification  # nothing scored, or one row that was the search's as well: no measurement
        return v is None or not (v.rows < 1 or (v.rows == 1 and v.search_rows <= 1))
    return bool(r.suggested and cal.budget is not None and cal.budget.plan)


def missed(audit: "AuditResult") -> bool:
    """The plan was measured all at once and misses the tolerance: never a PASS, even when the rule that says so
    is not selected (``select`` in pyproject.toml) and no finding is shown."""
    cal = audit.calibration
    pc = cal.plan_check if cal is not None else None
    return pc is not None and pc.layers > 0 and not pc.ok and measured(audit)


def status(audit: "AuditResult") -> Status:
    """FAIL with an error, REVIEW with a warning, else PASS when the plan was measured, UNMEASURED when not.

    >>> from auditor.results import AuditResult, Finding, Settings, TraceMethod
    >>> a = AuditResult("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings())
    >>> str(status(a))
    'unmeasured'
    """
    c = audit.counts
    if c.error:
        return Status.FAIL
    if c.warning or missed(audit):
        return Status.REVIEW
    return Status.PASS if measured(audit) else Status.UNMEASURED


def verdict_line(audit: "AuditResult") -> str:
    """PASS / REVIEW / FAIL / UNMEASURED with the counts, and what the reviewed plan saves.

    >>> from auditor.results import AuditResult, Finding, Settings, TraceMethod
    >>> a = AuditResult("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings(),
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


def verdict_head(audit: "AuditResult") -> str:
    """The verdict's first part, PASS / REVIEW / FAIL with the counts (the Markdown puts the saving and the
    measurement in its plan card instead), and where no plan held, that nothing can be removed
    (:func:`nothing_clause`)."""
    return _head(audit) + nothing_clause(audit)


def _head(audit: "AuditResult") -> str:
    c = audit.counts
    if c.error:
        return f"FAIL: {c.error} error(s), {c.warning} warning(s)"
    if c.warning:
        return f"REVIEW: {c.warning} warning(s)"
    if not measured(audit):
        if audit.calibration is not None:
            return "UNMEASURED: no errors or warnings, but the plan was not measured all at once"
        return "UNMEASURED: no errors or warnings; the ranks are energy-based estimates (measure with --calibration)"
    if missed(audit):
        return "REVIEW: no errors or warnings shown, but the plan measured all at once misses the tolerance"
    return "PASS: no errors or warnings"


def nothing_holds(audit: "AuditResult") -> bool:
    """The audit suggests (no plan of the user's) and no plan that factorizes a layer held the tolerance, so the
    suggested plan is empty: an answer, not a failure."""
    cal, r = audit.calibration, audit.review
    b = cal.budget if cal is not None else None
    return b is not None and not b.plan and not b.nothing_to_plan and (r is None or r.suggested)


def empty_plan_words(audit: "AuditResult") -> str:
    """Why the suggested plan factorizes nothing, as every format's plan section says it: no plan measured held
    the tolerance, no layer can be factorized, or (data-free) none is worth it at the target energy."""
    cal = audit.calibration
    if nothing_holds(audit):
        assert cal is not None
        return (f"nothing can be removed within the tolerance {tolerance_words(cal)}: no plan measured all at once "
                "holds it")
    if cal is not None and cal.budget is not None and cal.budget.nothing_to_plan:
        return "no layer of the model can be factorized"
    return "no layer is worth factorizing at the target energy"


def nothing_clause(audit: "AuditResult") -> str:
    """"; nothing can be removed within the tolerance 1%: no plan measured all at once holds it, so the suggested
    plan is empty" where :func:`nothing_holds`; else empty."""
    if not nothing_holds(audit):
        return ""
    cal = audit.calibration
    assert cal is not None
    return (f"; nothing can be removed within the tolerance {tolerance_words(cal)}: no plan measured all at once "
            "holds it, so the suggested plan is empty")


def plan_check_clause(audit: "AuditResult") -> str:
    """"; measured all at once: held-out perplexity 153.77 -> 155.17 (+0.91%, tolerance +1%): holds" (or MISSES) when
    calibration measured the reviewed plan (:func:`auditor.render.calibration.metric_change`);
    "; not measured all at once" when calibration was given but the plan could not be measured; else empty."""
    cal = audit.calibration
    r = audit.review
    if cal is None or r is None or not r.items:
        return ""
    pc = cal.plan_check
    if pc is None or pc.layers == 0 or pc.measured != pc.measured:
        return "; not measured all at once"
    v = pc.verification
    if v is not None and cal.facts.fails_above:  # its interval, read against the limit it stays under
        return "; measured all at once: " + verification_words(cal, v)
    return f"; measured all at once: {metric_change(cal, pc.measured)}: {'holds' if pc.ok else 'MISSES'}"


def in_percent(cal: "CalibrationReport") -> bool:
    """The metric is a fraction every report writes as a percentage: a relative increase (perplexity) or the
    relative output error; a metric in its own units (KL in nats, a user metric) is written as it is."""
    return cal.display == "percent"  # the metric kind's display form, carried by the report


def unit(cal: "CalibrationReport", v: float | None) -> str:
    """One measured value of the metric in its one unit, the same in every format: a relative increase as a signed
    percentage ("+0.878%"), the relative output error as a percentage ("0.968%"), three significant digits; any
    other metric as 4 significant digits; ``–`` for None or NaN (:meth:`auditor.calresults.MetricFacts.words`).

    >>> from auditor.calresults import CalibrationReport as C
    >>> c = C("c", "0.25", "", 1, 1, "relative output error", False, 0.01, 0.0)
    >>> [unit(c, x) for x in (0.009936, 0.0106, 0.4229, 10.65, 0.0)]
    ['0.994%', '1.06%', '42.3%', '1065%', '0%']
    """
    return cal.facts.words(v)


def tolerance_words(cal: "CalibrationReport") -> str:
    """The tolerance in the metric's unit: "+1%" for a relative increase, "1%" for the output error."""
    return cal.facts.tolerance_words()


def metric_change(cal: "CalibrationReport", value: float | None) -> str:
    """A measured metric in the user's units with its dense baseline and the tolerance, the same words in every
    format (:meth:`auditor.calresults.MetricFacts.change`): "held-out perplexity 153.77 -> 155.17 (+0.91%, tolerance
    +1%)" for a perplexity judged by its relative increase, "held-out accuracy 0.9 -> 0.88 (tolerance -0.05)" for a
    metric where higher is better, "relative output error 0.009937 (tolerance 0.01)" otherwise.

    >>> from auditor.calresults import CalibrationReport as C
    >>> metric_change(C("c", "0.25", "", 1, 1, "perplexity increase", False, 0.01, 153.77, increase_of="perplexity"),
    ...               0.009112)
    'held-out perplexity 153.77 -> 155.17 (+0.911%, tolerance +1%)'
    """
    return cal.facts.change(value)


def checked_change(cal: "CalibrationReport", pc: "PlanCheck") -> str:
    """:func:`metric_change` of the plan check: its measured value with the dense baseline of the rows it was measured
    on (the verification rows when the held-out rows were split)."""
    return metric_change(_on_verified_rows(cal, pc.verification), pc.measured)


def _on_verified_rows(cal: "CalibrationReport", v: "Verification | None") -> "CalibrationReport":
    """``cal`` with the dense baseline of the verification rows, where they were measured and give one."""
    if v is None or v.reference is None or not math.isfinite(v.reference):
        return cal
    from dataclasses import replace

    return replace(cal, reference=v.reference)


def unseen_words(cal: "CalibrationReport", v: "Verification", fmt: "Callable[..., str] | None" = None) -> str:
    """The interval for a document the tool never read, to follow the row interval: "; for an unseen document
    +0.61% to +1.42% (documents: 12 files)"; empty where there is none. ``fmt``: how a value is written (default
    :func:`unit`)."""
    u = v.unseen
    if u is None:
        return ""
    fmt = fmt or unit
    return f"; for an unseen document {fmt(cal, u.low)} to {fmt(cal, u.high)} ({u.label})"


def verification_words(cal: "CalibrationReport", v: "Verification") -> str:
    """The verified number in the user's units with its interval and what it says of the tolerance: "held-out
    perplexity 153.77 -> 154.97 (+0.78%, tolerance +1%); 90% interval +0.70% to +0.88% over 83 verification rows:
    within the tolerance" for a perplexity, else :meth:`Verification.words` ("relative output error 0.009656 (90%
    interval 0.009491 to 0.009816 over 128 verification rows): within the tolerance 0.01")."""
    label = cal.metric
    if in_percent(cal) and not cal.increase_of:  # the output error, in percent like every other number of it
        ci = (f"{100 * v.confidence:g}% interval {unit(cal, v.low)} to {unit(cal, v.high)} over {v.rows:,} "
              f"verification rows{unseen_words(cal, v)}" if v.low is not None and v.high is not None
              else f"on {v.rows:,} verification rows, no interval")
        return f"{label} {unit(cal, v.value)} ({ci}): {v.judged} {tolerance_words(cal)}"
    if not (cal.increase_of and cal.reference > 0):
        return v.words(cal.tolerance, label)
    judged = v.judged
    cal = _on_verified_rows(cal, v)  # the dense baseline of the rows it was measured on
    if v.low is None or v.high is None:
        return f"{metric_change(cal, v.value)} on {v.rows:,} verification rows, no interval: {judged}"
    return (f"{metric_change(cal, v.value)}; {100 * v.confidence:g}% interval {unit(cal, v.low)} to "
            f"{unit(cal, v.high)} over {v.rows:,} verification rows{unseen_words(cal, v)}: {judged}")


def exit_code(audit: "AuditResult", fail_on: FailOn | str | None = None) -> ExitCode:
    """``ExitCode.FINDINGS`` when a finding is at or above ``fail_on`` (default: the audit's settings), or with
    ``unmeasured`` when the plan was not measured or a warning or error was found; else OK.

    >>> from auditor.results import AuditResult, Finding, Settings, TraceMethod
    >>> a = AuditResult("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings(),
    ...           findings=[Finding("LR003", "narrow", Severity.WARNING, "narrow")])
    >>> exit_code(a), exit_code(a, FailOn.WARNING), exit_code(a, "never")
    (<ExitCode.OK: 0>, <ExitCode.FINDINGS: 1>, <ExitCode.OK: 0>)
    """
    level = FailOn(fail_on) if fail_on is not None else audit.settings.fail_on
    if level is FailOn.NEVER:
        return ExitCode.OK
    if level is FailOn.UNMEASURED:
        return ExitCode.FINDINGS if status(audit) is not Status.PASS else ExitCode.OK
    floor = Severity.ERROR if level is FailOn.ERROR else Severity.WARNING
    return ExitCode.FINDINGS if audit.counts.at_least(floor) else ExitCode.OK


def quiet_lines(audit: "AuditResult") -> str:
    """What ``-q`` keeps of a failing run (as ruff's ``-q`` keeps its diagnostics): the verdict line, then one line
    per warning or error finding (code, severity, layers, message, fix), names from the model made visible.

    >>> from auditor.results import AuditResult, Finding, Settings, TraceMethod
    >>> a = AuditResult("m", "x", TraceMethod.WALK, [], None, 10, [], False, Settings(),
    ...           findings=[Finding("LR003", "narrow", Severity.WARNING, "too narrow", ["fc1"], fix="Keep it")])
    >>> print(quiet_lines(a), end="")
    REVIEW: 1 warning(s)
    LR003 warning fc1: too narrow. Keep it.
    """
    from ..errors import visible

    lines = [verdict_line(audit)]
    for f in sorted(audit.findings, key=lambda f: f.sort_key()):
        if f.severity.order > Severity.WARNING.order:
            continue
        where = ", ".join(f.layers[:3]) + (f" and {len(f.layers) - 3} more" if len(f.layers) > 3 else "")
        text = f"{f.code} {f.severity}{' ' + where if where else ''}: {f.message.rstrip('.')}."
        lines.append(visible(text + (f" {f.fix.rstrip('.')}." if f.fix else "")))
    return "\n".join(lines) + "\n"


def input_errors(audit: "AuditResult") -> list["Finding"]:
    """Findings that the command line reports as bad input (exit 2, no report): each rule decides for its own."""
    from ..rules import RULES

    return [f for f in audit.findings if f.code in RULES and RULES[f.code].input_error(f)]
