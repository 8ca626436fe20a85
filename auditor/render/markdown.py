"""Markdown for a pull-request comment or a CI job summary: read in ten seconds, under GitHub's comment limit.

The open part (what shows before any fold is expanded) stays under :data:`auditor.render.md_fit.OPEN_LIMIT`
bytes for any model: the verdict, the plan card (what the plan saves and, with calibration, its all-at-once
measurement), the findings; then the plan, the calibration and the layers. A table is shown open only when it has
at most :data:`ROWS_OPEN` rows and :data:`COLS_OPEN` columns and fits what is left of the open part; every other
table, and the findings past the first :data:`ROWS_OPEN`, sit inside ``<details>``. The whole text stays under
:data:`auditor.render.md_fit.DEFAULT_CAP` characters (rows cut last, with one line saying what is left out).

One unit convention: shares and errors are percentages, rounded by :func:`auditor.render.md_fit.percent` (one
decimal from 1% up, two significant digits below); a user metric is printed in its own units. Every name goes
through :mod:`auditor.render.safe`, so a layer name cannot open a link, an image, a heading or raw HTML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..verdict.policy import empty_plan_words, unseen_words, verdict_head
from ..results import Severity
from .parts import calibration, speed
from .base import RenderContext, Stdout
from .parts.calibration import CURVES, FINETUNE, larger_words, md_tolerance, md_value
from .parts.md_fit import COLS_OPEN, ROWS_OPEN, Room, fold_if, DEFAULT_CAP, OPEN_LIMIT, Section, fit_markdown, measure, percent
from .parts.pages import group_rows, plan_rows, rank_changes
from .parts.safe import md_code, md_text, middle
from .parts.view import factorized_count, fmt_num, human, layer_table, spectra_computed, trace_sentence

if TYPE_CHECKING:
    from ..calresults import CalibrationReport
    from ..results import AuditResult
    from .parts.calibration import CalibrationView

ICON = {Severity.ERROR: "🛑", Severity.WARNING: "⚠️", Severity.INFO: "ℹ️"}
FINDINGS_ROOM = 4_500  # bytes of findings shown open at most; the rest are folded
RESERVE = 1_200  # bytes of the open part kept for headings, <summary> lines, the closing note and the tail


def _num(x: float | int | None, digits: int = 1) -> str:
    return "\u2013" if x is None else fmt_num(x, digits)


def name(text: str, width: int = 120) -> str:
    """A model-given name in running text, cut in the middle past ``width`` characters."""
    return md_text(middle(text, width))


def _plan_card(audit: "AuditResult") -> list[str]:
    rv = audit.review
    out = []
    if rv is not None and rv.items:
        what = "suggested" if rv.suggested else md_code(middle(rv.source, 80))
        n = factorized_count(audit)
        kept = len(rv.items) - n
        out.append(f"- **Plan** ({what}): {n:,} layers factorized"
                   + (f" ({kept:,} planned at a rank that saves nothing, kept dense)" if kept else "")
                   + f", **{rv.params_saved:,} parameters "
                   f"saved** ({percent(rv.share_saved)} of {audit.total_params:,})")
        card = calibration.check_card(audit)
        if card is not None:
            icon = {"ok": "✅", "bad": "🛑"}.get(card.status, "❔")
            out.append(f"- **Measured all at once**: {icon} **{md_text(calibration.md_card_value(audit, card))}**: "
                       f"{name(card.detail, 300)}")
    elif not spectra_computed(audit):
        out.append("- **Plan**: none. Spectra were not computed, so no rank is suggested")
    elif rv is not None:
        out.append(f"- **Plan**: none; {md_text(empty_plan_words(audit))}" if rv.suggested
                   else "- **Plan**: it factorizes nothing")
    return out


def _summary(audit: "AuditResult", context: RenderContext) -> list[str]:
    c = audit.counts
    out = [f"## Low-rank audit: {name(audit.model_name)}", "", f"**{md_text(verdict_head(audit))}**", ""]
    out += _plan_card(audit)
    line = speed.summary_line(audit)  # only when the speed was measured (--measure-speed)
    if line is not None:
        out.append(f"- **Speed**: {md_text(line)}")
    out.append(f"- **Findings**: {c.error} error(s), {c.warning} warning(s), {c.info} info")
    macs = audit.total_macs
    out.append(f"- Model: {audit.total_params:,} parameters, {audit.factorizable_params:,} factorizable in "
               f"{len(audit.layers):,} layers ({audit.layers_holding(0.8):,} hold 80%); MACs per forward "
               f"{fmt_num(macs) if macs is not None else 'not counted (no inputs)'}")
    out.append(f"- {name(trace_sentence(audit), 300)}")
    if context.baseline is not None:
        d = context.baseline
        out.append(f"- Since the baseline: {len(d.new_findings)} new finding(s), {len(d.fixed_findings)} fixed; "
                   f"parameters saved {d.saved_before:,} → {d.saved_after:,} ({d.saved_delta:+,})")
    return out


def _findings(audit: "AuditResult", room: Room) -> list[Section]:
    if not audit.findings:
        return []
    rows = []
    for sev in Severity:
        for f in (f for f in audit.findings if f.severity is sev):
            rows.append(f"- {ICON[sev]} **{f.code}** `{f.slug}`: {md_text(f.message)}. _{md_text(f.fix)}._")
    k, used = 0, 0
    while k < min(len(rows), ROWS_OPEN):  # errors first, then warnings: the first ones are shown open
        size = len(rows[k].encode("utf-8")) + 1
        if used + size > min(FINDINGS_ROOM, room.left):
            break
        used += size
        k += 1
    room.left -= used
    out = [Section("### Findings", [], rows[:k], noun="findings", title="Findings")]
    if k < len(rows):
        out.append(Section("" if k else "### Findings", [], rows[k:], noun="findings",
                           title="More findings" if k else "Findings",
                           fold=f"{len(rows) - k:,} {'more ' if k else ''}finding{'s' if len(rows) - k > 1 else ''}"))
    return [s for s in out if s.rows]


def _baseline(audit: "AuditResult", context: RenderContext, room: Room) -> Section | None:
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
    s = Section("### Since the baseline", [], rows, noun="changes", title="Since the baseline")
    return fold_if(s, room, f"{len(rows):,} changes since the baseline")


def _plan(audit: "AuditResult", room: Room) -> Section | None:
    rv = audit.review
    if rv is None or not rv.items:
        return None
    given = not rv.suggested
    by_layer = {p.layer: p for p in plan_rows(audit)}
    intro: list[str] = []
    if rv.suggested:
        intro += [md_text(calibration.suggested_plan_note(audit)), ""]
    cal = audit.calibration is not None
    # with calibration, a measured layer's cell gives its measured error, the others their data-free energy
    head = ["layer", *(["planned", "suggested"] if given else ["rank"]), "break-even", "params before → after",
            "measured error, else energy kept (data-free)" if cal else "energy kept", "x"]
    intro.append("| " + " | ".join(head) + " |")
    intro.append("|---|" + "---:|" * (len(head) - 1))
    rows = []
    for g in group_rows(audit, layer_table(audit)):
        items = [by_layer[r.name] for r in g.members if r.name in by_layer]
        if not items:
            continue
        same = (len(items) == len(g.members) and len({(p.rank, p.suggested) for p in items}) == 1
                and g.shape != "mixed" and len({p.measured_error is None for p in items}) == 1)  # measured or not, all
        units = [(md_code(g.label) + f" ×{g.size}", items)] if g.is_group and same else \
            [(md_code(p.layer), [p]) for p in items]
        for label, ps in units:
            p = ps[0]
            before, after = sum(q.params_before for q in ps), sum(q.params_after for q in ps)
            flag = " ⚠️ no saving: kept dense" if p.flag else ""
            ranks = f"{p.rank:,} | {_num(p.suggested)}" if given else f"{p.rank:,}"
            errs = [q.measured_error for q in ps]
            if cal and all(errs):  # a group's members measured apart: the largest of their errors
                judge = audit.calibration.facts.shortfall  # type: ignore[union-attr]
                worst = max(range(len(ps)), key=lambda i: judge(errs[i].value) if errs[i].tier == 2 else errs[i].value)
                kept = md_text(("" if len(set(q.measured for q in ps)) == 1 else "up to ") + ps[worst].measured)
            else:
                kept = f"{percent(p.energy_kept)} energy (data-free)" if cal else percent(p.energy_kept)
            rows.append(f"| {label} | {ranks} | {p.break_even:.1f} | {before:,} → {after:,}{flag} | "
                        f"{kept} | {p.compression:.2f} |")
    what = "Suggested plan" if rv.suggested else f"Plan {md_code(middle(rv.source, 80))}"
    s = Section(f"### {what} by layer", intro, rows, noun="plan rows", title="Plan")
    return fold_if(s, room, f"{len(rows):,} plan rows, {len(head)} columns", columns=len(head))


def _layers(audit: "AuditResult", room: Room) -> Section:
    table = layer_table(audit)
    planned = table.planned
    spectra = spectra_computed(audit)
    labels = [col.label for col in table.columns] if spectra else []
    head = ["#", "layer", "m x n", "params", "share", "break-even"]
    if labels:
        head.append(" / ".join(labels))
    if spectra or planned:
        head += ["planned", "suggested"] if planned else ["rank"]
        head.append("x")
    head.append("verdict")
    intro = ["Layers whose names differ only in an index form one group (`*`, ×N members); break-even: the rank "
             "at which r·(m+n) = m·n"
             + ("; x = compression m·n / (r·(m+n)) at the " + ("planned" if planned else "suggested")
                + " rank (above 1 saves parameters)." if spectra or planned else
                "; spectra were not computed, so no rank is suggested."),
             "",
             "| " + " | ".join(head) + " |",
             "|---:|---|---:|---:|---:|---:|" + "---:|" * (len(head) - 7) + "---|"]
    rows = []
    for i, g in enumerate(group_rows(audit, table), 1):
        cells = [str(i), md_code(g.label) + (f" ×{g.size}" if g.is_group else ""), g.shape, f"{g.params:,}",
                 percent(g.share), _num(g.break_even)]
        if labels:
            cells.append(" / ".join(g.ranks))
        if spectra or planned:
            cells.append(f"{g.planned if g.planned != '–' else 'dense'} | {g.suggested}" if planned else g.suggested)
            cells.append(_num(g.compression, 2))
        cells.append(g.verdict)
        rows.append("| " + " | ".join(cells) + " |")
    s = Section("### Layers by parameter share", intro, rows, noun="layer groups", title="Layers")
    return fold_if(s, room, f"{len(rows):,} layer group{'s' if len(rows) != 1 else ''} of {len(audit.layers):,} "
                            f"layers, {len(head)} columns", columns=len(head))


# ---- calibration (:class:`auditor.render.calibration.CalibrationView`) ---------------------------------------
def _cal_search(cal: "CalibrationReport", cv: "CalibrationView") -> list[str]:
    """The search's bullets: what it asked, how many plans it measured, what it needs (recovery)."""
    b = cal.budget
    if b is None:
        return []
    lines = []
    ask = f"at most {percent(b.budget)} removed" if b.budget is not None else "the largest plan that holds"
    if b.nothing_to_plan:
        lines.append(f"- Search ({ask}): no layer of the model can be factorized, so nothing can be removed")
    elif not b.plan:
        lines.append(f"- Search ({ask}, {b.evaluations} plans measured all at once): {calibration.missed_words(b)}, "
                     "so the suggested plan is empty and every layer stays dense")
        looser = calibration.looser_line(cal)
        if looser:
            lines.append(f"- {md_text(looser)}")
    else:
        lines.append(f"- Search ({ask}, over the {CURVES.get(b.source, b.source)} curves): {b.evaluations} plans measured all at once"
                     + (f"; {md_text(larger_words(cal))}" if b.smallest_failing is not None else ""))
    line = calibration.baseline_line(cal)
    if line:
        lines.append(f"- {md_text(line)}")
    line = calibration.ties_line(cal)
    if line:
        lines.append(f"- {md_text(line)}")
    if b.exhausted:
        lines.append(f"- ⚠️ The search stopped at its cap of {b.evaluations} measurements before the boundary "
                     "was bracketed: a larger plan may hold")
    if b.fixed:
        lines.append(f"- {len(b.fixed)} layer(s) calibration did not rank keep their weight-energy rank in "
                     "every plan measured")
    note = cv.recovery_note
    if note:
        lines.append(f"- ⚠️ The suggested plan was chosen after recovery (--choose-after-recovery): it "
                     f"{md_text(note)}; it needs that fine-tune")
    cost = cv.recovery
    if cost:
        lines.append(f"- {md_text(cost)}")
    return lines


