"""Every chart of the HTML and PDF reports, drawn with matplotlib's SVG backend: the parameter share by group
(:func:`group_share_chart`), the energy overview of the largest groups (:func:`energy_overview_chart`), each layer
page's spectrum and energy panels (:func:`page_chart`), the one legend those pages share (:func:`legend_chart`), and
the calibration's charts: the frontier of plans measured all at once (:func:`frontier_chart`) and each layer's
measured metric per rank (:func:`floor_chart`). These functions are the whole chart API; every other module passes
them plain numbers (a parameter object where a chart takes more than a few) and never draws itself.

Energy is drawn as 1 - E(r) on a log axis, labelled with E itself (0.9, 0.99, 0.999): the band from 0.9 to 1, where
every target lies, takes most of the height instead of a tenth of it. Every line's style comes from :data:`STYLE`
(or :data:`PALETTE` with :data:`DASHES` for the overview's curves), and legends are drawn by matplotlib from the
same styles, so a legend's swatch is always the line it names. Colours are the Okabe-Ito colour-blind-safe set.

Each chart takes plain numbers (lists or arrays, ints) and returns an SVG document as a string (``None`` where
there is nothing to draw); :func:`data_uri` turns one into an ``<img src>``. Text stays text
(``svg.fonttype = none``), the output is deterministic (fixed hash salt, no date), nothing is fetched. Names are
drawn as plain text: mathtext is off (a name like ``$\\undefinedcmd{x}$`` would crash it) and control or
bidirectional-override characters are shown as ``\\uXXXX``. Figures are built with ``matplotlib.figure.Figure``,
never pyplot, so nothing global is left behind.
"""

from __future__ import annotations

import base64
import io
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["FloorChart", "FrontierChart", "Marks", "MeasuredPanel", "data_uri", "energy_overview_chart",
           "floor_chart", "frontier_chart", "group_share_chart", "legend_chart", "page_chart", "safe_label",
           "short_label"]

# Okabe-Ito: distinguishable with every common colour-vision deficiency; each overview curve also has its own dashes
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9"]
DASHES: list[Any] = ["-", (0, (5, 2)), (0, (6, 2, 1, 2)), (0, (1, 1.5)), (0, (8, 2, 1, 2, 1, 2)), (0, (3, 3))]
GREY = "#94a3b8"
# each kind of line, as the charts and their legends draw it
STYLE: dict[str, dict[str, Any]] = {
    "curve": {"color": "#0072B2", "linewidth": 1.2},  # a layer's (or a member's) curve
    "median": {"color": "#0072B2", "linewidth": 1.6},  # the median of a group of more than MAX_CURVES members
    "band": {"color": "#56B4E9", "alpha": 0.35, "linewidth": 0},  # their min-max band
    "break-even": {"color": "#555555", "linewidth": 1.1, "linestyle": (0, (1, 2))},
    "suggested": {"color": "#009E73", "linewidth": 1.3, "linestyle": (0, (5, 2))},
    "planned": {"color": "#D55E00", "linewidth": 1.4, "linestyle": "-"},
    "target": {"color": "#000000", "linewidth": 0.9, "linestyle": (0, (6, 2, 1, 2))},
    "measured": {"color": "#CC79A7", "linewidth": 1.3, "linestyle": "-", "marker": "o", "markersize": 3.5},
    "tolerance": {"color": "#E69F00", "linewidth": 1.0, "linestyle": (0, (4, 2))},
    "layer-error": {"color": "#56B4E9", "linewidth": 1.1, "linestyle": (0, (5, 1.5, 1, 1.5))},
    "floor": {"color": "#009E73", "linewidth": 1.3, "linestyle": "-"},
}
MAX_CURVES = 6  # a page draws up to this many member curves as they are; more as their median and min-max band
POINTS = 64  # points per curve, spread evenly on the log rank axis
E_FLOOR = 1e-6  # the energy axis ends at E = 0.999999 (1 - E below it is rounding)
_RC = {"svg.hashsalt": "lowrank-auditor", "svg.fonttype": "none", "font.size": 9, "font.family": "DejaVu Sans",
       "axes.spines.top": False, "axes.spines.right": False, "text.parse_math": False, "text.usetex": False,
       "axes.unicode_minus": False}


