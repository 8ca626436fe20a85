"""View models shared by the renderers (terminal, Markdown, HTML, pandas): typed rows built from an Audit.

Rank columns follow ``settings.energy_targets``: targets (0.8, 0.9) give the columns r80 and r90.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...planning.groups import Members
from ...planning.suggest import target_key

if TYPE_CHECKING:
    from ...results import AuditResult, Finding


def rank_label(target: float) -> str:
    """The column name of an energy target's rank.

    >>> [rank_label(t) for t in (0.8, 0.9, 0.95, 0.99, 0.999, 1.0)]
    ['r80', 'r90', 'r95', 'r99', 'r99.9', 'r100']
    """
    return f"r{round(100 * target, 6):g}"


@dataclass(frozen=True)
class RankColumn:
    target: float
    label: str  # "r95"


def rank_columns(audit: "AuditResult") -> list[RankColumn]:
    return [RankColumn(t, rank_label(t)) for t in audit.settings.energy_targets]


@dataclass(frozen=True)
class LayerRow:
    """One row of the layer table."""

    rank_order: int  # 1 = largest
    name: str
    kind: str
    module_type: str
    m: int
    n: int
    groups: int
    shape: str  # "m x n", with " xGg" for grouped convs
    params: int
    share: float
    cumulative: float
    macs: int | None
    calls: int
    tied: bool
    break_even: float
    ranks: tuple[int | None, ...]  # one per rank column (energy target), None without a spectrum
    suggested: int | None
    compression: float | None
    energy_at_rank: float | None
    verdict: str
    reason: str
    stable_rank: float | None
    effective_rank: float | None
    planned: int | None = None  # the given plan's rank (None without a plan, or when the plan skips the layer)
    anchor: str = ""  # the id of the layer's own section in the HTML report

    @property
    def shown_rank(self) -> int | None:
        """The rank the report leads with: the planned one when a plan is reviewed, else the suggested one."""
        return self.planned if self.planned is not None else self.suggested

    def record(self, labels: list[str] | None = None) -> dict[str, Any]:
        """A flat dict (for pandas): the fields, with the rank columns under their labels."""
        d = asdict(self)
        d.pop("anchor")
        ranks = d.pop("ranks")
        d.update(zip(labels if labels is not None else [f"rank{i}" for i in range(len(ranks))], ranks))
        return d


@dataclass(frozen=True)
class LayerTable:
    columns: list[RankColumn]
    rows: list[LayerRow]
    planned: bool = False  # a plan the user gave is reviewed: tables lead with its ranks


def plan_outcome(verdict: Any) -> str:
    """What the plan does to a layer, as the layer tables' verdict column says it when a plan is reviewed.

    >>> from auditor.results import PlanVerdict
    >>> [plan_outcome(v) for v in PlanVerdict] + [plan_outcome(None)]
    ['factorize', 'factorize', 'kept dense', 'kept dense', 'not planned']

    "kept dense": the plan names the layer at a rank that saves nothing (the plan's flag says why); a narrow layer
    the plan factorizes is "factorize" here (LR003 and the plan table say it is narrow).
    """
    from ...results import PlanVerdict

    return {PlanVerdict.FACTORIZE: "factorize", PlanVerdict.NARROW: "factorize",
            PlanVerdict.ABOVE_MAX_RANK: "kept dense", PlanVerdict.NO_SAVING: "kept dense"}.get(verdict, "not planned")


def factorized_count(audit: "AuditResult") -> int:
    """How many of the reviewed plan's layers it factorizes (a rank that saves nothing keeps the layer dense)."""
    from ...results import PlanVerdict

    rv = audit.review
    return 0 if rv is None else sum(it.verdict in (PlanVerdict.FACTORIZE, PlanVerdict.NARROW) for it in rv.items)


def given_plan(audit: "AuditResult") -> dict[str, int]:
    """The ranks of a plan the user gave, by layer ({} without one: the suggested plan is not a given plan)."""
    rv = audit.review
    if rv is None or rv.suggested:
        return {}
    return {it.layer: it.rank for it in rv.items}


def anchors(names: list[str], prefix: str = "layer-") -> dict[str, str]:
    """A unique HTML id per name: the name with characters outside ``[A-Za-z0-9_.-]`` as ``_`` (a number added
    where two names would meet).

    >>> anchors(["h.0.fc", "h/0.fc", "a b"])
    {'h.0.fc': 'layer-h.0.fc', 'h/0.fc': 'layer-h_0.fc', 'a b': 'layer-a_b'}
    """
    out: dict[str, str] = {}
    used: set[str] = set()
    for n in names:
        base = prefix + (re.sub(r"[^A-Za-z0-9_.-]", "_", n) or "_")
        a, i = base, 1
        while a in used:
            i += 1
            a = f"{base}-{i}"
        used.add(a)
        out[n] = a
    return out


def layer_table(audit: "AuditResult") -> LayerTable:
    cols = rank_columns(audit)
    planned = given_plan(audit)
    outcome = ({it.layer: plan_outcome(it.verdict) for it in audit.review.items}
               if audit.review is not None and not audit.review.suggested else None)
    ids = anchors([l.name for l in audit.layers])
    rows = []
    for i, (layer, cum) in enumerate(zip(audit.layers, audit.cumulative())):
        sg = audit.suggestions.get(layer.name)
        sp = audit.spectra.get(layer.name)
        ranks_for = sg.ranks_for if sg else {}
        has_sigma = sp is not None and sp.sigma is not None
        rows.append(LayerRow(
            rank_order=i + 1, name=layer.name, kind=str(layer.kind), module_type=layer.module_type,
            m=layer.m, n=layer.n, groups=layer.groups,
            shape=f"{layer.m}x{layer.n}" + (f" x{layer.groups}g" if layer.groups > 1 else ""),
            params=layer.params, share=layer.share, cumulative=cum, macs=layer.macs, calls=layer.calls,
            tied=layer.tied, break_even=layer.break_even,
            ranks=tuple(ranks_for.get(target_key(c.target)) for c in cols),
            suggested=sg.rank if sg else None, compression=sg.compression if sg else None,
            energy_at_rank=sg.energy_at_rank if sg else None,
            verdict=(outcome.get(layer.name, plan_outcome(None)) if outcome is not None
                     else str(sg.verdict) if sg else ""),  # a reviewed plan: the plan's outcome, not the suggestion
            reason=sg.reason if sg else "",
            stable_rank=sp.stable_rank if has_sigma else None,
            effective_rank=sp.effective_rank if has_sigma else None,
            planned=planned.get(layer.name), anchor=ids[layer.name],
        ))
    rv = audit.review
    return LayerTable(cols, rows, planned=rv is not None and not rv.suggested)


def spectra_computed(audit: "AuditResult") -> bool:
    """Whether any layer has singular values (False with --no-spectra, or with weights on the meta device)."""
    return any(s.sigma is not None for s in audit.spectra.values())


def fmt_num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def human(x: int | None) -> str:
    if x is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return str(x)


def pct(x: float | None, digits: int = 1) -> str:
    """A fraction as a percentage, ``–`` for None.

    >>> pct(0.4567), pct(0.4567, 0), pct(None)
    ('45.7%', '46%', '–')
    """
    return "–" if x is None else f"{100 * x:.{digits}f}%"


@dataclass(frozen=True)
class FindingGroup:
    """The findings of one rule: its explanation once, then each finding."""

    code: str
    slug: str
    severity: str
    why: str  # the rule's "Why it is bad" section, one paragraph
    entries: list["Finding"]


def finding_groups(audit: "AuditResult", why: Callable[[str], str]) -> list[FindingGroup]:
    """Findings grouped by rule code, in the findings' order; ``why(code)`` gives the rule's explanation."""
    groups: dict[str, FindingGroup] = {}
    for f in audit.findings:
        if f.code not in groups:
            groups[f.code] = FindingGroup(f.code, f.slug, str(f.severity), why(f.code), [])
        groups[f.code].entries.append(f)
    return list(groups.values())


@dataclass(frozen=True)
class SkippedRow:
    name: str
    verdict: str
    reason: str


def skipped_rows(audit: "AuditResult") -> list[SkippedRow]:
    """Layers left out for want of a spectrum or of room (skipped, skip narrow), with the reason."""
    from ...results import Verdict

    return [SkippedRow(l.name, str(s.verdict), s.reason) for l in audit.layers
            if (s := audit.suggestions.get(l.name)) is not None and s.verdict in (Verdict.SKIPPED, Verdict.SKIP_NARROW)]


def share_pct(x: float | None) -> str:
    """A share (of the model's parameters, of a plan's saving) as the reports print it, in every format: one decimal
    place, two significant digits below 0.1% (so a small layer does not read 0.0%), ``–`` for None.

    >>> share_pct(0.6099), share_pct(0.61), share_pct(0.004567), share_pct(0.0000123), share_pct(0.0), share_pct(None)
    ('61.0%', '61.0%', '0.5%', '0.0012%', '0.0%', '–')
    """
    if x is None:
        return "–"
    v = 100 * x
    return f"{v:.1f}%" if v == 0 or abs(v) >= 0.1 else f"{v:.2g}%"


def _failure_clause(failure: str) -> str:
    """One tracer's failure ("torch.fx.symbolic_trace failed: ValueError: ...") as a clause without the raw
    exception; anything of another form is kept as it is."""
    for method in ("torch.fx.symbolic_trace", "torch.export"):
        if not failure.startswith(method + " "):
            continue
        rest = failure[len(method) + 1:]
        if rest.startswith("shape propagation failed"):
            return f"{method} traced the model but could not propagate shapes through it"
        if rest.startswith("failed"):
            return f"{method} could not trace the model's forward code"
        if rest.startswith("not tried: "):
            return f"{method} was not tried ({rest[len('not tried: '):]})"
    return failure


def trace_sentence(audit: "AuditResult") -> str:
    """How the layer graph was obtained, as one readable sentence for the HTML and PDF reports: tracer failures
    are said in words, their raw exceptions left to the JSON report (``trace_failures``)."""
    from ...results import TraceMethod

    m = audit.trace_method
    if m is TraceMethod.WEIGHTS:
        text = "No graph: layers inferred from tensor names and shapes (weights-only audit)"
    else:
        text = f"Traced with {m}"
        if m is TraceMethod.WALK:
            text += ": no data-flow graph, edges follow module call order"
    fails = [_failure_clause(f) for f in audit.trace_failures]
    raw = any(c != f and "could not" in c for c, f in zip(fails, audit.trace_failures))
    if fails:
        text += ", because " + " and ".join(fails)
        if raw:
            text += " (the JSON report's trace_failures gives the error)"
    return text + "."


@dataclass(frozen=True)
class SkippedGroup(Members):
    """Skipped layers of one block pattern (``layers.*.mlp.down_proj`` ×32), as the layer table groups layers."""

    label: str
    members: list[SkippedRow]
    verdict: str  # "skipped", or "skipped 30 · skip narrow 2"
    reason: str  # the members' common reason, or "" when they differ


def verdict_summary(rows: Sequence[Any]) -> str:
    """A group's verdicts in one cell: the common verdict, else each with its count in first-seen order.

    >>> from types import SimpleNamespace as S
    >>> verdict_summary([S(verdict="factorize"), S(verdict="keep dense"), S(verdict="factorize")])
    'factorize 2 · keep dense 1'
    """
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict or "–"] = counts.get(r.verdict or "–", 0) + 1
    return next(iter(counts)) if len(counts) == 1 else " · ".join(f"{v} {c}" for v, c in counts.items())


def skipped_groups(audit: "AuditResult", rows: list[SkippedRow] | None = None) -> list[SkippedGroup]:
    """The skipped layers grouped by block (:func:`auditor.planning.groups.group_layers`), largest group first."""
    from ...planning.groups import group_layers

    rows = skipped_rows(audit) if rows is None else rows
    by_name = {r.name: r for r in rows}
    layers = [l for l in audit.layers if l.name in by_name]
    out = []
    for g in group_layers(layers, audit.total_params):
        members = [by_name[n] for n in g.members]
        reasons = {r.reason for r in members}
        out.append(SkippedGroup(g.label, members, verdict_summary(members), reasons.pop() if len(reasons) == 1 else ""))
    return out