def _cal_check(cal: "CalibrationReport") -> list[str]:
    """The reviewed plan measured all at once: predicted and measured, the verification, what was left out."""
    lines = []
    pc = cal.plan_check
    if pc is not None and pc.layers == 0:
        lines.append("- The plan was not measured: factorize() cannot rewrite any of its layers")
    elif pc is not None and pc.predicted is not None:
        summed = "added up" if (pc.basis or "").endswith("which add up") else "summed in quadrature"
        lines.append(f"- Predicted {md_value(cal, pc.predicted)} "
                     f"({md_text((pc.basis or 'tier-1 layer-output errors').removesuffix(', which add up'))}"
                     f" {summed}), measured {md_value(cal, pc.measured)} all at once")
    v = pc.verification if pc is not None else None
    if v is not None:
        ci = (f" ({100 * v.confidence:g}% interval {md_value(cal, v.low)} to {md_value(cal, v.high)} over {v.rows:,} "
              f"verification rows the search never read{unseen_words(cal, v, md_value)})"
              if v.low is not None and v.high is not None
              else f" (on {v.rows:,} verification rows, no interval)")
        judged = "within" if v.ok else "straddles" if v.straddles else "misses"
        lines.append(f"- Verification: {md_text(cal.metric)} {md_value(cal, v.value)}{ci}: {judged} the tolerance "
                     f"{md_tolerance(cal)}")
    if pc is not None and pc.left_out:
        names = ", ".join(md_code(middle(n, 60)) for n in pc.left_out[:5])
        more = f" and {len(pc.left_out) - 5:,} more" if len(pc.left_out) > 5 else ""
        lines.append(f"- Not measured (factorize() cannot rewrite them): {names}{more}")
    return lines


