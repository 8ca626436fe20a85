"""Rule documentation in Markdown: one rule (``lowrank-audit rules LR004``) or all of them (docs/rules.md)."""

from __future__ import annotations

from typing import Iterable

from .registry import Rule


def rule_doc(r: Rule) -> str:
    """The rule's page: heading, severity, what it needs, then the fixed sections."""
    needs = f" Runs only with {' and '.join(sorted(map(str, r.needs)))}." if r.needs else ""
    lines = [f"## {r.code} {r.slug}", "", f"*Severity: {r.severity}*. {r.summary}{needs}", ""]
    for name, body in r.sections.items():
        lines += [f"### {name}", "", body, ""]
    return "\n".join(lines)


def rules_markdown(rules: Iterable[Rule] | None = None) -> str:
    """docs/rules.md: a table of the rules, then each rule's page. Default: every registered rule."""
    from . import RULES

    chosen = list(RULES.values() if rules is None else rules)
    head = ["# Rules", "",
            "Generated from the rule docstrings in `auditor/rules/` by `lowrank-audit rules --markdown`;",
            "do not edit by hand. Other packages add rules through the `lowrank_auditor.rules` entry-point group",
            "(see docs/design.md).", "", "| code | slug | severity | scope | flags |", "|---|---|---|---|---|"]
    for r in chosen:
        head.append(f"| {r.code} | {r.slug} | {r.severity} | {r.scope} | {r.summary} |")
    return "\n".join(head) + "\n\n" + "\n".join(rule_doc(r) for r in chosen)
