"""The calibration section of every report (``Audit.calibration``): JSON block, Markdown and terminal lines, and the
HTML section's data (per-layer measured curves and the frontier chart). Plain data in, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..policy import checked_change, metric_change
from .md_budget import Section, percent
from .safe import md_code, md_text, middle, term
from .view import pct

if TYPE_CHECKING:
    from ..calresults import CalibrationReport
    from ..results import Audit

FINETUNE = "A recovery fine-tune follows factorization: these numbers are before it."


def json_block(audit: "Audit") -> dict[str, Any]:
    """``{"calibration": ...}`` when the audit has calibration, else nothing (older reports are unchanged)."""
    return {"calibration": audit.calibration.to_dict()} if audit.calibration is not None else {}


def measured_points(audit: "Audit") -> dict[str, list[tuple[int, float]]] | None:
    """Per layer, the tier-2 (rank, metric) points for the layer pages' ``measured`` hook; None without them."""
    cal = audit.calibration
    pts = cal.measured_points() if cal is not None else {}
    return pts or None


def _g(x: float | None, digits: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def summary(cal: "CalibrationReport") -> str:
    what = "measured floors (tier 2)" if cal.measured_floors else "tier 1 (one forward pass)"
    return (f"Calibration {cal.source}: {cal.fit_rows:,} rows for statistics, {cal.holdout_rows:,} held out "
            f"({cal.holdout}); {what}; metric {cal.metric}, tolerance {cal.tolerance:g}"
            + (" (statistics from the cache)" if cal.statistics_cached else ""))


CURVES = {"tier1": "tier-1", "measured": "measured-floor", "probed": "sensitivity-scaled tier-1",
          "gradient": "gradient-predicted"}


def basis(cal: "CalibrationReport") -> str:
    b = cal.budget
    curves = ("measured-floor" if cal.measured_floors else
              "sensitivity-scaled tier-1" if cal.budget is not None and cal.budget.source == "probed"
              else "gradient-predicted" if cal.budget is not None and cal.budget.source == "gradient" else "tier-1")
    probed = sum(len(lc.probes) for lc in cal.layers.values())
    how = ""
    if curves.startswith("sensitivity") and probed:
        n = sum(1 for lc in cal.layers.values() if lc.probes)
        how = (f"; each layer's layer-output error times its model-level sensitivity, measured with the layer "
               f"truncated alone: {n} layers, {probed} evaluations")
    if curves == "gradient-predicted":
        how = ("; each layer's model-level cost at every rank predicted from the output-gradient second moment "
               "beside its input statistics, one backward pass")
    if b is None:
        return ("Suggested ranks: the data-aware rank for "
                f"{100 * (cal.tolerance if not cal.higher_is_better else 0.01):g}% layer-output error on the "
                "calibration data (weight energy only where calibration did not reach a layer).")
    cap = f", at most {100 * b.budget:g}% of the parameters removed" if b.budget is not None else ""
    fixed = (f"; {len(b.fixed)} layer(s) calibration did not rank keep their weight-energy rank and are in every "
             "plan measured" if b.fixed else "")
    return (f"Suggested ranks: the largest plan that holds the tolerance all at once{cap}, searched over the {curves} "
            f"curves ({b.evaluations} plans factorized and measured on the held-out rows{how}); per-layer floors and "
            f"tier-1 ranks are evidence, not the plan{fixed}.")


def suggested_plan_note(audit: "Audit") -> str:
    """Where the suggested ranks come from, in one sentence for the plan section of every report."""
    cal = audit.calibration
    if cal is not None:
        return (basis(cal) + " Rounded up to a multiple of "
                f"{audit.settings.align} while below break-even; a recovery fine-tune follows.")
    return (f"Smallest rank keeping {100 * audit.settings.target_energy:g}% of the spectral energy, rounded up to a "
            f"multiple of {audit.settings.align} while below break-even. Energy is not accuracy: measure each layer's "
            "rank floor (--calibration) and budget a recovery fine-tune before adopting it.")


def plan_line(cal: "CalibrationReport") -> str | None:
    pc = cal.plan_check
    if pc is None:
        return None
    if pc.layers == 0:
        return "The plan was not measured: factorize() cannot rewrite any of its layers."
    basis = pc.basis or "tier-1 layer-output errors"
    summed = "added up" if basis.endswith("which add up") else "summed in quadrature"
    basis = basis.removesuffix(", which add up")  # said once, by `summed`
    pred = f"predicted {_g(pc.predicted)} (the {basis} {summed}), " if pc.predicted is not None else ""
    top1 = f", top-1 agreement {pct(pc.top1)}" if pc.top1 is not None else ""
    left = f"; not measured: {', '.join(pc.left_out)}" if pc.left_out else ""
    v = pc.verification
    if v is not None:
        ci = (f" ({100 * v.confidence:g}% interval {_g(v.low)} to {_g(v.high)})" if v.low is not None
              and v.high is not None else " (no interval)")
        judged = "holds" if v.ok else "STRADDLES" if v.straddles else "MISSES"
        return (f"Plan applied all at once ({pc.layers} layers, {pc.removed:,} parameters removed): {cal.metric} "
                f"{pred}measured {_g(pc.measured)} on {v.rows:,} verification rows the search never read{ci}"
                f"{top1}: {judged} the tolerance {cal.tolerance:g}{left}.")
    return (f"Plan applied all at once ({pc.layers} layers, {pc.removed:,} parameters removed): {cal.metric} "
            f"{pred}measured {_g(pc.measured)}{top1}: {'holds' if pc.ok else 'MISSES'} the tolerance "
            f"{cal.tolerance:g}; {checked_change(cal, pc)}{left}.")


def rounding_line(cal: "CalibrationReport", value: Any = None) -> str | None:
    """What rounding alone costs a bfloat16 / float16 model (every plannable layer at full rank), in one sentence;
    None when it was not measured (float32 / float64 weights). ``value`` writes a number in the report's units."""
    f = cal.rounding_floor
    if f is None:
        return None
    v = value or _g
    share = f"{100 * f.share:.0f}%" if math.isfinite(f.share) else "all of it" if f.share > 0 else "not a number"
    return (f"{f.dtype} rounding alone ({f.layers} layer{'s' if f.layers != 1 else ''} factorized at full rank, "
            f"nothing dropped): {v(f.used)} of the tolerance {v(f.tolerance)} ({share}); plans are judged against "
            "the whole tolerance, this rounding included.")


@dataclass(frozen=True)
class CalRow:
    layer: str
    rows: int
    width: int
    r1: int | None
    r2: int | None
    r5: int | None
    r10: int | None
    suggested: str  # evidence: the tier-1 rank for the tolerance ("> b-e": none below break-even holds it)
    floor: str  # evidence: the measured floor (tier 2)
    cliff: str
    compression: str
    plan: str = "dense"  # the plan's rank, what every report leads with ("dense": the plan keeps the layer)


ABOVE_BE = "> b-e"  # evidence past break-even: the layer-output error needs a rank that saves nothing


def plan_ranks(audit: "Audit") -> dict[str, int]:
    """The reviewed plan's rank per layer (the suggested plan, or the one given) where it factorizes the layer; a
    layer the plan leaves dense, or plans at a rank that saves nothing, is absent."""
    from ..results import PlanVerdict

    rv = audit.review
    if rv is None:
        return {}
    return {it.layer: it.rank for it in rv.items if it.verdict in (PlanVerdict.FACTORIZE, PlanVerdict.NARROW)}


def rows(cal: "CalibrationReport", value: Callable[[float | None], str] = _g, times: str = "x",
         plan: dict[str, int] | None = None) -> list[CalRow]:
    """The per-layer rows of every format; ``value`` writes a metric (the cliff's), ``times`` follows a
    compression ("2.50x"; the Markdown's column header says it); ``plan`` (:func:`plan_ranks`) gives the plan
    column. The tier-1 rank and the floor are evidence: past break-even they read "> b-e", never "keep dense",
    since the plan (measured all at once) may still factorize the layer."""
    out = []
    plan = plan or {}
    for name, lc in cal.layers.items():
        f = lc.floor
        floor = cliff = comp = "\u2013"
        if f is not None:
            floor = ABOVE_BE if f.keep_dense else (str(f.floor) if f.floor is not None else "\u2013")
            if f.cliff_rank is not None:
                cliff = f"{f.cliff_rank}: {value(f.cliff_metric)}"
            comp = f"{f.compression:.2f}{times}" if f.compression is not None else "\u2013"
        rf = lc.ranks_for
        out.append(CalRow(name, lc.rows, lc.width, rf.get("0.01"), rf.get("0.02"), rf.get("0.05"), rf.get("0.1"),
                          str(lc.suggested) if lc.suggested is not None else ABOVE_BE, floor, cliff, comp,
                          str(plan[name]) if name in plan else "dense"))
    return out


@dataclass(frozen=True)
class MeasuredError:
    """What calibration measured for one layer at one rank: ``value`` (a fraction, or the metric's own units when
    higher is better), ``exact`` (False: an upper bound, the error at the largest rank measured below this one),
    ``tier`` (2: the model's metric with this layer alone truncated; 1: the layer's output error)."""

    value: float
    exact: bool
    tier: int

    def text(self, cal: "CalibrationReport") -> str:
        """"0.41% (tier 2, layer alone)", "≤ 0.80% (tier 1, layer output)"."""
        v = _g(self.value) if self.tier == 2 and cal.higher_is_better else percent(self.value)
        what = "tier 2, layer alone" if self.tier == 2 else "tier 1, layer output"
        bound = "" if self.exact else "\u2264 "
        return f"{bound}{v} ({what})"


def measured_error(cal: "CalibrationReport | None", layer: str, rank: int) -> MeasuredError | None:
    """The measured number behind a calibrated layer's rank: the tier-2 point at that rank if one was measured,
    else the tier-1 layer-output error there (an upper bound from the curve's point at the next rank below, the
    error falling with the rank); None where calibration did not reach the layer or did not see all its inputs."""
    lc = cal.layers.get(layer) if cal is not None else None
    if lc is None or not lc.spans:
        return None
    if lc.floor is not None:
        for r, v in lc.floor.points:
            if r == rank and math.isfinite(v):
                return MeasuredError(float(v), True, 2)
    below = [(r, e) for r, e in lc.curve if r <= rank and math.isfinite(e)]
    if not below:
        return None
    r, e = max(below)
    return MeasuredError(float(e), r == rank, 1)


def budget_lines(cal: "CalibrationReport") -> list[str]:
    b = cal.budget
    if b is None:
        return []
    ask = f"at most {100 * b.budget:g}% removed" if b.budget is not None else "the largest the tolerance allows"
    over = CURVES.get(b.source, b.source)
    top1 = f", top-1 {pct(b.top1)}" if b.top1 is not None else ""
    note = cal.recovery_note()
    if b.nothing_to_plan:
        out = [f"Plan ({ask}): none needed; no layer of the model can be factorized, so nothing can be removed."]
    elif not b.plan:
        out = [f"Plan that holds ({ask}, over {over} curves, {b.evaluations} plans measured): none; every plan "
               "measured missed the tolerance, so the suggestion keeps every calibrated layer dense."]
    elif note:
        out = [f"Plan chosen after recovery ({ask}, over {over} curves, --choose-after-recovery): {len(b.plan)} "
               f"layers, {b.removed:,} parameters removed ({pct(b.removed_fraction)}); it {note} (measured all "
               f"at once{top1} before it). It needs that fine-tune."
               + (f" The smallest larger plan recovered ({b.smallest_failing:,} removed) does not hold after it."
                  if b.smallest_failing is not None else "")]
    else:
        out = [f"Plan that holds ({ask}, over {over} curves, {b.evaluations} plans measured): {len(b.plan)} "
               f"layers, {b.removed:,} parameters removed ({pct(b.removed_fraction)}); {metric_change(cal, b.metric)} "
               f"measured all at once{top1}: {'holds' if b.ok else 'MISSES'} the tolerance"
               + (f"; the smallest larger plan measured ({b.smallest_failing:,} removed) does not."
                  if b.smallest_failing is not None else ".")]
    if b.exhausted:
        out.append(f"The search stopped at its cap of {b.evaluations} measurements before the boundary was "
                   "bracketed: a larger plan may hold.")
    out.append("Frontier (all at once): " + ", ".join(
        f"{pct(p.removed_fraction)} removed \u2192 {_g(p.metric)}{'' if p.ok else ' (fails)'}"
        + (f", after recovery {_g(p.recovered.metric)}{'' if p.recovered.ok else ' (fails)'}"
           if p.recovered is not None else "") for p in b.frontier))
    line = recovery_cost(cal)
    if line:
        out.append(line)
    return out


def recovery_cost(cal: "CalibrationReport") -> str:
    """What the recovered curve cost: the settings, and steps, rows (tokens) and seconds per plan; empty without
    --recover."""
    b = cal.budget
    rc = b.recovery if b is not None else None
    if rc is None:
        return ""
    recs = [p.recovered for p in b.frontier if p.recovered is not None]
    if not recs:
        return f"Recovery ({rc.steps} steps): no frontier plan factorizes a layer, nothing was recovered."
    per = ", ".join(f"{pct(p.removed_fraction)}: {p.recovered.steps} steps, {p.recovered.rows:,} rows "
                    f"({p.recovered.tokens:,} tokens), {p.recovered.seconds:.1f} s"
                    + (f" (stopped: {p.recovered.stopped})" if p.recovered.stopped else "")
                    for p in b.frontier if p.recovered is not None)
    choose = ("the suggestion is chosen on the recovered curve" if rc.choose_after
              else "the suggestion is the plan that holds before it; the recovered numbers are evidence")
    return (f"Recovery per frontier plan: {rc.steps} steps of distillation toward the dense model on the fit rows "
            f"(lr {rc.lr:g}, {rc.trainable}, objective {rc.objective}, seed {rc.seed}), from the whitened factors, "
            f"measured on the held-out rows; {choose}. Cost per plan: {per}; {rc.seconds:.1f} s in all.")


@dataclass(frozen=True)
class CheckCard:
    value: str
    detail: str
    status: str  # "ok" | "bad" | "unknown"


def check_card(audit: "Audit") -> CheckCard | None:
    """The summary card of the reviewed plan's all-at-once measurement; None without calibration or a plan."""
    cal = audit.calibration
    rv = audit.review
    if cal is None or rv is None or not rv.items:
        return None
    pc = cal.plan_check
    if pc is None or pc.layers == 0 or not math.isfinite(pc.measured):
        return CheckCard("not measured", "factorize() could not rewrite the plan's layers", "unknown")
    top1 = f"; top-1 agreement {pct(pc.top1)}" if pc.top1 is not None else ""
    f = cal.rounding_floor
    if f is not None:
        top1 += f"; {f.dtype} rounding alone: {_g(f.used)} of the tolerance {f.tolerance:g}"
    sign = "\u2264" if pc.ok else ">"
    return CheckCard(f"{_g(pc.measured, 2)} {sign} {cal.tolerance:g}" if not cal.higher_is_better
                     else f"{_g(pc.measured)} (dense {_g(cal.reference)})",
                     (f"{checked_change(cal, pc)}; {cal.holdout_rows:,} held-out rows"  # with its baseline
                      if cal.reference > 0 or cal.higher_is_better
                      else f"{cal.metric} on {cal.holdout_rows:,} held-out rows")
                     + f", {pc.layers} layers at once: "
                     f"{'holds' if pc.ok else 'misses the tolerance'}{top1}", "ok" if pc.ok else "bad")


@dataclass(frozen=True)
class FrontierRow:
    removed: str
    share: str
    layers: int
    metric: str
    top1: str
    holds: str
    chosen: bool
    recovered: str = ""  # the metric after the recovery fine-tune ("" without --recover)
    recovered_holds: str = ""  # "holds" | "fails" after it
    cost: str = ""  # "200 steps, 1,600 rows (102,400 tokens), 12.3 s"


def frontier_rows(cal: "CalibrationReport") -> list[FrontierRow]:
    """Every frontier plan (each measured all at once), fewest parameters removed first; ``chosen`` marks the plan
    the suggestion is; with --recover, each plan's metric after the fine-tune and what it cost."""
    b = cal.budget
    if b is None:
        return []
    out = []
    for p in b.frontier:
        rec = p.recovered
        chosen = p.removed == b.removed and bool(b.plan) and (p.ok == b.ok or b.chosen_after_recovery)
        extra = ((_g(rec.metric), "holds" if rec.ok else "fails",
                  f"{rec.steps} steps, {rec.rows:,} rows ({rec.tokens:,} tokens), {rec.seconds:.1f} s")
                 if rec is not None else ("\u2013" if b.recovery is not None else "", "", ""))
        out.append(FrontierRow(f"{p.removed:,}", pct(p.removed_fraction), p.layers, _g(p.metric),
                               pct(p.top1) if p.top1 is not None else "\u2013", "holds" if p.ok else "fails",
                               chosen, *extra))
    return out


def frontier_series(cal: "CalibrationReport") -> dict[str, list[tuple[float, float, bool]]]:
    """The frontier chart's data: ``before`` (each plan measured all at once) and, with --recover, ``after`` (the
    same plans after the recovery fine-tune), as (share removed, metric, holds), finite values only."""
    b = cal.budget
    if b is None:
        return {"before": [], "after": []}
    before = [(p.removed_fraction, p.metric, p.ok) for p in b.frontier if math.isfinite(p.metric)]
    after = [(p.removed_fraction, p.recovered.metric, p.recovered.ok) for p in b.frontier
             if p.recovered is not None and math.isfinite(p.recovered.metric)]
    return {"before": before, "after": after}


def md_value(cal: "CalibrationReport", v: float | None) -> str:
    """The metric as the Markdown writes it: the relative output error (lower is better) as a percentage, like
    every share and error there; a user metric (higher is better) in its own units, 4 significant digits."""
    if v is None or not math.isfinite(v):
        return "\u2013"
    return _g(v) if cal.higher_is_better else percent(v)


def md_tolerance(cal: "CalibrationReport") -> str:
    return f"{cal.tolerance:g}" if cal.higher_is_better else percent(cal.tolerance)


def md_card_value(audit: "Audit", card: CheckCard) -> str:
    """The plan card's measurement in the Markdown's units ("0.58% \u2264 1.0%"); ``card.value`` when unmeasured."""
    cal, pc = audit.calibration, audit.calibration.plan_check if audit.calibration is not None else None
    if cal is None or pc is None or card.status == "unknown":
        return card.value
    if cal.higher_is_better:
        return f"{md_value(cal, pc.measured)} (dense {md_value(cal, cal.reference)}, tolerance {md_tolerance(cal)})"
    sign = "\u2264" if pc.ok else ">"
    return f"{md_value(cal, pc.measured)} {sign} {md_tolerance(cal)}"


def _md_lines(cal: "CalibrationReport") -> tuple[list[str], list[str]]:
    """The calibration bullets of the Markdown: (always open, open while they fit)."""
    what = "measured floors (tier 2)" if cal.measured_floors else "tier 1 (one forward pass)"
    lines = [f"- Data {md_text(middle(cal.source, 100))}: {cal.fit_rows:,} rows for statistics, "
             f"{cal.holdout_rows:,} held out ({md_text(middle(cal.holdout, 100))}); {what}; metric "
             f"{md_text(middle(cal.metric, 80))}, tolerance {md_tolerance(cal)}"
             + (" (statistics from the cache)" if cal.statistics_cached else "")]
    rounding = rounding_line(cal, lambda x: md_value(cal, x) if not cal.higher_is_better else _g(x))
    if rounding:
        lines.append(f"- {md_text(rounding)}")
    b = cal.budget
    if b is not None:
        ask = f"at most {percent(b.budget)} removed" if b.budget is not None else "the largest plan that holds"
        if b.nothing_to_plan:
            lines.append(f"- Search ({ask}): no layer of the model can be factorized, so nothing can be removed")
        elif not b.plan:
            lines.append(f"- Search ({ask}): none of the {b.evaluations} plans measured all at once holds the "
                         "tolerance, so every calibrated layer stays dense")
        else:
            lines.append(f"- Search ({ask}, over the {CURVES.get(b.source, b.source)} curves): {b.evaluations} plans measured all at once"
                         + (f"; the smallest larger plan measured ({b.smallest_failing:,} parameters removed) "
                            "misses the tolerance" if b.smallest_failing is not None else ""))
        if b.exhausted:
            lines.append(f"- ⚠️ The search stopped at its cap of {b.evaluations} measurements before the boundary "
                         "was bracketed: a larger plan may hold")
        if b.fixed:
            lines.append(f"- {len(b.fixed)} layer(s) calibration did not rank keep their weight-energy rank in "
                         "every plan measured")
        note = cal.recovery_note()
        if note:
            lines.append(f"- ⚠️ The suggested plan was chosen after recovery (--choose-after-recovery): it "
                         f"{md_text(note)}; it needs that fine-tune")
        cost = recovery_cost(cal)
        if cost:
            lines.append(f"- {md_text(cost)}")
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
              "verification rows the search never read)" if v.low is not None and v.high is not None
              else f" (on {v.rows:,} verification rows, no interval)")
        judged = "within" if v.ok else "straddles" if v.straddles else "misses"
        lines.append(f"- Verification: {md_text(cal.metric)} {md_value(cal, v.value)}{ci}: {judged} the tolerance "
                     f"{md_tolerance(cal)}")
    if pc is not None and pc.left_out:
        names = ", ".join(md_code(middle(n, 60)) for n in pc.left_out[:5])
        more = f" and {len(pc.left_out) - 5:,} more" if len(pc.left_out) > 5 else ""
        lines.append(f"- Not measured (factorize() cannot rewrite them): {names}{more}")
    if cal.missing:
        lines.append(f"- {len(cal.missing):,} layer(s) had no statistics and keep their weight-energy rank "
                     "(listed below)")
    lines.append(f"- {md_text(FINETUNE)}")
    return lines, [f"- ⚠️ {md_text(w)}" for w in cal.warnings]


