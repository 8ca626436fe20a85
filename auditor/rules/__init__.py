"""The anti-pattern rules, split by scope: :mod:`.model` (layers and weights), :mod:`.graph` (how layers connect)
and :mod:`.plan` (the reviewed ranks). Each rule has a code, a slug, a severity, what it needs, and docs in fixed
sections (What it flags / Why it is bad / Example / Do instead); docs/rules.md is generated from them.

Other packages add rules through the ``lowrank_auditor.rules`` entry-point group: the entry point names a module
that declares rules with :func:`rule`, a :class:`Rule`, or a list of them. They are loaded the first time
:data:`RULES` is read.
"""

from __future__ import annotations

from ..results import Severity, Verdict
from .builtin import BUILTIN, RULES, find_rule
from .context import Context, LayerInfo
from .docs import rule_doc, rules_markdown
from .registry import (
    ENTRY_POINT_GROUP,
    SECTIONS,
    Emit,
    Need,
    Rule,
    RuleDefinitionError,
    RuleRegistry,
    Scope,
    rule,
    rules_in,
)
from .runner import RuleRun, Skipped, evaluate, run_rules, selected

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "RULES", "SECTIONS", "Context", "Emit", "LayerInfo", "Need", "Rule",
    "RuleDefinitionError", "RuleRegistry", "RuleRun", "Scope", "Severity", "Skipped", "Verdict", "evaluate",
    "find_rule", "rule", "rule_doc", "rules_in", "rules_markdown", "run_rules", "selected",
]
