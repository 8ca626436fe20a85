"""The anti-pattern rules, split by scope: :mod:`.model` (layers and weights), :mod:`.graph` (how layers connect)
and :mod:`.plan` (the reviewed ranks). Each rule has a code, a slug, a severity, what it needs, and docs in fixed
sections (What it flags / Why it is bad / Example / Do instead); docs/rules.md is generated from them.

Other packages add rules through the ``lowrank_auditor.rules`` entry-point group: the entry point names a module
that declares rules with :func:`rule`, a :class:`Rule`, or a list of them. They are loaded the first time
:data:`RULES` is read.
"""

from __future__ import annotations

from ..results import Severity, Verdict
from . import calibration as _calibration
from . import graph as _graph
from . import model as _model
from . import plan as _plan
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

# The rules this package declares, in code order; RULES adds the plugins' when first read.
BUILTIN: tuple[Rule, ...] = tuple(sorted((*rules_in(_model), *rules_in(_graph), *rules_in(_plan),
                                          *rules_in(_calibration)),
                                         key=lambda r: r.code))
RULES: RuleRegistry = RuleRegistry(BUILTIN)


def find_rule(code_or_slug: str) -> Rule:
    """The rule with this code (``LR004``, any case) or slug (``energy-below-floor``); an
    :class:`~auditor.errors.AuditError` naming the closest rules when there is none.

    >>> find_rule("energy-below-floor").code
    'LR004'
    """
    return RULES.find(code_or_slug)


__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "RULES", "SECTIONS", "Context", "Emit", "LayerInfo", "Need", "Rule",
    "RuleDefinitionError", "RuleRegistry", "RuleRun", "Scope", "Severity", "Skipped", "Verdict", "evaluate",
    "find_rule", "rule", "rule_doc", "rules_in", "rules_markdown", "run_rules", "selected",
]