def markdown(audit: "Audit", room: Any = None) -> list[Section]:
    """The calibration sections of the Markdown report: the bullets open, the frontier open while short, the
    per-layer table and the layers without statistics folded. ``room`` (:class:`auditor.render.markdown.Room`)
    is what is left of the open part; without it, the optional parts are folded."""
    from .md_budget import fold_if

    cal = audit.calibration
    if cal is None:
        return []
    lines, warnings = _md_lines(cal)
    out = []
    if room is not None:
        room.left -= sum(len(x.encode("utf-8")) + 1 for x in lines)
    if warnings and room is not None and room.take(warnings):
        lines += warnings
        warnings = []
    out.append(Section("### Calibration", lines, [], noun="calibration lines", title="Calibration"))
    if warnings:
        out.append(Section("", [], warnings, noun="calibration warnings", title="Calibration warnings",
                           fold=f"{len(warnings):,} calibration warning{'s' if len(warnings) > 1 else ''}"))
    b = cal.budget
    if b is not None and b.frontier:
        head = ["parameters removed", "share", "layers", md_text(middle(cal.metric, 40)), "top-1", "all at once"]
        rc = b.recovery
        if rc is not None:
            head += [f"after {rc.steps} steps", "after recovery", "recovery cost"]
        frows = []
        for r, p in zip(frontier_rows(cal), b.frontier):
            holds = r.holds
            if r.chosen:
                holds = (f"**{r.holds} (suggested: holds after recovery, needs the fine-tune)**"
                         if b.chosen_after_recovery else f"**{r.holds} (suggested)**")
            more = ""
            if rc is not None:
                rec = p.recovered
                more = (f" {md_value(cal, rec.metric)} | {r.recovered_holds} | {md_text(r.cost)} |" if rec is not None
                        else " \u2013 | \u2013 | \u2013 |")
            frows.append(f"| {r.removed} | {percent(p.removed_fraction)} | {r.layers} | {md_value(cal, p.metric)} | "
                        f"{percent(p.top1)} | {holds} |{more}")
        intro = "Every plan measured all at once, fewest parameters removed first"
        if rc is not None:
            intro += (f", and again after {rc.steps} steps of recovery fine-tune (distillation on the fit rows, "
                      "measured on the held-out rows)")
        s = Section("", [intro + ":", "", "| " + " | ".join(head) + " |",
                         "|---:|---:|---:|---:|---:|---|" + ("---:|---|---|" if rc is not None else "")], frows,
                    noun="frontier plans", title="Frontier")
        if room is None:
            s.fold = f"Frontier: {len(frows):,} plans measured all at once"
            out.append(s)
        else:
            out.append(fold_if(s, room, f"Frontier: {len(frows):,} plans measured all at once", columns=len(head)))
    if cal.layers:
        head = ["layer", "plan rank", "rows", "n", "evidence: r@1% / 2% / 5% / 10%", "evidence: tier-1",
                "evidence: floor", "cliff (rank: metric)", "x"]
        lrows = []
        for r in rows(cal, lambda v: md_value(cal, v), times="", plan=plan_ranks(audit)):
            ranks = " / ".join(str(x) if x is not None else "\u2013" for x in (r.r1, r.r2, r.r5, r.r10))
            lrows.append(f"| {md_code(r.layer)} | **{r.plan}** | {r.rows:,} | {r.width:,} | {ranks} | {r.suggested} | "
                         f"{r.floor} | {r.cliff} | {r.compression} |")
        out.append(Section("", ["Per layer: the plan's rank (measured all at once), then the evidence: the ranks "
                                "that keep the layer-output error under 1%, 2%, 5% and 10% on the calibration data "
                                "(tier 1), the tier-1 rank for the tolerance, the measured floor and cliff (tier 2) "
                                "and the compression at the floor; > b-e: only a rank past break-even meets it.", "",
                                "| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"], lrows,
                           noun="calibrated layers", title="Calibrated layers",
                           fold=f"{len(lrows):,} calibrated layers, {len(head)} columns"))
    if cal.missing:
        mrows = [f"- {md_code(k)}: {md_text(v)}" for k, v in cal.missing.items()]
        out.append(Section("", [], mrows, noun="layers without statistics", title="Layers without statistics",
                           fold=f"{len(mrows):,} layer{'s' if len(mrows) > 1 else ''} without statistics"))
    return out


