"""The rules this package declares, one module per rule (``lr004.py`` declares LR004 and owns its settings), in code
order (:data:`BUILTIN`), and :data:`RULES`, the registry that adds the rules of other packages (the
``lowrank_auditor.rules`` entry points) when first read.

A new built-in rule is one new module here, named after its code; it is found by its name. The runner and the docs
read :data:`RULES` from here; ``auditor.rules`` re-exports it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

from ..registry import Rule, RuleDefinitionError, RuleRegistry, rules_in

_MODULE = re.compile(r"^lr[0-9]{3}$")


def _declared() -> tuple[Rule, ...]:
    """Every rule module of this package, imported in name order; each must declare exactly the rule it is named
    after."""
    out: list[Rule] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not _MODULE.match(info.name):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found = rules_in(module)
        if [r.code for r in found] != [info.name.upper()]:
            raise RuleDefinitionError(f"{module.__name__} must declare exactly the rule {info.name.upper()}, "
                                      f"declares {', '.join(r.code for r in found) or 'none'}")
        out.extend(found)
    return tuple(out)


BUILTIN: tuple[Rule, ...] = _declared()
RULES: RuleRegistry = RuleRegistry(BUILTIN)


def find_rule(code_or_slug: str) -> Rule:
    """The rule with this code (``LR004``, any case) or slug (``energy-below-floor``); an
    :class:`~auditor.errors.AuditError` naming the closest rules when there is none.

    >>> find_rule("energy-below-floor").code
    'LR004'
    """
    return RULES.find(code_or_slug)
