"""Markdown for a pull-request comment or a CI job summary, under GitHub's comment limit.

The summary comes first (verdict, totals, findings count, plan savings); then, while they fit in
:data:`auditor.render.md_budget.DEFAULT_CAP` characters: what changed since the baseline (findings, per-layer rank
changes), the findings, the plan by block group (planned and suggested rank, real before/after counts) and the
layer groups; then one line saying how many rows and sections are left for the attached report. Every name goes
through :mod:`auditor.render.safe`, so a layer name cannot open a link, an image, a heading or raw HTML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policy import verdict_line
from ..results import Severity
from . import calibration
from .base import RenderContext
from .md_budget import DEFAULT_CAP, Section, fit_markdown
from .pages import group_rows, plan_rows, rank_changes
from .safe import md_code, md_text
from .view import fmt_num, human, layer_table, spectra_computed

if TYPE_CHECKING:
    from ..results import Audit

ICON = {Severity.ERROR: "🛑", Severity.WARNING: "⚠️", Severity.INFO: "ℹ️"}


def _summary(audit: "Audit", context: RenderContext) -> list[str]:
    c = audit.counts
    out = [f"## Low-rank audit: {md_text(audit.model_name)}", "", f"**{md_text(verdict_line(audit))}**", ""]
    macs = audit.total_macs
    out.append(f"- Parameters: **{audit.total_params:,}** unique, {audit.factorizable_params:,} factorizable in "
               f"{len(audit.layers)} layers; {audit.layers_holding(0.8)} layers hold 80%")
    out.append(f"- MACs per forward: {fmt_num(macs) if macs is not None else 'not counted (no inputs)'}")
    out.append(f"- {md_text(audit.trace_summary)}")
    out.append(f"- Findings: {c.error} error(s), {c.warning} warning(s), {c.info} info")
    rv = audit.review
    if not spectra_computed(audit):
        out.append("- Spectra were not computed: no rank is suggested")
    elif rv is not None and rv.items:
        what = "Suggested plan" if rv.suggested else f"Plan {md_code(rv.source)}"
        out.append(f"- {what}: {len(rv.items):,} layers, {rv.params_saved:,} parameters saved "
                   f"({100 * rv.share_saved:.1f}% of the model)")
        card = calibration.check_card(audit)
        if card is not None:
            out.append(f"- Measured all at once: **{md_text(card.value)}** ({md_text(card.detail)})")
    elif rv is not None:
        out.append("- No layer is worth factorizing at the target energy" if rv.suggested
                   else "- The plan factorizes nothing")
    if context.baseline is not None:
        d = context.baseline
        out.append(f"- Since the baseline: {len(d.new_findings)} new finding(s), {len(d.fixed_findings)} fixed; "
                   f"parameters saved {d.saved_before:,} → {d.saved_after:,} ({d.saved_delta:+,})")
    return out


def _baseline(audit: "Audit", context: RenderContext) -> Section | None:
    d = context.baseline
    if d is None:
        return None
    rows = [f"- new **{f['code']}**: {md_text(f['message'])}" for f in d.new_findings]
    rows += [f"- fixed **{f['code']}**: {md_text(f['message'])}" for f in d.fixed_findings]
    if d.layers_added or d.layers_removed:
        rows.append(f"- layers added: {len(d.layers_added)}, removed: {len(d.layers_removed)}")
    rows += [f"- rank {md_code(c.layer)}: {c.text()}" for c in rank_changes(audit, context.baseline_report)]
    if not rows:
        rows = ["- no finding and no planned rank changed"]
    return Section("### Since the baseline", [], rows, noun="changes", title="Since the baseline")


def _findings(audit: "Audit") -> Section | None:
    if not audit.findings:
        return None
    rows = []
    for sev in Severity:
        for f in (f for f in audit.findings if f.severity is sev):
            rows.append(f"- {ICON[sev]} **{f.code}** `{f.slug}`: {md_text(f.message)}. _{md_text(f.fix)}._")
    return Section("### Findings", [], rows, noun="findings", title="Findings")


def _plan(audit: "Audit") -> Section | None:
    rv = audit.review
    if rv is None or not rv.items:
        return None
    given = not rv.suggested
    by_layer = {p.layer: p for p in plan_rows(audit)}
    intro: list[str] = []
    if rv.suggested:
        intro += [md_text(calibration.suggested_plan_note(audit)), ""]
    intro.append("| layer | m x n | " + ("planned | suggested" if given else "rank") +
                 " | break-even | params before → after | energy kept | x |")
    intro.append("|---|---:|" + ("---:|---:|" if given else "---:|") + "---:|---:|---:|---:|")
    rows = []
    for g in group_rows(audit, layer_table(audit)):
        items = [by_layer[r.name] for r in g.members if r.name in by_layer]
        if not items:
            continue
        same = len(items) == len(g.members) and len({(p.rank, p.suggested) for p in items}) == 1 and g.shape != "mixed"
        if g.is_group and same:
            units = [(md_code(g.label) + f" ×{g.size}", g.shape, items)]
        else:
            units = [(md_code(p.layer), next(r.shape for r in g.members if r.name == p.layer), [p]) for p in items]
        for name, shape, ps in units:
            p = ps[0]
            before, after = sum(q.params_before for q in ps), sum(q.params_after for q in ps)
            flag = " ⚠️ no saving: kept dense" if p.flag else ""
            ek = "-" if p.energy_kept is None else f"{100 * p.energy_kept:.1f}%"
            ranks = f"{p.rank:,} | {fmt_num(p.suggested)}" if given else f"{p.rank:,}"
            rows.append(f"| {name} | {shape} | {ranks} | {p.break_even:.1f} | {before:,} → {after:,}{flag} | "
                        f"{ek} | {p.compression:.2f} |")
    what = "Suggested plan" if rv.suggested else f"Plan {md_code(rv.source)}"
    return Section(f"### {what}: {rv.params_saved:,} parameters saved ({100 * rv.share_saved:.1f}% of the model)",
                   intro, rows, noun="plan rows", title="Plan")


def _layers(audit: "Audit") -> Section:
    table = layer_table(audit)
    labels = [col.label for col in table.columns]
    planned = table.planned
    intro = ["Layers whose names differ only in an index form one group (`*`, ×N members); x = compression "
             "m·n / (r·(m+n)) at the " + ("planned" if planned else "suggested") + " rank (above 1 saves parameters).",
             "",
             "| # | layer | m x n | params | share | cum. | " + " | ".join(labels)
             + (" | planned | suggested" if planned else " | rank") + " | x | verdict |",
             "|---:|---|---:|---:|---:|---:|" + "---:|" * len(labels) + ("---:|---:|" if planned else "---:|")
             + "---:|---|"]
    rows = []
    for i, g in enumerate(group_rows(audit, table), 1):
        name = md_code(g.label) + (f" ×{g.size}" if g.is_group else "")
        ranks = " | ".join(g.ranks)
        rk = (f"{g.planned if g.planned != '–' else 'dense'} | {g.suggested}" if planned else g.suggested)
        rows.append(f"| {i} | {name} | {g.shape} | {g.params:,} | {100 * g.share:.1f}% | {100 * g.cumulative:.0f}% "
                    f"| {ranks} | {rk} | {fmt_num(g.compression, 2)} | {g.verdict} |")
    return Section("### Layers by parameter share", intro, rows, noun="layer groups", title="Layers")


def render(audit: "Audit", context: RenderContext = RenderContext(), cap: int = DEFAULT_CAP) -> str:
    """The Markdown report, at most ``cap`` UTF-16 units (default 60,000, under GitHub's 65,536)."""
    sections = [s for s in (_baseline(audit, context), _findings(audit), _plan(audit), calibration.markdown(audit),
                            _layers(audit)) if s]
    tail = (f"<sub>lowrank-auditor {md_text(str(audit.environment.get('lowrank-auditor')))} · torch "
            f"{md_text(str(audit.environment.get('torch')))} · MACs {human(audit.total_macs)}</sub>")
    return fit_markdown("\n".join(_summary(audit, context)), sections, cap=cap, tail=tail).text


class MarkdownReporter:
    name = "md"
    suffix = ".md"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