def terminal(audit: "Audit") -> list[str]:
    """Lines (unwrapped prose first, then a fixed table) for the terminal reporter."""
    cal = audit.calibration
    if cal is None:
        return []
    out = budget_lines(cal)
    line = plan_line(cal)
    if line:
        out.append(line)
    line = rounding_line(cal)
    if line:
        out.append(line)
    out += [summary(cal), basis(cal)]
    out += [f"warning: {w}" for w in cal.warnings]
    out.append(FINETUNE)
    return [term(x) for x in out]  # messages may quote layer names


def _frontier_fig(points: list[tuple[float, float, bool]], chosen: float | None, tolerance: float, label: str,
                  higher: bool, reference: float, after: list[tuple[float, float, bool]] | None = None,
                  steps: int = 0) -> Any:
    from .layer_charts import PALETTE, STYLE, _figure

    if not points:
        return None
    fig, ax = _figure(5.6, 2.8)
    xs = [100 * p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, color=PALETTE[0], marker="o", markersize=4, linewidth=1.4,
            label="before recovery" if after else None)
    if after:  # the same plans after the recovery fine-tune (--recover)
        ax.plot([100 * p[0] for p in after], [p[1] for p in after], color=PALETTE[3], marker="s", markersize=4,
                linewidth=1.2, linestyle="--", label=f"after {steps} recovery steps")
        ys = ys + [p[1] for p in after]
    for x, y, ok in zip(xs, ys, [p[2] for p in points]):
        if not ok:
            ax.plot([x], [y], marker="x", color=PALETTE[4], markersize=8)
    limit = reference - tolerance if higher else tolerance
    if not higher and all(y > 0 for y in ys) and limit > 0:  # errors span decades: a log axis shows the cliff
        from matplotlib import ticker

        ax.set_yscale("log")

        def plain(v: float, _: Any) -> str:  # 0.02, not TeX markup the SVG shows as source; 1, 2 and 5 only
            mant = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0.0
            return f"{v:g}" if any(abs(mant - k) < 1e-6 for k in (1, 2, 5)) else ""

        ax.yaxis.set_major_formatter(ticker.FuncFormatter(plain))
        ax.yaxis.set_minor_formatter(ticker.FuncFormatter(plain))
    ax.axhline(limit, label=f"tolerance ({limit:g})", **STYLE["tolerance"])
    if chosen is not None:
        ax.axvline(100 * chosen, label="suggested plan", **STYLE["suggested"])
    ax.set_xlabel("parameters removed (% of the model)")
    ax.set_ylabel(label)
    ax.legend(fontsize=7, frameon=False)
    return fig


