"""The rules this package declares, in code order (:data:`BUILTIN`), and :data:`RULES`, the registry that adds the
rules of other packages (the ``lowrank_auditor.rules`` entry points) when first read.

The runner and the docs read :data:`RULES` from here; ``auditor.rules`` re-exports it.
"""

from __future__ import annotations

from . import calibration as _calibration
from . import graph as _graph
from . import model as _model
from . import plan as _plan
from .registry import Rule, RuleRegistry, rules_in

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
