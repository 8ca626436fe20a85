"""The anti-pattern rules: :mod:`.registry` (what a rule is, ``@rule``, the registry), :mod:`.runner` (selection,
needs, findings), :mod:`.context` (what a rule sees), :mod:`.docs` (docs/rules.md), and one module per built-in rule
in :mod:`.builtin` (``builtin/lr004.py``). Each rule has a code, a slug, a severity, a scope, what it needs, the
settings it owns (:class:`Setting`: thresholds read from ``[tool.lowrank-auditor]``, a plan's ``[thresholds]`` or
the command line) and docs in fixed sections (What it flags / Why it is bad / Example / Do instead); docs/rules.md is
generated from them.

Other packages add rules through the ``lowrank_auditor.rules`` entry-point group: the entry point names a module
that declares rules with :func:`rule`, a :class:`Rule`, or a list of them. They are loaded the first time
:data:`RULES` is read.
"""

from __future__ import annotations

from ..config import Setting
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
    "RuleDefinitionError", "RuleRegistry", "RuleRun", "Scope", "Setting", "Severity", "Skipped", "Verdict", "evaluate",
    "find_rule", "rule", "rule_doc", "rules_in", "rules_markdown", "run_rules", "selected",
]