def frontier_chart(cal: "CalibrationReport") -> str | None:
    """Parameters removed against the model-level metric, each plan measured all at once (SVG), or None."""
    from .layer_charts import _render, short_label

    b = cal.budget
    if b is None or not b.frontier:
        return None
    series = frontier_series(cal)
    return _render(_frontier_fig, series["before"], b.removed_fraction, cal.tolerance, short_label(cal.metric, 30),
                   cal.higher_is_better, cal.reference, series["after"],
                   b.recovery.steps if b.recovery is not None else 0)


def _measured_fig(name: str, points: list[tuple[int, float]], curve: list[tuple[int, float]], limit: float,
                  label: str, higher: bool, break_even: float, floor: int | None, m: int, n: int) -> Any:
    """The model's metric with this layer alone truncated (left axis) and the tier-1 layer-output error (right axis,
    its own units), against the rank on a log axis that starts just below the first measured rank. A metric that
    spans more than two decades gets a log axis. No legend: :data:`FLOOR_LEGEND` is the one every chart shares."""
    from .layer_charts import STYLE, _figure, _log_rank_axis, _log_y, short_label

    pts = sorted((r, v) for r, v in points if r > 0 and math.isfinite(v))
    if not pts:
        return None
    fig, ax = _figure(5.6, 2.8)
    _log_rank_axis(ax, min(m, n), break_even)
    first = pts[0][0]
    ax.set_xlim(max(0.85, first / 1.4), ax.get_xlim()[1])  # the axis starts near the data, not at rank 1
    ax.plot([r for r, _ in pts], [v for _, v in pts], gid="metric", label=f"{short_label(label, 30)} (this layer alone)",
            **STYLE["measured"])
    c = [(r, e) for r, e in curve if r >= first / 1.4 and math.isfinite(e)]
    if c:
        ax2 = ax.twinx()
        ax2.plot([r for r, _ in c], [e for _, e in c], gid="layer-error",
                 label="layer-output error (tier 1, right axis)", **STYLE["layer-error"])
        ax2.set_ylabel("layer-output error", fontsize=8)
        ax2.tick_params(axis="y", labelsize=7)
        es = [e for _, e in c]
        if min(es) > 0 and max(es) / min(es) > 100:
            _log_y(ax2)
        else:
            ax2.set_ylim(bottom=0)
        ax2.spines["right"].set_visible(True)
    ys = [v for _, v in pts]
    if not higher and min(ys) > 0 and max(ys + [limit]) / min(ys + [limit]) > 100:  # spans decades: log
        _log_y(ax)
    elif not higher:
        ax.set_ylim(0, max(max(ys), limit) * 1.3)
    ax.axhline(limit, gid="tolerance", label=f"tolerance ({limit:g})", **STYLE["tolerance"])
    ax.axvline(break_even, gid="break-even", label=f"break-even {break_even:.1f}", **STYLE["break-even"])
    if floor is not None:
        ax.axvline(floor, gid="floor", label=f"measured floor {floor}", **STYLE["floor"])
    ax.set_xlabel("rank r (log scale)")
    ax.set_ylabel(short_label(label, 30))
    facts = f"break-even {break_even:.1f}" + (f", measured floor {floor}" if floor is not None else "")
    ax.set_title(f"{short_label(name, 48)} ({m} x {n}): {facts}", fontsize=9, loc="left")
    return fig


