"""The calibration's view model (:class:`CalibrationView`, built once per report by :func:`view`): the numbers, words
and statuses every report shows of ``Audit.calibration``, the data of its charts (per-layer measured curves, the
frontier), and the plan card. The format modules lay it out: :mod:`auditor.render.terminal`,
:mod:`auditor.render.markdown`, :mod:`auditor.render.html`; the JSON is the report's own ``to_dict``. What depends on
the metric (its units, direction and the line it is judged against) is decided here. Plain data in, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ...verdict.policy import checked_change, in_percent, metric_change, tolerance_words, unit, unseen_words
from .md_fit import percent
from .view import pct

if TYPE_CHECKING:
    from ...calresults import CalibrationReport
    from ...results import AuditResult
    from .layer_charts import FloorChart, FrontierChart

FINETUNE = "A recovery fine-tune follows factorization: these numbers are before it."


def measured_points(audit: "AuditResult") -> dict[str, list[tuple[int, float]]] | None:
    """Per layer, the tier-2 (rank, metric) points for the layer pages' ``measured`` hook; None without them."""
    cal = audit.calibration
    pts = cal.measured_points() if cal is not None else {}
    return pts or None


def _g(x: float | None, digits: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def held_out_words(cal: "CalibrationReport") -> str:
    """How the held-out rows were used: "256 held out (128 searched, 128 for verification)" when they were split."""
    b = cal.budget
    v = b.verification if b is not None else None
    if v is None and cal.plan_check is not None:
        v = cal.plan_check.verification
    if v is None or not v.search_rows:
        return f"{cal.holdout_rows:,} held out ({cal.holdout})"
    return (f"{cal.holdout_rows:,} held out ({cal.holdout}: {v.search_rows:,} search rows, {v.rows:,} "
            "verification rows the search never read)")


def summary(cal: "CalibrationReport") -> str:
    what = "measured floors (tier 2)" if cal.measured_floors else "tier 1 (one forward pass)"
    return (f"Calibration {cal.source}: {cal.fit_rows:,} rows for statistics, {held_out_words(cal)}; "
            f"{what}; metric {cal.metric}, tolerance {tolerance_words(cal)}"
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
                f"{100 * cal.tier1_target:g}% layer-output error on the "
                "calibration data (weight energy only where calibration did not reach a layer).")
    cap = f", at most {100 * b.budget:g}% of the parameters removed" if b.budget is not None else ""
    fixed = (f"; {len(b.fixed)} layer(s) calibration did not rank keep their weight-energy rank and are in every "
             "plan measured" if b.fixed else "")
    return (f"Suggested ranks: the largest plan that holds the tolerance all at once{cap}, searched over the {curves} "
            f"curves ({b.evaluations} plans factorized and measured on the held-out rows{how}); per-layer floors and "
            f"tier-1 ranks are evidence, not the plan{fixed}.")


def suggested_plan_note(audit: "AuditResult") -> str:
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
    pred = f"predicted {unit(cal, pc.predicted)} (the {basis} {summed}), " if pc.predicted is not None else ""
    top1 = f", top-1 agreement {pct(pc.top1)}" if pc.top1 is not None else ""
    left = f"; not measured: {', '.join(pc.left_out)}" if pc.left_out else ""
    fitted = f", the factors fitted {pc.fit}" if pc.fit else ""  # as factorize fits them by default
    v = pc.verification
    if v is not None:
        ci = (f" ({100 * v.confidence:g}% interval {unit(cal, v.low)} to {unit(cal, v.high)}{unseen_words(cal, v)})"
              if v.low is not None and v.high is not None else " (no interval)")
        judged = "holds" if v.ok else "STRADDLES" if v.straddles else "MISSES"
        return (f"Plan applied all at once ({pc.layers} layers, {pc.removed:,} parameters removed{fitted}): {cal.metric} "
                f"{pred}measured {unit(cal, pc.measured)} on {v.rows:,} verification rows the search never read{ci}"
                f"{top1}: {judged} the tolerance {tolerance_words(cal)}{left}.")
    return (f"Plan applied all at once ({pc.layers} layers, {pc.removed:,} parameters removed{fitted}): {cal.metric} "
            f"{pred}measured {unit(cal, pc.measured)}{top1}: {'holds' if pc.ok else 'MISSES'} the tolerance "
            f"{tolerance_words(cal)}; {checked_change(cal, pc)}{left}.")


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
    rows: int | str  # a group's row: "8,192" or a range "256–8,192"
    width: int | str
    r1: int | str | None
    r2: int | str | None
    r5: int | str | None
    r10: int | str | None
    suggested: str  # evidence: the tier-1 rank for the tolerance ("> b-e": none below break-even holds it)
    floor: str  # evidence: the measured floor (tier 2)
    cliff: str
    compression: str
    plan: str = "dense"  # the plan's rank, what every report leads with ("dense": the plan keeps the layer)


ABOVE_BE = "> b-e"  # evidence past break-even: the layer-output error needs a rank that saves nothing


def plan_ranks(audit: "AuditResult") -> dict[str, int]:
    """The reviewed plan's rank per layer (the suggested plan, or the one given) where it factorizes the layer; a
    layer the plan leaves dense, or plans at a rank that saves nothing, is absent."""
    from ...results import PlanVerdict

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


def _span(values: list[Any]) -> Any:
    """A group's cell from its members' cells: the one value they share, else the range of the numbers ("24–32",
    with "1 dense, " before it when one member is dense), else the distinct values joined."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return distinct[0]
    nums = [int(v) for v in values if isinstance(v, int) or (isinstance(v, str) and v.isdigit())]
    rest = [v for v in values if not (isinstance(v, int) or (isinstance(v, str) and v.isdigit()))]
    if not nums:
        return ", ".join(f"{values.count(v)} {v}" for v in distinct)
    lo, hi = min(nums), max(nums)
    rng = f"{lo:,}" if lo == hi else f"{lo:,}\u2013{hi:,}"
    extra = ", ".join(f"{rest.count(v)} {v}" for v in dict.fromkeys(rest))
    return f"{extra}, {rng}" if extra else rng


def group_rows(rows_: list[CalRow]) -> list[CalRow]:
    """The per-layer rows with repeated blocks as one row each (``blocks.*.fc ×4``, :func:`auditor.groups.group_layers`
    on the names), in the order of their first member; a cell is the members' common value or their range."""
    from dataclasses import fields as dc_fields

    from ...planning.groups import LayerShape, group_layers

    by_name = {r.layer: r for r in rows_}
    groups = group_layers([LayerShape(r.layer, 1, 1) for r in rows_])
    order = {r.layer: i for i, r in enumerate(rows_)}
    out = []
    for g in sorted(groups, key=lambda g: order[g.members[0]]):
        members = [by_name[n] for n in g.members]
        if len(members) == 1:
            out.append(members[0])
            continue
        cells = {f.name: _span([getattr(m, f.name) for m in members]) for f in dc_fields(CalRow) if f.name != "layer"}
        out.append(CalRow(f"{g.label} \u00d7{len(members)}", **cells))
    return out


def empty_columns(rows_: list[CalRow]) -> frozenset[str]:
    """The evidence columns no row has a value in (``floor``, ``cliff``, ``compression`` without tier 2): each
    format leaves them out."""
    return frozenset(k for k in ("floor", "cliff", "compression")
                     if rows_ and all(getattr(r, k) in ("\u2013", "-", "") for r in rows_))


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
        v = percent(self.value) if self.tier == 1 or cal.facts.fails_above else cal.facts.words(self.value)
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


def baseline_pair(cal: "CalibrationReport") -> tuple[float, float, str] | None:
    """(the chosen plan's value, uniform truncation's, the rows both were measured on): on the verification rows
    where both were verified there, else on the search rows; None without a baseline."""
    b = cal.budget
    u = b.uniform if b is not None else None
    if u is None:
        return None
    if u.verification is not None and b.verification is not None:
        return b.verification.value, u.verification.value, f"{u.verification.rows:,} verification rows"
    return b.metric, u.metric, f"{u.rows:,} search rows" if u.rows else "held-out rows"


def baseline_words(cal: "CalibrationReport", value: Callable[[float | None], str] | None = None) -> str:
    """The plan beside uniform truncation at its share removed, in the report's units: "at 20.1% removed: +1.39%;
    uniform truncation +2.77%"; empty without a baseline."""
    pair = baseline_pair(cal)
    if pair is None:
        return ""
    v = value or (lambda x: unit(cal, x))
    return f"at {pct(cal.budget.removed_fraction)} removed: {v(pair[0])}; uniform truncation {v(pair[1])}"


def damage_ratio(cal: "CalibrationReport") -> float | None:
    """The plan's value over uniform truncation's where both are a damage that is zero on the dense model (an
    error, an increase) and uniform's is positive; None otherwise (a user metric, a plan that improved)."""
    pair = baseline_pair(cal)
    if pair is None or not in_percent(cal):  # an error or an increase (never higher-is-better)
        return None
    plan, uni, _ = pair
    return plan / uni if uni > 0 and plan >= 0 and math.isfinite(plan) and math.isfinite(uni) else None


def baseline_line(cal: "CalibrationReport", value: Callable[[float | None], str] | None = None) -> str | None:
    """The chosen plan against SVD-LLM's uniform whitened truncation at the same share removed, in one sentence;
    None without a baseline (no plan, or nothing calibrated)."""
    pair = baseline_pair(cal)
    if pair is None:
        return None
    u = cal.budget.uniform
    ratio = damage_ratio(cal)
    times = f"; the plan's {cal.metric} is {ratio:.2f}x uniform's" if ratio is not None else ""
    return (f"Against the baseline, on the same {pair[2]}: {baseline_words(cal, value)} (SVD-LLM's uniform whitened "
            f"truncation: every planned layer of the plan's kinds at {100 * u.kept:.1f}% of its break-even rank "
            f"m*n/(m+n), {u.layers} layers, {u.removed:,} parameters removed ({pct(u.removed_fraction)}), factors "
            f"from the same statistics, measured all at once with the same metric){times}.")


def ties_line(cal: "CalibrationReport") -> str | None:
    """What the tie groups (--tie) cost in removal, in one sentence; None without ties."""
    b = cal.budget
    t = b.ties if b is not None else None
    if t is None:
        return None
    return (f"Tie groups (--tie, {t.groups} group{'s' if t.groups != 1 else ''}, each at one rank): {t.words()} "
            f"({t.untied:,} -> {t.removed:,} parameters the curves remove at that cost).")


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
        out = [f"Plan that holds ({ask}, over {over} curves, {b.evaluations} plans measured): none; {missed_words(b)}, "
               "so the suggested plan is empty and keeps every layer dense."]
        out += [line for line in [looser_line(cal)] if line]
    elif note:
        out = [f"Plan chosen after recovery ({ask}, over {over} curves, --choose-after-recovery): {len(b.plan)} "
               f"layers, {b.removed:,} parameters removed ({pct(b.removed_fraction)}); it {note} (measured all "
               f"at once{top1} before it). It needs that fine-tune."
               + (f" The smallest larger plan recovered ({b.smallest_failing:,} removed) does not hold after it."
                  if b.smallest_failing is not None else "")]
    else:
        rows = _search_rows(b)
        out = [f"Plan that holds ({ask}, over {over} curves, {b.evaluations} plans measured): {len(b.plan)} "
               f"layers, {b.removed:,} parameters removed ({pct(b.removed_fraction)}); {metric_change(cal, b.metric)} "
               f"measured all at once{rows}{top1}: {'holds' if b.ok else 'MISSES'} the tolerance"
               + (f"; {larger_words(cal)}." if b.smallest_failing is not None else ".")]
    line = baseline_line(cal)
    if line:
        out.append(line)
    line = ties_line(cal)
    if line:
        out.append(line)
    if b.exhausted:
        out.append(f"The search stopped at its cap of {b.evaluations} measurements before the boundary was "
                   "bracketed: a larger plan may hold.")
    line = recovery_cost(cal)
    if line:
        out.append(line)
    return out


def missed_words(b: Any) -> str:
    """How every plan measured missed: "every plan measured missed the tolerance", and where some held on the search
    rows, that their verification did not."""
    failed = sum(1 for p in b.plans if p.status == "failed verification")
    return ("every plan measured missed the tolerance" if not failed else
            f"every plan measured missed the tolerance ({failed} held on the search rows and failed verification)")


def looser_line(cal: "CalibrationReport") -> str:
    """What looser tolerances buy when no plan held, read from the plans the search measured (none measured again),
    in one sentence: "Looser tolerances, from the 9 plans measured: within 2%, 12.3% of the parameters removed
    (41,216, 3 layers; 1.85% measured all at once, verified 1.90% (90% interval ...)); within 5%, ...; within 10%,
    no plan measured holds it."; empty where the report has none (a plan held, or the tolerance is at least 10%)."""
    b = cal.budget
    if b is None or not b.looser:
        return ""
    parts = []
    for lp in b.looser:
        within = f"within {cal.facts.loosened(lp.tolerance).tolerance_words()}"
        if lp.metric is None:
            parts.append(f"{within}, no plan measured holds it")
            continue
        verified = f", verified {verified_words(cal, lp.verification)}" if lp.verification is not None else ""
        parts.append(f"{within}, {pct(lp.removed_fraction)} of the parameters removed ({lp.removed:,}, {lp.layers} "
                     f"layers; {unit(cal, lp.metric)} measured all at once{verified})")
    return (f"Looser tolerances, read from the {b.evaluations} plans measured (none measured again): "
            + "; ".join(parts) + ".")


def _search_rows(b: Any) -> str:
    """" on the 128 search rows" where the held-out rows were split for verification, else empty."""
    v = b.verification
    return f" on the {v.search_rows:,} search rows" if v is not None and v.search_rows else ""


def verified_words(cal: "CalibrationReport", v: Any) -> str:
    """A verification in the metric's unit: "+1.02% (90% interval +0.93% to +1.11%, 165 verification rows)"."""
    if v is None:
        return "\u2013"
    ci = (f"{100 * v.confidence:g}% interval {unit(cal, v.low)} to {unit(cal, v.high)}, "
          if v.low is not None and v.high is not None else "no interval, ")
    return f"{unit(cal, v.value)} ({ci}{v.rows:,} verification rows{unseen_words(cal, v)})"


def larger_words(cal: "CalibrationReport") -> str:
    """What happened to the smallest plan measured above the suggested one: it failed on the search rows, or held
    there and failed its verification (then both numbers, each with its rows)."""
    b = cal.budget
    p = b.plan_verified(b.smallest_failing) if b is not None and b.smallest_failing is not None else None
    if p is None:
        return f"the smallest larger plan measured ({b.smallest_failing:,} removed) does not hold"
    if p.ok and p.verification is not None:
        return (f"the smallest larger plan measured ({p.removed:,} removed) held on the search rows "
                f"({unit(cal, p.metric)}) but failed verification: {verified_words(cal, p.verification)}, "
                f"{p.verification.judged} {tolerance_words(cal)}")
    return (f"the smallest larger plan measured ({p.removed:,} removed) fails on the search rows "
            f"({unit(cal, p.metric)})")


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


def check_card(audit: "AuditResult") -> CheckCard | None:
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
    return CheckCard(cal.facts.judged(pc.measured, pc.ok, tolerance=False),
                     (f"{checked_change(cal, pc)}; {_card_rows(cal, pc)}"  # with its baseline
                      if cal.facts.from_dense
                      else f"{cal.metric} on {_card_rows(cal, pc)}")
                     + f", {pc.layers} layers at once: "
                     f"{'holds' if pc.ok else 'misses the tolerance'}{top1}{_card_baseline(cal, pc)}",
                     "ok" if pc.ok else "bad")


def _card_baseline(cal: "CalibrationReport", pc: Any) -> str:
    """"; at 57.2% removed: 0.968%; uniform truncation 8.46%" when the card's plan is the suggested one."""
    b = cal.budget
    words = baseline_words(cal)
    return f"; {words}" if words and b is not None and pc.removed == b.removed and b.plan else ""


def _card_rows(cal: "CalibrationReport", pc: Any) -> str:
    """The rows the plan card's number is from: the verification rows when the held-out rows were split."""
    v = pc.verification
    if v is None:
        return f"{cal.holdout_rows:,} held-out rows"
    return f"{v.rows:,} verification rows (of {cal.holdout_rows:,} held out, never read by the search)"


STATUS_WORDS = {"suggested": "SUGGESTED", "held": "held", "failed": "failed", "dense": "dense",
                "failed verification": "held; failed verification", "backstop": "held (fallback)"}


@dataclass(frozen=True)
class FrontierRow:
    removed: str
    share: str
    layers: int
    metric: str  # on the search rows, in the metric's unit
    top1: str
    status: str  # what happened to it (:data:`STATUS_WORDS`)
    chosen: bool
    verified: str = "\u2013"  # on the verification rows, with its interval ("–": not verified)
    recovered: str = ""  # the metric after the recovery fine-tune ("" without --recover)
    recovered_holds: str = ""  # "holds" | "fails" after it
    cost: str = ""  # "200 steps, 1,600 rows (102,400 tokens), 12.3 s"
    uniform: str = "\u2013"  # uniform truncation at the same share, same rows: "+2.77% at 20.0%" ("–": not measured)
    uniform_value: str = "\u2013"  # its value alone ("+2.77%"), for a table short of room


def measured_plans(cal: "CalibrationReport") -> list[Any]:
    """Every plan the search measured (``BudgetResult.plans``; the frontier where a result was built without
    them), fewest parameters removed first."""
    b = cal.budget
    if b is None:
        return []
    return list(b.plans) if b.plans else list(b.frontier)


def _status(b: Any, p: Any) -> str:
    if p.status:
        return p.status
    from ...calresults import plan_status

    return plan_status(p, b.plan)


def frontier_rows(cal: "CalibrationReport") -> list[FrontierRow]:
    """Every plan the search measured (each all at once), fewest parameters removed first, with what happened to
    it; ``chosen`` marks the plan the suggestion is; with --recover, each recovered plan's metric after the
    fine-tune and what it cost."""
    b = cal.budget
    if b is None:
        return []
    out = []
    for p in measured_plans(cal):
        rec = p.recovered
        status = _status(b, p)
        extra = ((unit(cal, rec.metric), "holds" if rec.ok else "fails",
                  f"{rec.steps} steps, {rec.rows:,} rows ({rec.tokens:,} tokens), {rec.seconds:.1f} s")
                 if rec is not None else ("\u2013" if b.recovery is not None else "", "", ""))
        out.append(FrontierRow(f"{p.removed:,}", pct(p.removed_fraction), p.layers, unit(cal, p.metric),
                               pct(p.top1) if p.top1 is not None else "\u2013", STATUS_WORDS.get(status, status),
                               status == "suggested", verified_cell(cal, p.verification), *extra,
                               uniform=uniform_cell(cal, p.uniform),
                               uniform_value=unit(cal, p.uniform.metric) if p.uniform is not None else "\u2013"))
    return out


def uniform_cell(cal: "CalibrationReport", u: Any) -> str:
    """Uniform truncation beside a plan as a table cell: its value on the plan's search rows and its share removed
    ("+2.77% at 20.0%"); "–" where it was not measured (plans off the frontier, the dense model)."""
    if u is None:
        return "\u2013"
    return f"{unit(cal, u.metric)} at {pct(u.removed_fraction)}"


UNIFORM_HEAD = "uniform truncation, same rows"  # the frontier tables' column title


def verified_cell(cal: "CalibrationReport", v: Any) -> str:
    """A verification as a table cell: "+1.02% [+0.93%, +1.11%]" (the interval's rows and confidence are in
    :func:`verified_head`); "–" where the plan was not verified."""
    if v is None:
        return "\u2013"
    ci = f" [{unit(cal, v.low)}, {unit(cal, v.high)}]" if v.low is not None and v.high is not None else ""
    return unit(cal, v.value) + ci


def verified_head(cal: "CalibrationReport") -> str:
    """The verification column's title: "verified, 90% interval (165 rows)"."""
    b = cal.budget
    v = b.verification if b is not None else None
    if v is None:
        return "verified"
    return f"verified{f', {100 * v.confidence:g}% interval' if v.low is not None else ''} ({v.rows:,} rows)"


def frontier_title(cal: "CalibrationReport") -> str:
    """What the frontier table lists, in one line."""
    b = cal.budget
    plans = measured_plans(cal)
    v = b.verification if b is not None else None
    rows = (f"on the {v.search_rows:,} search rows, then on the {v.rows:,} verification rows for the plans "
            "verified" if v is not None and v.search_rows else "on the held-out rows")
    uniform = ("; uniform: SVD-LLM's uniform whitened truncation beside each frontier plan, at its share removed "
               "(as close as integer ranks allow) and on its rows" if any(p.uniform is not None for p in plans)
               else "")
    return (f"Every plan the search measured ({len(plans)}), fewest parameters removed first: {cal.metric}"
            f"{' in percent' if in_percent(cal) else ''} {rows}{uniform}")


def frontier_series(cal: "CalibrationReport") -> dict[str, list[tuple[float, float, bool]]]:
    """The frontier chart's data: ``before`` (each plan measured all at once), ``uniform`` (uniform whitened
    truncation beside each frontier plan, on its rows) and, with --recover, ``after`` (the same plans after the
    recovery fine-tune), as (share removed, metric, holds), finite values only."""
    b = cal.budget
    if b is None:
        return {"before": [], "after": [], "uniform": []}
    k = 100.0 if in_percent(cal) else 1.0  # the chart's axis in the metric's unit
    plans = measured_plans(cal)
    before = [(p.removed_fraction, k * p.metric, p.ok) for p in plans if math.isfinite(p.metric)]
    after = [(p.removed_fraction, k * p.recovered.metric, p.recovered.ok) for p in plans
             if p.recovered is not None and math.isfinite(p.recovered.metric)]
    uniform = [(p.uniform.removed_fraction, k * p.uniform.metric, p.uniform.ok) for p in plans
               if p.uniform is not None and math.isfinite(p.uniform.metric)]
    return {"before": before, "after": after, "uniform": uniform}


def md_value(cal: "CalibrationReport", v: float | None) -> str:
    """The metric as the Markdown writes it: the relative output error (lower is better) as a percentage, like
    every share and error there; a user metric (higher is better) in its own units, 4 significant digits."""
    return unit(cal, v)


def md_tolerance(cal: "CalibrationReport") -> str:
    return tolerance_words(cal)


def md_card_value(audit: "AuditResult", card: CheckCard) -> str:
    """The plan card's measurement in the Markdown's units ("0.58% \u2264 1.0%"); ``card.value`` when unmeasured."""
    cal, pc = audit.calibration, audit.calibration.plan_check if audit.calibration is not None else None
    if cal is None or pc is None or card.status == "unknown":
        return card.value
    return cal.facts.judged(pc.measured, pc.ok)


def frontier_data(cal: "CalibrationReport") -> "FrontierChart | None":
    """The frontier chart's data (:func:`auditor.render.layer_charts.frontier_chart`): parameters removed against the
    model-level metric, each plan measured all at once; None without a frontier."""
    from .layer_charts import FrontierChart, short_label

    b = cal.budget
    if b is None or not b.frontier:
        return None
    series = frontier_series(cal)
    k = 100.0 if in_percent(cal) else 1.0
    limit = k * cal.limit  # the kind's tolerance line (k is 1 unless written as a percentage)
    label = short_label(cal.metric, 30) + (" (%)" if k != 1.0 else "")
    status = [_status(b, p) for p in measured_plans(cal) if math.isfinite(p.metric)]
    return FrontierChart(series["before"], limit, label, cal.facts.fails_above,
                         b.removed_fraction if b.plan else None, series["after"],
                         b.recovery.steps if b.recovery is not None else 0, status, series["uniform"])


def floor_legend(metric: str) -> list[tuple[str, str]]:
    """The one legend of the per-layer floor charts, in the styles :func:`auditor.render.layer_charts.floor_chart`
    draws with."""
    from .layer_charts import short_label

    return [("measured", f"{short_label(metric, 40)}, this layer alone (left axis)"),
            ("layer-error", "layer-output error, tier 1 (right axis)"), ("tolerance", "tolerance"),
            ("break-even", "break-even rank"), ("floor", "measured floor")]


def floor_data(audit: "AuditResult", top: int | None = None) -> "list[FloorChart]":
    """A chart's data (:func:`auditor.render.layer_charts.floor_chart`) per calibrated layer with measured points
    (every one, attention included; ``top``: the first ``top`` only), largest first: the model-level metric with that
    layer alone truncated against its rank (log axis), the tier-1 layer-output error on its own right-hand axis,
    tolerance, break-even and measured floor."""
    from .layer_charts import FloorChart

    cal = audit.calibration
    if cal is None:
        return []
    limit = cal.limit
    out = []
    items = [(n, p) for n, p in cal.measured_points().items() if p and n in cal.layers]
    order = {l.name: i for i, l in enumerate(audit.layers)}
    items.sort(key=lambda t: order.get(t[0], len(order)))
    for name, pts in items[:top]:
        layer = audit.layer(name)
        lc = cal.layers[name]
        out.append(FloorChart(name, pts, lc.curve, limit, cal.metric, cal.facts.fails_above, layer.break_even,
                              lc.floor.floor if lc.floor is not None else None, (layer.m, layer.n)))
    return out


@dataclass(frozen=True)
class CalibrationView:
    """The calibration as every report shows it, built once per report by :func:`view`: its numbers (rows, frontier,
    chart data), words (the sentences, in the text's units and, where they differ, the Markdown's) and statuses.
    Each format module lays it out (terminal.py, markdown.py, html.py); none recomputes a sentence or a status."""

    cal: "CalibrationReport"
    summary: str  # the data, what was measured, the metric and tolerance
    basis: str  # where the suggested ranks come from
    plan: str | None  # the reviewed plan measured all at once, in one sentence
    budget: list[str]  # the search: the plan that holds, the frontier, what recovery cost
    rounding: str | None  # what bfloat16 / float16 rounding alone costs
    fallback: str | None  # the planned layers the output gradients did not reach, and what costed them instead
    md_rounding: str | None  # the same in the Markdown's units
    rows: list[CalRow]  # per layer, the plan's rank first; metric values as the text and HTML write them
    md_rows: list[CalRow]  # the same in the Markdown's units
    frontier: list[FrontierRow]
    recovery: str  # what the recovered curve cost ("" without --recover)
    recovery_note: str  # what the plan chosen after recovery needs ("" unless --choose-after-recovery chose it)
    uniform: str  # "at 20.1% removed: +1.39%; uniform truncation +2.77%" ("" without the uniform baseline)
    ties: str  # "ties cost 0.80 points of removal (q_proj/k_proj/v_proj: 0.50, ...)" ("" without --tie)
    recovered_steps: int | None
    frontier_chart: "FrontierChart | None"
    floor_charts: "list[FloorChart]"


def view(audit: "AuditResult") -> CalibrationView | None:
    """The calibration's view model; None without calibration."""
    cal = audit.calibration
    if cal is None:
        return None
    plan = plan_ranks(audit)
    b = cal.budget
    return CalibrationView(
        cal=cal, summary=summary(cal), basis=basis(cal), plan=plan_line(cal), budget=budget_lines(cal),
        rounding=rounding_line(cal),
        fallback=cal.sensitivity_fallback.line() if cal.sensitivity_fallback is not None else None,
        md_rounding=rounding_line(cal, cal.facts.words),
        rows=group_rows(rows(cal, plan=plan)),
        md_rows=group_rows(rows(cal, lambda v: md_value(cal, v), times="", plan=plan)),
        frontier=frontier_rows(cal), recovery=recovery_cost(cal), recovery_note=cal.recovery_note(),
        uniform=baseline_words(cal), ties=b.ties.words() if b is not None and b.ties is not None else "",
        recovered_steps=b.recovery.steps if b is not None and b.recovery is not None else None,
        frontier_chart=frontier_data(cal), floor_charts=floor_data(audit))
