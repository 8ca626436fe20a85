"""Rule documentation in Markdown: one rule (``lowrank-audit rules LR004``) or all of them (docs/rules.md)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from .registry import BUILTIN_ORIGIN, ENTRY_POINT_GROUP, Rule

# Where the rules are documented: docs/rules.md in this project's source tree, with the rule's heading anchor
# (``docs/rules.md#lr004-energy-below-floor``). pyproject.toml names no project URL, so no web address is claimed;
# $LOWRANK_AUDITOR_DOCS_URL gives the absolute address of a published copy (SARIF's helpUri needs one).
DOCS_URL = "docs/rules.md"


def rule_anchor(r: Rule) -> str:
    """The anchor GitHub gives the rule's heading ``## LR004 energy-below-floor`` in docs/rules.md: lower case,
    spaces as hyphens, punctuation other than ``-`` and ``_`` dropped.

    >>> from auditor.rules import find_rule
    >>> rule_anchor(find_rule("LR004"))
    'lr004-energy-below-floor'
    """
    return re.sub(r"[^\w\- ]", "", f"{r.code} {r.slug}".lower()).replace(" ", "-")


def rule_url(r: Rule) -> str | None:
    """The address of the rule's page in docs/rules.md; None for a plugin's rule (its docs live with the plugin).

    >>> from auditor.rules import find_rule
    >>> rule_url(find_rule("LR001")).endswith("docs/rules.md#lr001-rank-at-or-above-break-even")
    True
    """
    if r.origin != BUILTIN_ORIGIN:
        return None
    return f"{os.environ.get('LOWRANK_AUDITOR_DOCS_URL') or DOCS_URL}#{rule_anchor(r)}"

# The example plugin that docs/rules.md shows; tests/test_rules_registry.py installs and runs this very text.
PLUGIN_EXAMPLE = '''\
from auditor.rules import Need, Scope, Setting, Severity, rule

BIG = Setting("big_layer_weights", 1_000_000, "layers with more weights than this are flagged", low=1)


@rule("XY001", "big-layer", Severity.WARNING, scope=Scope.MODEL, needs={Need.SPECTRA}, settings=[BIG])
def big_layer(ctx, emit):
    """A layer with more than `big_layer_weights` weights that factorizes, left dense by the plan.

    ## What it flags
    Layers above `big_layer_weights` weights (default a million) that the spectral audit can factorize and the
    reviewed plan leaves dense (without a plan file, the suggested ranks are reviewed).

    ## Why it is bad
    They hold the parameters; leaving them dense caps the saving.

    ## Example
    A 4096 x 1024 projection of rank 64.

    ## Do instead
    Add it to the plan at the suggested rank.
    """
    limit = ctx.setting(BIG)
    for layer, spectrum, suggestion, planned in ctx.each_layer():
        if layer.params > limit and not planned and suggestion and suggestion.rank:
            emit(f"{layer.name} ({layer.params:,} weights) is left dense", [layer.name],
                 f"Plan it at rank {suggestion.rank}", params=layer.params, rank=suggestion.rank)
'''

WRITING_A_RULE = f"""## Writing a rule

A rule is a function `check(ctx, emit)` under `@rule(code, slug, severity, scope=..., needs=...)`. Its docstring
is its documentation: a summary line, then the sections {{sections}}.

- `ctx` holds the audit and the plan, with the lookups rules share: `ctx.plan_items()` yields each reviewed plan
  item with its layer, `ctx.each_layer()` each layer with its spectrum, suggestion and whether it is planned;
  `ctx.layer(name)`, `ctx.planned`, `ctx.chains` and `ctx.settings`.
- `emit(message, layers, fix, **evidence)` records a finding with the rule's code, slug and severity.
- `needs={{{{Need.DATA_FLOW}}}}` (or `Need.SPECTRA`, `Need.PLAN`): without it the rule is not run, and the audit's
  notes say so.
- `settings=[Setting(name, default, doc, low=..., high=...)]`: the thresholds the rule owns; it reads one with
  `ctx.setting(SETTING)`. They are set like the global settings: `[tool.lowrank-auditor]` in pyproject.toml, a
  plan's `[thresholds]`, or `overrides` of `auditor.audit`, and checked the same way (a bad value or a name no rule
  declares is one line, exit 2). Reports list them with the other settings; the rule's page shows them.

Built-in rules live in `auditor/rules/builtin/`, one module per rule named after its code (`lr004.py`); each needs
a failing and a passing row in `tests/test_rules_table.py`. Another package adds rules with an entry point in the group
`{ENTRY_POINT_GROUP}` that names a module declaring rules (or a rule, or a list of them):

```toml
# the plugin's pyproject.toml
[project.entry-points."{ENTRY_POINT_GROUP}"]
big = "my_rules"
```

```python
# my_rules.py
{{example}}```

A plugin that fails to load, or reuses a code or slug, stops the audit with one line naming it (exit 2).
"""


def _shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ", ".join(map(_shown, value)) or "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def rule_doc(r: Rule) -> str:
    """The rule's page: heading, severity, what it needs, the fixed sections, then the settings it owns."""
    needs = f" Runs only with {' and '.join(sorted(map(str, r.needs)))}." if r.needs else ""
    lines = [f"## {r.code} {r.slug}", "", f"*Severity: {r.severity}*. {r.summary}{needs}", ""]
    for name, body in r.sections.items():
        lines += [f"### {name}", "", body, ""]
    if r.settings:
        lines += ["### Settings", "", "| setting | default | allowed | what it does |", "|---|---|---|---|"]
        lines += [f"| `{s.name}` | {_shown(s.default)} | {s.range_text} | {s.doc} |" for s in r.settings]
        lines += [""]
    return "\n".join(lines)


def rules_markdown(rules: Iterable[Rule] | None = None) -> str:
    """docs/rules.md: a table of the rules, then each rule's page. Default: every registered rule."""
    from .builtin import RULES

    chosen = list(RULES.values() if rules is None else rules)
    head = ["# Rules", "",
            "Generated from the rule docstrings in `auditor/rules/` by `lowrank-audit rules --markdown`;",
            "do not edit by hand. Other packages add rules too: see [Writing a rule](#writing-a-rule).", "",
            "A rule's settings (the table on its page) are set in `[tool.lowrank-auditor]` of pyproject.toml or in a",
            "plan's `[thresholds]`; `energy_floor` also with `--energy-floor`.", "", "| code | slug | severity | scope | flags |", "|---|---|---|---|---|"]
    for r in chosen:
        head.append(f"| [{r.code}](#{rule_anchor(r)}) | {r.slug} | {r.severity} | {r.scope} | {r.summary} |")
    from .registry import SECTIONS

    howto = WRITING_A_RULE.format(sections=", ".join(SECTIONS), example=PLUGIN_EXAMPLE)
    return "\n".join(head) + "\n\n" + "\n".join(rule_doc(r) for r in chosen) + "\n" + howto