def floor_legend(metric: str) -> list[tuple[str, str]]:
    """The one legend of the per-layer floor charts, in the styles :func:`_measured_fig` draws with."""
    from .layer_charts import short_label

    return [("measured", f"{short_label(metric, 40)}, this layer alone (left axis)"),
            ("layer-error", "layer-output error, tier 1 (right axis)"), ("tolerance", "tolerance"),
            ("break-even", "break-even rank"), ("floor", "measured floor")]


def layer_charts(audit: "Audit", top: int | None = None) -> list[tuple[str, str]]:
    """(layer, SVG) per calibrated layer with measured points (every one, attention included; ``top``: the first
    ``top`` only), largest first: the model-level metric with that layer alone truncated against its rank (log
    axis), the tier-1 layer-output error on its own right-hand axis, tolerance, break-even and measured floor."""
    from .layer_charts import _render

    cal = audit.calibration
    if cal is None:
        return []
    limit = cal.reference - cal.tolerance if cal.higher_is_better else cal.tolerance
    out = []
    items = [(n, p) for n, p in cal.measured_points().items() if p and n in cal.layers]
    order = {l.name: i for i, l in enumerate(audit.layers)}
    items.sort(key=lambda t: order.get(t[0], len(order)))
    for name, pts in items[:top]:
        layer = audit.layer(name)
        lc = cal.layers[name]
        svg = _render(_measured_fig, name, pts, lc.curve, limit, cal.metric, cal.higher_is_better, layer.break_even,
                      lc.floor.floor if lc.floor is not None else None, layer.m, layer.n)
        if svg:
            out.append((name, svg))
    return out