def safe_label(text: str) -> str:
    """``text`` with control, C1, bidirectional-override and line-separator characters shown as ``\\uXXXX``
    (a name can neither break a title into lines nor reorder it).

    >>> safe_label("a\\nb\\u202ec")
    'a\\\\u000Ab\\\\u202Ec'
    """
    out = []
    for c in text:
        o = ord(c)
        if (o < 0x20 or 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069 or c in "\u2028\u2029"
                or 0xD800 <= o <= 0xDFFF):
            out.append(f"\\u{o:04X}")
        else:
            out.append(c)
    return "".join(out)


def short_label(text: str, width: int = 48) -> str:
    """A safe label of at most ``width`` characters, cut in the middle so both the start (encoder/decoder) and
    the end (the layer's own name) stay readable.

    >>> short_label("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    'encoder.block.0….relative_attention_bias'
    """
    text = safe_label(text)
    if len(text) <= width:
        return text
    tail = min(len(text.rsplit(".", 1)[-1]) + 1, width * 2 // 3) if "." in text else width // 2
    head = width - 1 - tail
    return text[:head] + "…" + text[-tail:]


def data_uri(svg: str) -> str:
    """An SVG document as a ``data:image/svg+xml;base64,...`` URI for an ``<img src>``."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")


def _figure(w: float, h: float, ncols: int = 1, **kw: Any):  # type: ignore[no-untyped-def]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    return fig, fig.subplots(1, ncols, **kw)


PAD = 0.1  # inches of margin around a chart's tight box (matplotlib's pad_inches)
_ROOT = re.compile(r'width="[0-9.]+pt" height="[0-9.]+pt" viewBox="[0-9. ]+"')


def _legend_outside(fig: Any, renderer: Any) -> bool:
    """Whether a legend of ``fig`` reaches outside the figure: the SVG backend cuts unfilled paths (a swatch's line)
    at the canvas's edge. Text is written as text and never cut, so a tick or axis label below the figure is no
    reason to lay the chart out again."""
    w, h = renderer.width, renderer.height
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if legend is not None:
            e = legend.get_window_extent(renderer)
            if e.x0 < 0 or e.y0 < 0 or e.x1 > w or e.y1 > h:
                return True
    return False


def _svg(fig: Any) -> str:
    """The figure as SVG, cropped to its tight box plus :data:`PAD`, in one draw: the whole figure is written, then
    its root's size and viewBox are set to the box (the box measured after that draw, by an SVG renderer at 72 dpi,
    as ``bbox_inches="tight"`` measures it, without drawing the figure a second time: a layer page's chart in 0.21 s
    against 0.28 s) and the figure's background laid under all of the box. A chart with a legend outside its figure
    (beside or under the axes) is saved with ``bbox_inches="tight"`` as before (:func:`_legend_outside`)."""
    from matplotlib.backends.backend_svg import RendererSVG

    fig.set_dpi(72)
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", dpi=72, metadata={"Date": None})
    text = buf.getvalue().decode("utf-8")
    w_in, h_in = fig.get_size_inches()
    renderer = RendererSVG(w_in * 72, h_in * 72, io.StringIO(), image_dpi=72)
    box = fig.get_tightbbox(renderer=renderer)
    if _legend_outside(fig, renderer):  # matplotlib cut the lines of its swatches from the drawing
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", dpi=72, bbox_inches="tight", pad_inches=PAD, metadata={"Date": None})
        return buf.getvalue().decode("utf-8")
    x0, x1 = (box.x0 - PAD) * 72, (box.x1 + PAD) * 72
    top, bottom = (h_in - box.y1 - PAD) * 72, (h_in - box.y0 + PAD) * 72
    w, h = x1 - x0, bottom - top
    root = f'width="{w:f}pt" height="{h:f}pt" viewBox="{x0:f} {top:f} {w:f} {h:f}"'
    from matplotlib.colors import to_hex

    ground = f'<rect x="{x0:f}" y="{top:f}" width="{w:f}" height="{h:f}" fill="{to_hex(fig.get_facecolor())}"/>'
    return _ROOT.sub(root, text, count=1).replace('<g id="figure_1">', ground + '\n <g id="figure_1">', 1)


def _render(build: Any, *args: Any, **kwargs: Any) -> str | None:
    from ..._env import configure_matplotlib

    configure_matplotlib()  # its font cache under our cache dir, never the user's home
    import matplotlib

    with matplotlib.rc_context(_RC):
        fig = build(*args, **kwargs)
        return None if fig is None else _svg(fig)


def _fmt(v: float, _pos: Any = None) -> str:
    if v <= 0:
        return ""
    if v >= 1 and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:g}"


def _decade(v: float, _pos: Any = None) -> str:
    """A decade tick as a plain number: 1, 0.1, 0.01, 0.001, then 1e-4 (never TeX source); other ticks unlabelled."""
    if v <= 0:
        return ""
    e = math.log10(v)
    if abs(e - round(e)) > 1e-9:
        return ""
    e = int(round(e))
    return f"{10.0 ** e:g}" if -3 <= e <= 5 else f"1e{e}"


def _log_rank_axis(ax: Any, k: int, *marks: float | None) -> None:
    """Log-scaled rank axis from 1 to k, widened to show any mark beyond k (a planned rank above min(m, n)); ticks at
    1, 2 and 5 of each decade up to two decades, 1 and 3 up to three, then decades only (labels never crowd). Minor
    tick marks only where the labelled ticks are decades or 1 and 3 (with 1, 2 and 5 they add nothing to read)."""
    from matplotlib import ticker

    ax.set_xscale("log")
    hi = max([k, *(x for x in marks if x is not None and x > 0)]) * 1.15
    ax.set_xlim(0.85, hi)
    span = math.log10(hi / 0.85)
    subs = (1.0, 2.0, 5.0) if span <= 2.1 else (1.0, 3.0) if span <= 3.1 else (1.0,)
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_fmt))
    if len(subs) > 2:
        ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _log_y(ax: Any) -> None:
    """A log y axis with plain decade labels (see :func:`_decade`), no minor tick marks (unlabelled, eight a decade:
    they crowded the axis and were half of a layer page's drawing time)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, numticks=10))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_decade))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def _share_fig(labels: Sequence[str], params: Sequence[int], total: int, counts: Sequence[int] | None,
               top: int) -> Any:
    if total <= 0 or not labels:
        return None
    if len(labels) != len(params) or (counts is not None and len(counts) != len(labels)):
        raise ValueError("labels, params and counts must have the same length")
    order = sorted(range(len(labels)), key=lambda i: (-params[i], i))
    shown = order[:top]
    names = [short_label(labels[i], 48) + (f"  ×{counts[i]}" if counts is not None and counts[i] > 1 else "")
             for i in shown]
    shares = [100 * params[i] / total for i in shown]
    colors = [PALETTE[0]] * len(shown)
    rest = order[top:]
    if rest:
        names.append(f"{len(rest):,} other groups")
        shares.append(100 * sum(params[i] for i in rest) / total)
        colors.append(GREY)
    dense = total - sum(params)
    if dense > 0:
        names.append("not factorizable (norms, biases, …)")
        shares.append(100 * dense / total)
        colors.append("#cbd5e1")
    fig, (ax, axc) = _figure(7.2, 0.28 * len(names) + 0.9, ncols=2, sharey=True,
                             gridspec_kw={"width_ratios": [4, 1], "wspace": 0.08})
    y = np.arange(len(names))
    ax.barh(y, shares, color=colors, height=0.7)
    hi = max(shares)
    ax.set_xlim(0, hi * 1.22 if hi > 0 else 1)
    for yi, s in zip(y, shares):
        ax.annotate(f"{s:.1f}%", (s, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
                    gid="share-value")
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the model's parameters")
    cum = np.cumsum(shares)
    axc.plot(cum, y, color=PALETTE[3], marker="o", markersize=3, linewidth=1.2)
    axc.set_xlim(0, 105)
    axc.set_xticks([0, 50, 100])
    axc.axvline(80, color="#cbd5e1", linewidth=0.8, linestyle="--", zorder=0)
    axc.set_xlabel("cumulative %\n(dashed: 80%)")
    axc.tick_params(axis="y", left=False)
    return fig


def group_share_chart(labels: Sequence[str], params: Sequence[int], total: int, *,
                      counts: Sequence[int] | None = None, top: int = 12) -> str | None:
    """Parameter share by group: the ``top`` largest groups as bars with their share written beside each bar, the
    other groups as one grey bar, and what is not factorizable (``total - sum(params)``) as another. The
    cumulative share is drawn on its own narrow axis to the right, so no value label can touch it.

    ``labels``: group labels (``Group.label``); ``params``: parameters per group; ``counts``: members per group
    (shown as ``×32``); ``total``: the model's unique parameters. None when ``total`` is 0 or there are no groups.
    """
    return _render(_share_fig, labels, params, total, counts, top)



# ---- spectra and energy ---------------------------------------------------------------------------------------
def _ranks(k: int) -> np.ndarray:
    """About POINTS ranks from 1 to k, evenly spread on a log axis (a curve of 4,096 points draws as 64)."""
    return np.unique(np.round(np.logspace(0, math.log10(max(k, 1)), POINTS)).astype(int))


def _energy_label(v: float, _pos: Any = None) -> str:
    """A tick of the 1 - E axis labelled with E: 0.1 -> "0.9", 0.001 -> "0.999", 1 -> "0"."""
    if v <= 0 or v > 1:
        return ""
    e = math.log10(v)
    if abs(e - round(e)) > 1e-9:
        return ""
    k = -int(round(e))
    return "0" if k == 0 else f"{1 - v:.{k}f}"


def _energy_axis(ax: Any, lo: float) -> None:
    """The y axis as 1 - E(r) on a log scale from ``lo`` to 1, its ticks labelled with E (0, 0.9, 0.99, ...)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.set_ylim(lo, 1.05)
    ax.invert_yaxis()  # E grows upwards, as on a linear energy axis
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, numticks=12))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_energy_label))
    ax.yaxis.set_minor_locator(ticker.NullLocator())  # as on _log_y: unlabelled marks between 0.9 and 0.99 misled
    ax.set_ylabel("energy kept E(r)\n(log scale of 1 − E)")


def _left_out(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, 1 - E) of a curve at the drawn ranks, points with 1 - E at or below rounding left out."""
    idx = _ranks(len(e)) - 1
    rest = 1.0 - e[idx]
    keep = rest > E_FLOOR / 2
    return idx[keep] + 1, rest[keep]


def _energy_lo(curves: Sequence[np.ndarray]) -> float:
    low = [float(np.min(1.0 - c[c < 1.0 - E_FLOOR / 2])) for c in curves if np.any(c < 1.0 - E_FLOOR / 2)]
    return max(10.0 ** math.floor(math.log10(min(low))), E_FLOOR) if low else 0.1


def _stack(series: Sequence[np.ndarray]) -> np.ndarray:
    k = max(len(s) for s in series)
    return np.vstack([np.pad(s, (0, k - len(s)), constant_values=np.nan) for s in series])


def _marks(ax: Any, be: float | None, sug: int | None, plan: int | None) -> None:
    for x, kind, label in ((be, "break-even", "break-even"), (sug, "suggested", "suggested rank"),
                           (plan, "planned", "planned rank")):
        if x:
            ax.axvline(x, gid=f"mark-{kind}", label=label, **STYLE[kind])


def _spectrum_panel(ax: Any, sigmas: Sequence[np.ndarray], be: float | None, sug: int | None,
                    plan: int | None) -> None:
    norm = [s / s[0] for s in sigmas]
    k = max(len(s) for s in norm)
    _log_rank_axis(ax, k, be, sug, plan)
    pos = [float(np.min(s[s > 0])) for s in norm if np.any(s > 0)]
    if len(norm) > MAX_CURVES:
        st = _stack(norm)
        idx = _ranks(k) - 1
        with np.errstate(all="ignore"):
            lo, hi, med = np.nanmin(st, 0)[idx], np.nanmax(st, 0)[idx], np.nanmedian(st, 0)[idx]
        ok = lo > 0
        ax.fill_between(idx[ok] + 1, lo[ok], hi[ok], gid="band", **STYLE["band"])
        ax.plot(idx[med > 0] + 1, med[med > 0], gid="median", **STYLE["median"])
    else:
        for i, s in enumerate(norm):
            idx = _ranks(len(s)) - 1
            v = s[idx]
            ax.plot(idx[v > 0] + 1, v[v > 0], gid=f"curve-{i}", **STYLE["curve"])
    _log_y(ax)
    ax.set_ylim(max(10.0 ** math.floor(math.log10(min(pos))), 1e-16) if pos else 0.1, 1.5)
    _marks(ax, be, sug, plan)
    ax.set_xlabel("index i (log scale)")
    ax.set_ylabel("σᵢ / σ₁ (log scale)")
    ax.set_title("singular values", fontsize=9, loc="left")


def _energy_panel(ax: Any, energies: Sequence[np.ndarray], be: float | None, sug: int | None, plan: int | None,
                  target: float | None) -> None:
    k = max(len(e) for e in energies)
    _log_rank_axis(ax, k, be, sug, plan)
    _energy_axis(ax, _energy_lo(energies))
    if len(energies) > MAX_CURVES:
        st = _stack(energies)
        idx = _ranks(k) - 1
        with np.errstate(all="ignore"):
            lo, hi, med = (1 - np.nanmax(st, 0)[idx], 1 - np.nanmin(st, 0)[idx], 1 - np.nanmedian(st, 0)[idx])
        ok = hi > E_FLOOR / 2
        ax.fill_between(idx[ok] + 1, np.maximum(lo[ok], E_FLOOR / 2), hi[ok], gid="band", **STYLE["band"])
        ax.plot(idx[med > E_FLOOR / 2] + 1, med[med > E_FLOOR / 2], gid="median", **STYLE["median"])
    else:
        for i, e in enumerate(energies):
            x, y = _left_out(e)
            ax.plot(x, y, gid=f"curve-{i}", **STYLE["curve"])
    if target:
        ax.axhline(max(1 - target, E_FLOOR), gid="mark-target", label=f"target E = {target:g}", **STYLE["target"])
    _marks(ax, be, sug, plan)
    ax.set_xlabel("rank r (log scale)")
    ax.set_title("energy", fontsize=9, loc="left")


@dataclass(frozen=True)
class Marks:
    """The lines a layer page's panels draw across the curves: break-even, the suggested and the planned rank
    (vertical), the target energy (horizontal; None with calibration, where energy chose no rank)."""

    break_even: float | None = None
    suggested: int | None = None
    planned: int | None = None
    target: float | None = None


@dataclass(frozen=True)
class MeasuredPanel:
    """A layer page's third panel: (rank, metric) ``series``, one per layer (a group's: its members'), and the
    ``tolerance`` they were judged against as a horizontal line."""

    series: Sequence[Sequence[tuple[int, float]]]
    metric: str = "measured metric"
    tolerance: float | None = None
    title: str = "measured, the layer alone truncated"


def _measured_panel(ax: Any, panel: MeasuredPanel, k: int) -> None:
    label, tolerance, title = panel.metric, panel.tolerance, panel.title
    series = [sorted((int(r), float(v)) for r, v in pts if r > 0 and math.isfinite(v)) for pts in panel.series]
    series = [s for s in series if s]
    first = min(s[0][0] for s in series)
    _log_rank_axis(ax, k, *(r for s in series for r, _ in s))
    ax.set_xlim(max(0.85, first / 1.4), ax.get_xlim()[1])  # from just below the first measured rank
    for i, pts in enumerate(series):
        ax.plot([r for r, _ in pts], [v for _, v in pts], gid=f"measured-{i}", **STYLE["measured"])
    ys = [v for s in series for _, v in s]
    if min(ys) > 0 and max(ys) / min(ys) > 100:  # spans more than two decades
        _log_y(ax)
    if tolerance is not None and tolerance > 0:  # the line the rank was chosen against
        ax.axhline(tolerance, gid="tolerance", **STYLE["tolerance"])
    ax.set_xlabel("rank r (log scale)")
    ax.set_ylabel(short_label(label, 30))
    ax.set_title(title, fontsize=9, loc="left")


def _page_fig(sigmas: Sequence[np.ndarray], energies: Sequence[np.ndarray], marks: Marks,
              measured: MeasuredPanel | None) -> Any:
    sigmas = [np.asarray(s, dtype=np.float64) for s in sigmas if len(s) and s[0] > 0]
    energies = [np.asarray(e, dtype=np.float64) for e in energies if len(e)]
    meas = [s for s in (measured.series if measured else []) if any(r > 0 and math.isfinite(v) for r, v in s)]
    panels = [p for p, have in (("spectrum", sigmas), ("energy", energies), ("measured", meas)) if have]
    if not panels:
        return None
    be, sug, plan = marks.break_even, marks.suggested, marks.planned
    fig, axes = _figure(3.6 * len(panels), 2.5, ncols=len(panels), gridspec_kw={"wspace": 0.75})
    axes = np.atleast_1d(axes)
    for ax, p in zip(axes, panels):
        ax.set_gid(f"panel-{p}")
        if p == "spectrum":
            _spectrum_panel(ax, sigmas, be, sug, plan)
        elif p == "energy":
            _energy_panel(ax, energies, be, sug, plan, marks.target)
        else:
            assert measured is not None
            k = max([len(e) for e in energies] + [len(s) for s in sigmas] + [1])
            _measured_panel(ax, MeasuredPanel(meas, measured.metric, measured.tolerance, measured.title), k)
    return fig


def page_chart(sigmas: Sequence[np.ndarray], energies: Sequence[np.ndarray], marks: Marks = Marks(),
               measured: MeasuredPanel | None = None) -> str | None:
    """A layer's (or a group's) page chart: singular values σᵢ/σ₁ (log-log) and energy E(r) (1 - E on a log axis)
    against the rank, the ``marks`` (break-even, suggested and planned ranks as vertical lines, the target energy as a
    horizontal one); a third panel with the ``measured`` (rank, metric) points (a series per layer) when calibration
    gives them (the tier-2 metric, or the tier-1 layer-output error curve), with the tolerance they were judged
    against as a horizontal line (a calibrated audit passes no energy target: energy chose nothing there). A group of
    more than :data:`MAX_CURVES` members is drawn as the median and min-max band. No legend: :func:`legend_chart`
    draws the one legend every page shares. None when there is nothing to draw."""
    return _render(_page_fig, sigmas, energies, marks, measured)


def _overview_fig(energies: Sequence[np.ndarray], labels: Sequence[str], target: float | None) -> Any:
    es = [np.asarray(e, dtype=np.float64) for e in energies if len(e)]
    if not es:
        return None
    fig, ax = _figure(7.6, 3.2)
    _log_rank_axis(ax, max(len(e) for e in es))
    _energy_axis(ax, _energy_lo(es))
    for i, e in enumerate(es):
        x, y = _left_out(e)
        ax.plot(x, y, color=PALETTE[i % len(PALETTE)], linestyle=DASHES[i % len(DASHES)], linewidth=1.5,
                label=safe_label(labels[i]) if i < len(labels) else f"curve {i + 1}", gid=f"curve-{i}")
    if target:
        ax.axhline(max(1 - target, E_FLOOR), gid="mark-target", label=f"target E = {target:g}", **STYLE["target"])
    ax.set_xlabel("rank r (log scale)")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=3.2)
    return fig


def energy_overview_chart(energies: Sequence[np.ndarray], labels: Sequence[str],
                          target: float | None = None) -> str | None:
    """Energy curves of the largest groups, each its own colour and dashes, with a legend drawn from the same lines;
    None without curves."""
    return _render(_overview_fig, energies, labels, target)


def _legend_fig(entries: Sequence[tuple[str, str]]) -> Any:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not entries:
        return None
    handles = []
    for kind, label in entries:
        st = STYLE[kind]
        if kind == "band":
            handles.append(Patch(facecolor=st["color"], alpha=st["alpha"], label=label))
        else:
            handles.append(Line2D([], [], label=label, **st))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.6, 0.3 + 0.2 * math.ceil(len(handles) / 4)))
    fig.legend(handles=handles, loc="center", ncols=min(4, len(handles)), frameon=False, fontsize=8,
               handlelength=3.2)
    return fig