def _cal_lines(cv: "CalibrationView") -> tuple[list[str], list[str]]:
    """The calibration bullets of the Markdown: (always open, open while they fit)."""
    cal = cv.cal
    what = "measured floors (tier 2)" if cal.measured_floors else "tier 1 (one forward pass)"
    lines = [f"- Data {md_text(middle(cal.source, 100))}: {cal.fit_rows:,} rows for statistics, "
             f"{cal.holdout_rows:,} held out ({md_text(middle(cal.holdout, 100))}); {what}; metric "
             f"{md_text(middle(cal.metric, 80))}, tolerance {md_tolerance(cal)}"
             + (" (statistics from the cache)" if cal.statistics_cached else "")]
    rounding = cv.md_rounding
    if rounding:
        lines.append(f"- {md_text(rounding)}")
    if cv.fallback:
        lines.append(f"- Sensitivity fallback: {md_text(cv.fallback)}")
    lines += _cal_search(cal, cv)
    lines += _cal_check(cal)
    if cal.missing:
        lines.append(f"- {len(cal.missing):,} layer(s) had no statistics and keep their weight-energy rank "
                     "(listed below)")
    lines.append(f"- {md_text(FINETUNE)}")
    return lines, [f"- ⚠️ {md_text(w)}" for w in cal.warnings]