def html_context(audit: "Audit", charts: bool = True) -> dict[str, Any]:
    """The template's ``calibration`` variable: None without calibration."""
    from .layer_charts import data_uri, legend_chart

    cal = audit.calibration
    if cal is None:
        return {"calibration": None}
    front = frontier_chart(cal) if charts else None
    floors = [(n, data_uri(s)) for n, s in layer_charts(audit)] if charts else []
    legend = legend_chart(floor_legend(cal.metric)) if floors else None
    return {"calibration": {
        "summary": summary(cal), "basis": basis(cal), "plan": plan_line(cal), "budget": budget_lines(cal) + [x for x in [rounding_line(cal)] if x],
        "warnings": cal.warnings, "missing": cal.missing, "rows": rows(cal, plan=plan_ranks(audit)),
        "finetune": FINETUNE if not cal.recovery_note() else FINETUNE + " The suggested plan was chosen after "
                    "recovery: it " + cal.recovery_note() + "; it needs that fine-tune.",
        "recovery": recovery_cost(cal), "recovered_steps": cal.budget.recovery.steps
        if cal.budget is not None and cal.budget.recovery is not None else None,
        "frontier": data_uri(front) if front else None, "frontier_rows": frontier_rows(cal),
        "metric": cal.metric,
        "layer_charts": floors, "floor_legend": data_uri(legend) if legend else "",
    }}