def legend_chart(entries: Sequence[tuple[str, str]]) -> str | None:
    """One legend for a set of charts, as (kind of :data:`STYLE`, label) entries: each swatch is drawn with the
    style its charts draw that kind of line with. None without entries."""
    return _render(_legend_fig, entries)


# ---- calibration: the frontier of plans, and each layer's measured metric per rank ---------------------------
@dataclass(frozen=True)
class FrontierChart:
    """The frontier chart's data: ``before`` (each plan measured all at once) and, with --recover, ``after`` (the
    same plans after ``steps`` recovery steps), ``uniform`` (uniform whitened truncation at the frontier plans' shares,
    on their rows), as (share removed, metric, holds); the ``limit`` the metric is judged
    against, the metric's ``label``, ``errors`` (lower is better: a log axis where the values span decades) and the
    ``chosen`` plan's share removed."""

    before: Sequence[tuple[float, float, bool]]
    limit: float
    label: str
    errors: bool = True
    chosen: float | None = None
    after: Sequence[tuple[float, float, bool]] = ()
    steps: int = 0
    status: Sequence[str] = ()  # per ``before`` point, what happened to it (``auditor.calresults.PLAN_STATUSES``)
    uniform: Sequence[tuple[float, float, bool]] = ()  # uniform whitened truncation beside the frontier plans


