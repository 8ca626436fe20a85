"""Charts for one layer or one group of layers, and the parameter share by group: matplotlib's SVG backend.

Each function takes plain numbers (lists or arrays, ints) and returns an SVG document as a string (``None`` where
there is nothing to draw); :func:`data_uri` turns one into an ``<img src>``. Like :mod:`auditor.render.charts`,
text stays text (``svg.fonttype = none``), the output is deterministic (fixed hash salt, no date), nothing is
fetched. Names are drawn as plain text: mathtext is off (a name like ``$\\undefinedcmd{x}$`` would crash it) and
control or bidirectional-override characters are shown as ``\\uXXXX``. Figures are built with
``matplotlib.figure.Figure``, never pyplot, so nothing global is left behind.

Overlaid curves get distinct colours, line styles and markers, so identical spectra stay visible; more than
:data:`MAX_OVERLAY` curves are drawn as their median and min-max band.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["MAX_OVERLAY", "data_uri", "energy_chart", "group_share_chart", "safe_label", "short_label",
           "spectrum_chart"]

PALETTE = ["#2563eb", "#0891b2", "#7c3aed", "#db2777", "#ea580c", "#16a34a"]
STYLES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 1))]
MARKERS = ["o", "s", "^", "D", "v", "P"]
MAX_OVERLAY = 6
GREY = "#94a3b8"
_RC = {"svg.hashsalt": "lowrank-auditor", "svg.fonttype": "none", "font.size": 9, "font.family": "DejaVu Sans",
       "axes.spines.top": False, "axes.spines.right": False, "text.parse_math": False, "text.usetex": False,
       "axes.unicode_minus": False}

Series = Sequence[float] | np.ndarray
Curves = Series | Mapping[str, Series]


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


def _svg(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue().decode("utf-8")


def _render(build: Any, *args: Any, **kwargs: Any) -> str | None:
    from .._env import configure_matplotlib

    configure_matplotlib()  # its font cache under our cache dir, never the user's home
    import matplotlib

    with matplotlib.rc_context(_RC):
        fig = build(*args, **kwargs)
        return None if fig is None else _svg(fig)


def _as_series(curves: Curves) -> dict[str, np.ndarray]:
    if isinstance(curves, Mapping):
        return {str(k): np.asarray(v, dtype=np.float64).ravel() for k, v in curves.items()}
    arr = np.asarray(curves, dtype=np.float64)
    if arr.ndim == 2 and arr.shape[0] > 1:  # groups x k (grouped convolution)
        return {f"group {i}": row for i, row in enumerate(arr)}
    return {"": arr.ravel()}


def _fmt(v: float, _pos: Any = None) -> str:
    if v <= 0:
        return ""
    if v >= 1 and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:g}"


def _log_rank_axis(ax: Any, k: int, *marks: float | None) -> None:
    """Log-scaled rank axis from 1 to k, widened to show any mark beyond k (a planned rank above min(m, n))."""
    from matplotlib import ticker

    ax.set_xscale("log")
    ax.set_xlim(0.85, max([k, *(x for x in marks if x is not None and x > 0)]) * 1.15)
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_fmt))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


MAX_POINTS = 400  # points drawn per curve: exact values at ranks spread evenly on the log axis


def _sample(k: int) -> np.ndarray:
    """0-based indices of the ranks drawn: all of them up to MAX_POINTS, else ranks spread evenly on the log axis
    (the values there are exact; nothing is interpolated), always with the first and the last."""
    if k <= MAX_POINTS:
        return np.arange(k)
    return np.unique(np.round(np.geomspace(1, k, MAX_POINTS)).astype(np.int64) - 1)


def _markevery(xs: np.ndarray, i: int) -> list[int]:
    """Marker positions spread evenly on a log axis, shifted per series so equal curves show every marker set."""
    if len(xs) <= 1:
        return [0]
    want = np.geomspace(1, xs[-1], 9) * (1 + 0.07 * i)
    pos = np.unique(np.clip(np.searchsorted(xs, want), 0, len(xs) - 1))
    return [int(p) for p in pos]


def _overlay(ax: Any, series: dict[str, np.ndarray], transform: Any) -> None:
    """Each curve with its own colour, line style and marker; past MAX_OVERLAY, the median and min-max band."""
    if len(series) <= MAX_OVERLAY:
        for i, (label, y) in enumerate(series.items()):
            yy = transform(y)
            idx = _sample(len(yy))
            xs = idx + 1
            ax.plot(xs, yy[idx], color=PALETTE[i % 6], linestyle=STYLES[i % 6], marker=MARKERS[i % 6],
                    markersize=3.5, markevery=_markevery(xs, i), markerfacecolor="none" if i % 2 else PALETTE[i % 6],
                    linewidth=1.4, label=short_label(label, 40) if label else None, zorder=3 + 0.01 * i)
        return
    k = max(len(y) for y in series.values())
    stack = np.full((len(series), k), np.nan)
    for i, y in enumerate(series.values()):
        stack[i, : len(y)] = transform(y)
    idx = _sample(k)
    stack = stack[:, idx]
    xs = idx + 1
    with np.errstate(all="ignore"):
        lo, med, hi = np.nanmin(stack, 0), np.nanmedian(stack, 0), np.nanmax(stack, 0)
    ax.fill_between(xs, lo, hi, color=PALETTE[0], alpha=0.18, linewidth=0, label=f"{len(series)} members: min–max")
    ax.plot(xs, med, color=PALETTE[0], linewidth=1.4, label="median")


def _rank_marks(ax: Any, break_even: float | None, suggested: int | None, planned: int | None,
                y_of: Any = None) -> None:
    if break_even is not None and break_even > 0:
        ax.axvline(break_even, color="#64748b", linestyle=(0, (4, 2)), linewidth=1.0, zorder=2,
                   label=f"break-even {break_even:,.1f}")
    for rank, name, style in ((suggested, "suggested", dict(marker="o", s=42, color="#16a34a", zorder=6)),
                              (planned, "planned", dict(marker="D", s=70, facecolors="none", edgecolors="#dc2626",
                                                        linewidths=1.6, zorder=7))):
        if rank is None or rank <= 0:
            continue
        if y_of is None:
            ax.axvline(rank, color=style.get("color", "#dc2626"), linewidth=0.9,
                       linestyle="-" if name == "planned" else ":", zorder=2, label=f"{name} r={rank:,}")
        else:
            ax.scatter([rank], [y_of(rank)], label=f"{name} r={rank:,}", **style)


def _title(ax: Any, title: str, m: int | None, n: int | None) -> None:
    shape = f"   ({m:,} x {n:,})" if m and n else ""
    ax.set_title(short_label(title, 70) + shape, fontsize=9, loc="left")


def _spectrum_fig(curves: Curves, title: str, m: int | None, n: int | None, break_even: float | None,
                  suggested: int | None, planned: int | None) -> Any:
    series = {k: v for k, v in _as_series(curves).items() if v.size and np.isfinite(v).all() and v.max() > 0}
    if not series:
        return None
    k = max(len(v) for v in series.values())
    fig, ax = _figure(7.2, 3.0)

    def rel(s: np.ndarray) -> np.ndarray:
        s = np.sort(np.abs(s))[::-1]
        return np.where(s > 0, s / s[0], np.nan)

    _overlay(ax, series, rel)
    _rank_marks(ax, break_even, suggested, planned)
    _log_rank_axis(ax, k, break_even, suggested, planned)
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, numticks=8))  # at most 8 labelled decades
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_fmt))
    ax.yaxis.set_minor_locator(ticker.NullLocator())  # minor ticks on many decades cost more than they tell
    ax.set_xlabel("index i (log scale)")
    ax.set_ylabel("σᵢ / σ₁ (log scale)")
    ax.grid(True, which="major", color="#e2e8f0", linewidth=0.6)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False, loc="lower left")
    _title(ax, title, m, n)
    return fig


def spectrum_chart(sigma: Curves, title: str, *, m: int | None = None, n: int | None = None,
                   break_even: float | None = None, suggested: int | None = None,
                   planned: int | None = None) -> str | None:
    """Singular values sigma_i / sigma_1 against i, both axes logarithmic, for one layer or a group.

    ``sigma``: one sequence of singular values, a groups x k array (grouped convolution), or a mapping of member
    name to sequence (a block group; more than :data:`MAX_OVERLAY` members are drawn as median and band).
    Zero values are left out of the log axis. ``break_even`` (vertical dashed line), ``suggested`` and ``planned``
    (vertical lines) mark ranks. None when no series has a positive finite value.
    """
    return _render(_spectrum_fig, sigma, title, m, n, break_even, suggested, planned)


def _energy_fig(energy: Curves, title: str, m: int | None, n: int | None, break_even: float | None,
                suggested: int | None, planned: int | None, target: float | None,
                measured: Sequence[tuple[int, float]] | None, measured_floor: float | None, measured_label: str) -> Any:
    series = {k: v for k, v in _as_series(energy).items() if v.size and np.isfinite(v).all()}
    if not series:
        return None
    k = max(len(v) for v in series.values())
    fig, ax = _figure(7.2, 3.4)
    _overlay(ax, series, lambda y: y)
    first = next(iter(series.values())) if len(series) <= MAX_OVERLAY else np.nanmedian(
        np.vstack([np.pad(v, (0, k - len(v)), constant_values=np.nan) for v in series.values()]), 0)

    def e_at(r: int) -> float:
        return float(first[min(r, len(first)) - 1])

    _rank_marks(ax, break_even, suggested, planned, y_of=e_at)
    if target is not None:
        ax.axhline(target, color="#64748b", linewidth=0.8, linestyle=":", zorder=1, label=f"target E = {target:g}")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("rank r (log scale)")
    ax.set_ylabel("energy kept E(r)")
    ax.grid(True, which="major", color="#e2e8f0", linewidth=0.6)
    handles, labels = ax.get_legend_handles_labels()
    if measured:
        pts = sorted((int(r), float(v)) for r, v in measured if r > 0 and math.isfinite(v))
        ax2 = ax.twinx()
        ax2.spines["right"].set_visible(True)
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], color="#ea580c", marker="s", markersize=4,
                 linewidth=1.3, linestyle="--", label=short_label(measured_label, 30) + " (measured)")
        if measured_floor is not None:
            ax2.axhline(measured_floor, color="#ea580c", linewidth=0.8, linestyle=(0, (1, 2)),
                        label=f"floor {measured_floor:g}")
        ax2.set_ylabel(short_label(measured_label, 30), color="#ea580c")
        values = [p[1] for p in pts] + ([measured_floor] if measured_floor is not None else [])
        if values and 0 <= min(values) and max(values) <= 1:
            ax2.set_ylim(0, 1.02)  # a metric in [0, 1] (accuracy) on the energy's scale: heights compare honestly
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    _log_rank_axis(ax, k, break_even, suggested, planned)  # after twinx: the shared x axis keeps these ticks
    if handles:
        ax.legend(handles, labels, fontsize=7, frameon=False, loc="upper left",
                  bbox_to_anchor=(1.08 if measured else 1.0, 1.0))
    _title(ax, title, m, n)
    return fig


def energy_chart(energy: Curves, title: str, *, m: int | None = None, n: int | None = None,
                 break_even: float | None = None, suggested: int | None = None, planned: int | None = None,
                 target: float | None = None, measured: Sequence[tuple[int, float]] | None = None,
                 measured_floor: float | None = None, measured_label: str = "metric") -> str | None:
    """Cumulative energy E(r) against rank r on a logarithmic rank axis, for one layer or a group.

    ``energy``: E(r) for r = 1..min(m, n) (``Spectrum.energy``), or a mapping of member name to such curves.
    Marks: ``break_even`` as a vertical dashed line, ``suggested`` (filled dot) and ``planned`` (open diamond; None
    when there is no plan) on the curve, ``target`` as a horizontal line. ``measured``: (rank, metric) points from
    calibration, drawn on their own right-hand axis with ``measured_floor`` as a horizontal line. None when no
    curve is finite.
    """
    return _render(_energy_fig, energy, title, m, n, break_even, suggested, planned, target, measured,
                   measured_floor, measured_label)


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
