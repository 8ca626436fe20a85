"""Charts drawn with matplotlib's SVG backend: the parameter share by group (:func:`group_share_chart`), and the
shared machinery (:func:`_render`, :func:`_figure`, :func:`_log_rank_axis`) that :mod:`auditor.render.calibration`
draws its measured charts with. The per-layer spectrum and energy charts are inline SVG (:mod:`auditor.render.pages`).

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
from typing import Any, Sequence

import numpy as np

__all__ = ["data_uri", "group_share_chart", "safe_label", "short_label"]

PALETTE = ["#2563eb", "#0891b2", "#7c3aed", "#db2777", "#ea580c", "#16a34a"]
GREY = "#94a3b8"
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
