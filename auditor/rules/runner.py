"""Running the rules: selection by code, prefix or slug; needs checked before a rule runs; findings sorted."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import AuditError
from ..results import Finding
from .context import Context
from .registry import BUILTIN_ORIGIN, Need, Rule

if TYPE_CHECKING:
    from ..planning.plan import Plan
    from ..results import AuditResult

# Skips worth a note: a rule the user would expect to run. A missing plan file is the normal case (the suggested
# ranks are reviewed), so LR005's skip is not noted.
_NOTED = (Need.DATA_FLOW, Need.SPECTRA)
_WHY = {
    Need.DATA_FLOW: "without a data-flow graph (the module walk links layers in call order; weights-only audits "
                    "have no graph)",
    Need.SPECTRA: "without spectra",
}


@dataclass(frozen=True)
class Skipped:
    rule: Rule
    missing: tuple[Need, ...]


@dataclass
class RuleRun:
    """The findings of a run, sorted, and the selected rules that did not run for want of something."""

    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """One line per missing need that kept rules from running, e.g. "Not run without a data-flow graph ...:
        LR007 chained-linear-maps." Skips for want of a plan file are expected and not noted."""
        out = []
        for need in _NOTED:
            names = [f"{s.rule.code} {s.rule.slug}" for s in self.skipped if need in s.missing]
            if names:
                out.append(f"Not run {_WHY[need]}: {', '.join(names)}.")
        return out


def _matches(r: Rule, token: str) -> bool:
    return r.code.startswith(token.upper()) or r.slug == token.lower()


def selected(select: Iterable[str] = (), ignore: Iterable[str] = (),
             rules: Mapping[str, Rule] | None = None) -> list[Rule]:
    """The rules to run: those matching any of ``select`` (all when empty) and none of ``ignore``. A token is a
    code, a code prefix (``LR00``) or a slug. A token that matches no rule is an error, not a silent no-op."""
    from .builtin import RULES

    pool = list((RULES if rules is None else rules).values())
    select, ignore = [t.strip() for t in select if t.strip()], [t.strip() for t in ignore if t.strip()]
    for kind, tokens in (("select", select), ("ignore", ignore)):
        for t in tokens:
            if not any(_matches(r, t) for r in pool):
                raise AuditError(f"rule {kind} {t!r} matches no rule",
                                 "Use a code (LR004), a code prefix (LR00) or a slug (energy-below-floor); "
                                 f"rules: {', '.join(r.code for r in pool)}")
    return [r for r in pool
            if (not select or any(_matches(r, t) for t in select)) and not any(_matches(r, t) for t in ignore)]


def _missing(r: Rule, ctx: Context) -> tuple[Need, ...]:
    have = {Need.DATA_FLOW: ctx.data_flow if Need.DATA_FLOW in r.needs else True,
            Need.SPECTRA: ctx.has_spectra, Need.PLAN: ctx.plan is not None}
    return tuple(n for n in sorted(r.needs) if not have[n])


def _run_one(r: Rule, ctx: Context) -> list[Finding]:
    out: list[Finding] = []

    def emit(message: str, /, layers: Iterable[str] = (), fix: str = "", **evidence: Any) -> Finding:
        f = r.finding(message, layers, fix, **evidence)
        out.append(f)
        return f

    if r.origin == BUILTIN_ORIGIN:
        r.check(ctx, emit)
        return out
    try:
        r.check(ctx, emit)
    except Exception as exc:  # noqa: BLE001 - a plugin's bug is one clear line, not a traceback
        raise AuditError(f"rule {r.code} {r.slug} from {r.origin} failed: {type(exc).__name__}: {exc}",
                         f"Report it to {r.origin}, or leave the rule out with ignore = [\"{r.code}\"]") from None
    return out


def evaluate(audit: "AuditResult", plan: "Plan | None" = None, rules: Iterable[Rule] | None = None) -> RuleRun:
    """Run ``rules`` (default: those ``audit.settings`` selects) on the audit; see :class:`RuleRun`."""
    ctx = Context(audit, plan)
    chosen = list(rules) if rules is not None else selected(audit.settings.select, audit.settings.ignore)
    run = RuleRun()
    for r in chosen:
        missing = _missing(r, ctx)
        if missing:
            run.skipped.append(Skipped(r, missing))
        else:
            run.findings.extend(_run_one(r, ctx))
    run.findings.sort(key=Finding.sort_key)
    return run


def run_rules(audit: "AuditResult", plan: "Plan | None" = None) -> list[Finding]:
    """The findings of the selected rules, sorted by severity, code, layers and message."""
    return evaluate(audit, plan).findings