def _plain(v: float, _: Any) -> str:
    """A log tick as a plain number (0.02, not TeX markup the SVG shows as source), on 1, 2 and 5 only."""
    mant = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0.0
    return f"{v:g}" if any(abs(mant - k) < 1e-6 for k in (1, 2, 5)) else ""


def _frontier_fig(c: FrontierChart) -> Any:
    points, after = c.before, c.after
    if not points:
        return None
    fig, ax = _figure(5.6, 2.8)
    xs = [100 * p[0] for p in points]
    ys = [p[1] for p in points]
    ax.plot(xs, ys, color=PALETTE[0], marker="o", markersize=4, linewidth=1.4,
            label="the plans, before recovery" if after else "the plans" if c.uniform else None)
    if after:  # the same plans after the recovery fine-tune (--recover)
        ax.plot([100 * p[0] for p in after], [p[1] for p in after], color=PALETTE[3], marker="s", markersize=4,
                linewidth=1.2, linestyle="--", label=f"after {c.steps} recovery steps")
        ys = ys + [p[1] for p in after]
    if c.uniform:  # the baseline: SVD-LLM's uniform whitened truncation at the same shares
        uni = sorted(c.uniform)
        ax.plot([100 * p[0] for p in uni], [p[1] for p in uni], color="#555555", marker="D", markersize=3.5,
                linewidth=1.2, linestyle=(0, (3, 1.5)), gid="uniform", label="uniform truncation (SVD-LLM)")
        ys = ys + [p[1] for p in uni]
    status = list(c.status) or ["" for _ in points]
    for x, y, ok, st in zip(xs, ys, [p[2] for p in points], status):
        if not ok:
            ax.plot([x], [y], marker="x", color=PALETTE[4], markersize=8)
        elif st == "failed verification":
            ax.plot([x], [y], marker="^", color=PALETTE[4], markersize=7, linestyle="none",
                    label="held on search rows, failed verification")
        elif st == "suggested":
            ax.plot([x], [y], marker="*", color=PALETTE[2], markersize=11, linestyle="none", label="suggested plan")
    limit = c.limit
    if c.errors and all(y > 0 for y in ys) and limit > 0:  # errors span decades: a log axis shows the cliff
        from matplotlib import ticker

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain))
        ax.yaxis.set_minor_formatter(ticker.FuncFormatter(_plain))
    pct_axis = c.label.endswith("(%)")
    ax.axhline(limit, label=f"tolerance ({limit:g}{'%' if pct_axis else ''})", **STYLE["tolerance"])
    if c.chosen is not None:
        ax.axvline(100 * c.chosen, label=None if "suggested" in status else "suggested plan", **STYLE["suggested"])
    ax.set_xlabel("parameters removed (% of the model)")
    ax.set_ylabel(c.label)
    # below the axes, never over the curves or the suggested plan's line (four or more entries filled the corner)
    ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    return fig


