"""The speed section of the reports, only when the speed was measured (``--measure-speed``): one line for the
Markdown summary ("size -57%, latency -31% on cpu (2 threads), batch 1 x 128"), and a table per planned layer with
x time (measured) beside x params and x MACs, the times with their spread, and the time break-even rank beside the
parameter break-even m*n/(m+n). Every function returns nothing for an audit without a speed measurement, so the
reports of other audits are unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...speedresults import SpeedReport, seconds
from .md_fit import Room, Section, fold_if
from .safe import md_code, md_text, term, visible

if TYPE_CHECKING:
    from ...results import AuditResult


def _batch(inputs: str) -> str:
    """``int64[1, 128]`` -> ``batch 1 x 128``; a float input's last dimension (features) or an image's channels and
    pixels are not batch."""
    first = inputs.split("],")[0] if inputs else ""
    if "[" not in first:
        return f"inputs {inputs}" if inputs else ""
    dtype, dims = first.split("[", 1)
    shape = [d.strip() for d in dims.rstrip("]").split(",") if d.strip()]
    if not dtype.strip().startswith(("int", "uint", "bool")):
        shape = shape[:1] if len(shape) >= 4 else shape[:-1] or shape
    return "batch " + " x ".join(shape)


def summary_line(audit: "AuditResult") -> str | None:
    """``size -57%, latency -31% on cpu (2 threads), batch 1 x 128``; None when the whole model was not timed."""
    sp, rv = audit.speed, audit.review
    if sp is None or sp.model is None or rv is None or not audit.total_params:
        return None
    size = rv.model_params_after / audit.total_params - 1
    return (f"size {_pct(size)}, latency {_pct(sp.model.latency_change)} on {sp.where()}, "
            f"{_batch(sp.model.inputs)}")


def _pct(x: float) -> str:
    """A relative change as a signed percent, one decimal below 1%: ``-57%``, ``-0.2%``, ``+3%``."""
    v = 100 * x
    return f"{v:+.1f}%" if abs(v) < 1 else f"{v:+.0f}%"


@dataclass(frozen=True)
class SpeedRow:
    layer: str
    rank: int
    shape: str
    input_shape: str
    at: str
    x_params: float
    x_macs: float | None
    dense: str
    factorized: str
    x_time: float
    time_break_even: str
    param_break_even: float


def _spread(t) -> str:  # noqa: ANN001 - a Timing
    return f"{seconds(t.median)} ±{seconds(t.iqr / 2)}"


def rows(audit: "AuditResult") -> list[SpeedRow]:
    sp = audit.speed
    if sp is None:
        return []
    out = []
    for s in sp.layers:
        layer = audit.layer(s.layer)
        macs_after = layer.macs_at(s.rank)
        be = sp.break_even_for(s.layer, s.at)
        out.append(SpeedRow(s.layer, s.rank, f"{s.m}x{s.n}", "x".join(map(str, s.input_shape)), s.at,
                            layer.compression(s.rank),
                            layer.macs / macs_after if layer.macs and macs_after else None,
                            _spread(s.dense), _spread(s.factorized), s.ratio,
                            be.label() if be is not None else "-", layer.break_even))
    return out


def _model_lines(sp: SpeedReport) -> list[str]:
    out = []
    m = sp.model
    if m is not None:
        def mem(r) -> str:  # noqa: ANN001 - a ModelRun
            return f", peak {'RSS' if r.memory.startswith('rss') else 'CUDA'} {r.peak_bytes / 2**20:,.0f} MiB" \
                if r.peak_bytes else ""
        out.append(f"whole model on {m.inputs} ({m.where}): dense {_spread(m.dense.timing)}{mem(m.dense)}; "
                   f"factorized {_spread(m.factorized.timing)}{mem(m.factorized)}; x time {m.ratio:.2f} "
                   f"(latency {100 * m.latency_change:+.0f}%)".replace("+-", "-"))
    if sp.frontier and sp.frontier_dense is not None:
        base = sp.frontier_dense.timing.median
        out.append("frontier (--budget), latency beside the dense model's " + seconds(base) + ": " + "; ".join(
            f"{f.removed:,} removed ({100 * f.removed_fraction:.1f}%, {f.layers} layers) "
            f"{seconds(f.run.timing.median)}, {_pct(f.run.timing.median / base - 1)}" for f in sp.frontier))
    lp = sp.latency_plan
    if lp is not None:
        if lp.met and lp.measured is not None and lp.dense is not None:
            change = lp.measured.timing.median / lp.dense.timing.median - 1
            out.append(f"--budget-latency {lp.target:g}: {len(lp.ranks)} layers, {lp.params_removed:,} parameters "
                       f"removed, latency measured {100 * change:+.0f}% (the layer times predicted "
                       f"{100 * lp.predicted_change:+.0f}%)".replace("+-", "-")
                       + (f"; left dense: {', '.join(map(visible, lp.dropped))}" if lp.dropped else ""))
        else:
            out.append(f"--budget-latency {lp.target:g}: no plan tried (the planned layers, then those that cost "
                       "time left dense) removes that share of the measured latency")
    return out


def terminal(audit: "AuditResult") -> list[str]:
    """The speed section of the text report, as lines (nothing without a speed measurement)."""
    sp = audit.speed
    if sp is None:
        return []
    out = [f"speed, measured on {sp.where()}, {sp.dtype} (median ±half the IQR per call):"]
    line = summary_line(audit)
    if line:
        out.append(f"  {line}")
    head = ("layer", "r", "input", "x params", "x MACs", "dense", "factorized", "x time", "time b-e", "b-e")
    table = [head] + [(term(r.layer), str(r.rank), r.input_shape, f"{r.x_params:.2f}",
                       f"{r.x_macs:.2f}" if r.x_macs is not None else "-", r.dense, r.factorized,
                       f"{r.x_time:.2f}", r.time_break_even, f"{r.param_break_even:.1f}") for r in rows(audit)]
    if len(table) > 1:
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            out.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                        for i, (c, w) in enumerate(zip(row, widths))))
        out.append("  x time = dense / factorized time (above 1 is faster); time b-e = the largest rank measured "
                   "faster than dense at that input; b-e = the parameter break-even m*n/(m+n)")
    out += ["  " + l for l in _model_lines(sp)]
    out += [f"  note: {n}" for n in sp.notes]
    return out


def markdown(audit: "AuditResult", room: Room) -> list[Section]:
    """The speed section of the Markdown report (none without a speed measurement)."""
    sp = audit.speed
    if sp is None:
        return []
    head = ["layer", "rank", "input", "x params", "x MACs", "dense", "factorized", "x time", "time b-e", "b-e"]
    intro = [f"Measured on {md_text(sp.where())}, {md_text(sp.dtype)}: median ± half the IQR per call; "
             "x time = dense / factorized (above 1 is faster); time b-e = the largest rank measured faster than dense "
             "at that input; b-e = the parameter break-even m·n/(m+n).", ""]
    intro += [f"- {md_text(l)}" for l in _model_lines(sp)] + ([""] if sp.model or sp.latency_plan else [])
    intro += ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    body = [f"| {md_code(r.layer)} | {r.rank:,} | {r.input_shape} | {r.x_params:.2f} | "
            f"{f'{r.x_macs:.2f}' if r.x_macs is not None else '–'} | {md_text(r.dense)} | {md_text(r.factorized)} | "
            f"{r.x_time:.2f} | {md_text(r.time_break_even)} | {r.param_break_even:.1f} |" for r in rows(audit)]
    s = Section("### Speed (measured)", intro, body, noun="timed layers", title="Speed")
    return [fold_if(s, room, f"{len(body):,} timed layer{'s' if len(body) != 1 else ''}", columns=len(head))]


def html_context(audit: "AuditResult") -> dict | None:
    """The HTML/PDF template's ``speed`` variable (templates/_speed.html): None without a speed measurement."""
    sp = audit.speed
    if sp is None:
        return None
    return {"where": sp.where(), "dtype": sp.dtype, "summary": summary_line(audit), "rows": rows(audit),
            "model": _model_lines(sp), "notes": list(sp.notes)}