def _cal_frontier(cv: "CalibrationView", room: Room) -> Section | None:
    """Every plan measured all at once (and after recovery), open while short."""
    cal = cv.cal
    b = cal.budget
    if b is None or not cv.frontier:
        return None
    head = ["parameters removed", "share", "layers", md_text(middle(cal.metric, 40)) + " (search rows)", "top-1",
            md_text(calibration.verified_head(cal)), calibration.UNIFORM_HEAD, "what happened"]
    rc = b.recovery
    if rc is not None:
        head += [f"after {rc.steps} steps", "after recovery", "recovery cost"]
    frows = []
    for r, p in zip(cv.frontier, calibration.measured_plans(cal)):
        status = r.status
        if r.chosen:
            status = (f"**{status} (holds after recovery, needs the fine-tune)**"
                      if b.chosen_after_recovery else f"**{status}**")
        more = ""
        if rc is not None:
            more = (f" {r.recovered} | {r.recovered_holds} | {md_text(r.cost)} |" if p.recovered is not None
                    else " \u2013 | \u2013 | \u2013 |")
        frows.append(f"| {r.removed} | {percent(p.removed_fraction)} | {r.layers} | {r.metric} | "
                     f"{percent(p.top1)} | {md_text(r.verified)} | {r.uniform} | {status} |{more}")
    intro = calibration.frontier_title(cal)
    if rc is not None:
        intro += (f", and again after {rc.steps} steps of recovery fine-tune (distillation on the fit rows, "
                  "measured on the held-out rows)")
    s = Section("", [intro + ":", "", "| " + " | ".join(head) + " |",
                     "|---:|---:|---:|---:|---:|---|---:|---|" + ("---:|---|---|" if rc is not None else "")], frows,
                noun="frontier plans", title="Frontier")
    return fold_if(s, room, f"Frontier: {len(frows):,} plans measured all at once", columns=len(head))