def frontier_chart(c: FrontierChart) -> str | None:
    """Parameters removed against the model-level metric, each plan measured all at once, with the tolerance and the
    suggested plan; None without plans."""
    return _render(_frontier_fig, c)


@dataclass(frozen=True)
class FloorChart:
    """One calibrated layer's chart: ``points`` (the model's metric with this layer alone truncated, tier 2) and
    ``curve`` (the tier-1 layer-output error) per rank, the ``limit`` the metric is judged against, its ``label``,
    ``errors`` (lower is better), the layer's ``shape`` (m, n), break-even and measured ``floor``."""

    name: str
    points: Sequence[tuple[int, float]]
    curve: Sequence[tuple[int, float]]
    limit: float
    label: str
    errors: bool
    break_even: float
    floor: int | None
    shape: tuple[int, int]


def _layer_error_axis(ax: Any, curve: Sequence[tuple[int, float]], first: int) -> None:
    """The tier-1 layer-output error on its own right-hand axis (log where it spans more than two decades)."""
    c = [(r, e) for r, e in curve if r >= first / 1.4 and math.isfinite(e)]
    if not c:
        return
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


def _floor_fig(c: FloorChart) -> Any:
    """The model's metric with this layer alone truncated (left axis) and the tier-1 layer-output error (right axis,
    its own units), against the rank on a log axis that starts just below the first measured rank. A metric that
    spans more than two decades gets a log axis. No legend: the report draws one for every chart."""
    pts = sorted((r, v) for r, v in c.points if r > 0 and math.isfinite(v))
    if not pts:
        return None
    (m, n), limit, be, floor = c.shape, c.limit, c.break_even, c.floor
    fig, ax = _figure(5.6, 2.8)
    _log_rank_axis(ax, min(m, n), be)
    first = pts[0][0]
    ax.set_xlim(max(0.85, first / 1.4), ax.get_xlim()[1])  # the axis starts near the data, not at rank 1
    ax.plot([r for r, _ in pts], [v for _, v in pts], gid="metric",
            label=f"{short_label(c.label, 30)} (this layer alone)", **STYLE["measured"])
    _layer_error_axis(ax, c.curve, first)
    ys = [v for _, v in pts]
    if c.errors and min(ys) > 0 and max(ys + [limit]) / min(ys + [limit]) > 100:  # spans decades: log
        _log_y(ax)
    elif c.errors:
        ax.set_ylim(0, max(max(ys), limit) * 1.3)
    ax.axhline(limit, gid="tolerance", label=f"tolerance ({limit:g})", **STYLE["tolerance"])
    ax.axvline(be, gid="break-even", label=f"break-even {be:.1f}", **STYLE["break-even"])
    if floor is not None:
        ax.axvline(floor, gid="floor", label=f"measured floor {floor}", **STYLE["floor"])
    ax.set_xlabel("rank r (log scale)")
    ax.set_ylabel(short_label(c.label, 30))
    facts = f"break-even {be:.1f}" + (f", measured floor {floor}" if floor is not None else "")
    ax.set_title(f"{short_label(c.name, 48)} ({m} x {n}): {facts}", fontsize=9, loc="left")
    return fig


def floor_chart(c: FloorChart) -> str | None:
    """A calibrated layer's measured metric per rank (SVG; see :func:`_floor_fig`), None without finite points."""
    return _render(_floor_fig, c)
