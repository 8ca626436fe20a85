"""Markdown for a pull-request comment or a CI job summary: verdict, findings by severity, savings, top layers,
and what changed since the baseline when there is one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..policy import verdict_line
from ..results import Severity
from . import calibration
from .base import RenderContext
from .view import fmt_num, human, layer_table

if TYPE_CHECKING:
    from ..baseline import BaselineDiff
    from ..results import Audit

ICON = {Severity.ERROR: "🛑", Severity.WARNING: "⚠️", Severity.INFO: "ℹ️"}


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render(audit: "Audit", context: RenderContext = RenderContext(), top: int = 15) -> str:
    c = audit.counts
    out = [f"## Low-rank audit: {_esc(audit.model_name)}", "", f"**{_esc(verdict_line(audit))}**", ""]
    macs = audit.total_macs
    out.append(f"- Parameters: **{audit.total_params:,}** unique, {audit.factorizable_params:,} factorizable in "
               f"{len(audit.layers)} layers; {audit.layers_holding(0.8)} layers hold 80%")
    out.append(f"- MACs per forward: {fmt_num(macs) if macs is not None else 'not counted (no inputs)'}")
    out.append(f"- {_esc(audit.trace_summary)}")
    out.append(f"- Findings: {c.error} error(s), {c.warning} warning(s), {c.info} info")
    out.append("")
    if context.baseline is not None:
        out += _baseline_section(context.baseline)
    if audit.findings:
        out.append("### Findings")
        out.append("")
        for sev in Severity:
            for f in (f for f in audit.findings if f.severity is sev):
                out.append(f"- {ICON[sev]} **{f.code}** `{f.slug}`: {_esc(f.message)}. _{_esc(f.fix)}._")
        out.append("")
    rv = audit.review
    if rv is not None and rv.items:
        what = "Suggested plan" if rv.suggested else f"Plan `{rv.source}`"
        out.append(f"### {what}: {rv.params_saved:,} parameters saved ({100 * rv.share_saved:.1f}% of the model)")
        out.append("")
        if rv.suggested:
            out.append(f"Smallest ranks keeping {100 * audit.settings.target_energy:g}% of the spectral energy. Energy is "
                       "not accuracy: measure each layer's rank floor and budget a recovery fine-tune.")
            out.append("")
        out.append("| layer | m x n | rank | break-even | params before → after | energy kept | x |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for it in rv.items[:top]:
            l = audit.layer(it.layer)
            ek = "-" if it.energy_kept is None else f"{100 * it.energy_kept:.1f}%"
            out.append(f"| `{_esc(it.layer)}` | {l.m}x{l.n} | {it.rank} | {it.break_even:.1f} | "
                       f"{it.params_before:,} → {it.params_after:,} | {ek} | {it.compression:.2f} |")
        if len(rv.items) > top:
            out.append(f"| … {len(rv.items) - top} more | | | | | | |")
        out.append("")
    out += calibration.markdown(audit)
    table = layer_table(audit)
    labels = [col.label for col in table.columns]
    out.append("### Top layers by parameter share")
    out.append("")
    out.append("| # | layer | kind | m x n | params | share | cum. | " + " | ".join(labels) + " | verdict |")
    out.append("|---:|---|---|---:|---:|---:|---:|" + "---:|" * len(labels) + "---|")
    for r in table.rows[:top]:
        ranks = " | ".join(fmt_num(x) for x in r.ranks)
        out.append(f"| {r.rank_order} | `{_esc(r.name)}` | {r.kind} | {r.shape} | {r.params:,} | "
                   f"{100 * r.share:.1f}% | {100 * r.cumulative:.0f}% | {ranks} | {r.verdict} |")
    out.append("")
    out.append(f"<sub>lowrank-auditor {audit.environment.get('lowrank-auditor')} · torch "
               f"{audit.environment.get('torch')} · MACs {human(macs)}</sub>")
    return "\n".join(out) + "\n"


def _baseline_section(d: "BaselineDiff") -> list[str]:
    out = ["### Since the baseline", ""]
    out.append(f"- New findings: {len(d.new_findings)}; fixed: {len(d.fixed_findings)}")
    for f in d.new_findings:
        out.append(f"  - new **{f['code']}**: {_esc(f['message'])}")
    for f in d.fixed_findings:
        out.append(f"  - fixed **{f['code']}**: {_esc(f['message'])}")
    if d.layers_added or d.layers_removed:
        out.append(f"- Layers added: {', '.join(d.layers_added) or 'none'}; removed: "
                   f"{', '.join(d.layers_removed) or 'none'}")
    out.append(f"- Parameters saved: {d.saved_before:,} → {d.saved_after:,} ({d.saved_delta:+,})")
    out.append("")
    return out


class MarkdownReporter:
    name = "md"
    suffix = ".md"
    binary = False

    def render(self, audit: "Audit", context: RenderContext) -> str:
        return render(audit, context)