def _cal_bits(cv: "CalibrationView", room: Room) -> Section | None:
    """Rank or bits (--budget-bytes): the prose and the plans measured, open while short."""
    from .parts import rank_or_bits as bits

    intro = bits.intro(cv.cal)
    if intro is None:
        return None
    brows = [f"| {r.size} | {r.plan} | {r.nbytes} | {r.bits} | {md_text(r.value)} | {md_text(r.interval)} | "
             f"{r.holds} | {md_text(r.choices)} |" for r in bits.rows(cv.cal)]
    s = Section("#### Rank or bits", [md_text(intro), "", "| " + " | ".join(bits.HEADERS) + " |",
                                      "|---|---|---:|---:|---:|---|---|---|"], brows,
                noun="byte plans", title="Rank or bits")
    return fold_if(s, room, f"Rank or bits: {len(brows):,} plans measured all at once", columns=len(bits.HEADERS))


def _cal_layers(cv: "CalibrationView") -> Section | None:
    """The per-layer table (folded): the plan's rank, then the evidence; repeated blocks one row each, a column no
    row has a value in left out."""
    if not cv.cal.layers:
        return None
    empty = calibration.empty_columns(cv.md_rows)
    cols = [("layer", "---", lambda r: md_code(r.layer)), ("plan rank", "---:", lambda r: f"**{r.plan}**"),
            ("rows", "---:", lambda r: _count(r.rows)), ("n", "---:", lambda r: _count(r.width)),
            ("evidence: r@1% / 2% / 5% / 10%", "---:",
             lambda r: " / ".join(_count(x) if x is not None else "\u2013" for x in (r.r1, r.r2, r.r5, r.r10))),
            ("evidence: tier-1", "---:", lambda r: r.suggested), ("evidence: floor", "---:", lambda r: r.floor),
            ("cliff (rank: metric)", "---:", lambda r: r.cliff), ("x", "---:", lambda r: r.compression)]
    keys = ["layer", "plan", "rows", "n", "ranks", "tier1", "floor", "cliff", "compression"]
    cols = [c for k, c in zip(keys, cols) if k not in empty]
    lrows = ["| " + " | ".join(str(f(r)) for _, _, f in cols) + " |" for r in cv.md_rows]
    return Section("", ["Per layer (repeated blocks one row each, * for the index, \u00d7N members, a range over "
                        "them): the plan's rank (measured all at once), then the evidence: the ranks "
                        "that keep the layer-output error under 1%, 2%, 5% and 10% on the calibration data "
                        "(tier 1), the tier-1 rank for the tolerance"
                        + ("" if "floor" in empty else ", the measured floor and cliff (tier 2) and the compression "
                           "at the floor") + "; > b-e: only a rank past break-even meets it.", "",
                        "| " + " | ".join(t for t, _, _ in cols) + " |", "|" + "|".join(a for _, a, _ in cols) + "|"],
                   lrows, noun="calibrated layers", title="Calibrated layers",
                   fold=f"{len(lrows):,} calibrated layer rows, {len(cols)} columns")


def _count(v: object) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _calibration(audit: "AuditResult", room: Room) -> list[Section]:
    """The calibration sections: the bullets open, the frontier open while short, the per-layer table and the
    layers without statistics folded. ``room`` is what is left of the open part."""
    cv = calibration.view(audit)
    if cv is None:
        return []
    lines, warnings = _cal_lines(cv)
    out = []
    room.left -= sum(len(x.encode("utf-8")) + 1 for x in lines)
    if warnings and room.take(warnings):
        lines += warnings
        warnings = []
    out.append(Section("### Calibration", lines, [], noun="calibration lines", title="Calibration"))
    if warnings:
        out.append(Section("", [], warnings, noun="calibration warnings", title="Calibration warnings",
                           fold=f"{len(warnings):,} calibration warning{'s' if len(warnings) > 1 else ''}"))
    for s in (_cal_frontier(cv, room), _cal_bits(cv, room), _cal_layers(cv)):
        if s is not None:
            out.append(s)
    missing = cv.cal.missing
    if missing:
        mrows = [f"- {md_code(k)}: {md_text(v)}" for k, v in missing.items()]
        out.append(Section("", [], mrows, noun="layers without statistics", title="Layers without statistics",
                           fold=f"{len(mrows):,} layer{'s' if len(mrows) > 1 else ''} without statistics"))
    return out


def render(audit: "AuditResult", context: RenderContext = RenderContext(), cap: int = DEFAULT_CAP) -> str:
    """The Markdown report, at most ``cap`` UTF-16 units (default 60,000, under GitHub's 65,536)."""
    summary = "\n".join(_summary(audit, context))
    tail = (f"<sub>lowrank-auditor {md_text(str(audit.environment.get('lowrank-auditor')))} · torch "
            f"{md_text(str(audit.environment.get('torch')))} · MACs {human(audit.total_macs)}</sub>")
    room = Room(OPEN_LIMIT - RESERVE - len(summary.encode("utf-8")) - len(tail.encode("utf-8")))
    sections = _findings(audit, room)
    for s in (_plan(audit, room), *_calibration(audit, room), *speed.markdown(audit, room),
              _baseline(audit, context, room),
              _layers(audit, room)):
        if s is not None:
            sections.append(s)
    text = fit_markdown(summary, sections, cap=cap, tail=tail).text
    assert measure(text) <= cap
    return text


class MarkdownReporter:
    name = "md"
    suffix = ".md"
    binary = False
    stdout = Stdout.DOCUMENT

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        return render(audit, context)
