"""Charts drawn with matplotlib's SVG backend (works in browsers and in WeasyPrint), returned as data URIs."""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import Audit

PALETTE = ["#2563eb", "#0891b2", "#7c3aed", "#db2777", "#ea580c", "#16a34a"]


def _fig(w: float, h: float):  # type: ignore[no-untyped-def]
    from .._env import configure_matplotlib

    configure_matplotlib()  # its font cache under our cache dir, never the user's home
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update({"svg.hashsalt": "lowrank-auditor", "svg.fonttype": "none", "font.size": 9,
                                "font.family": "DejaVu Sans", "axes.spines.top": False, "axes.spines.right": False})
    return plt.subplots(figsize=(w, h))


def _uri(fig) -> str:  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _short(name: str, width: int = 38) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def share_chart(audit: "Audit", top: int = 12) -> str:
    """Top layers' parameter share as bars, the rest as one bar, and the cumulative share as a line."""
    layers = audit.layers[:top]
    labels = [_short(l.name) for l in layers]
    shares = [100 * l.share for l in layers]
    rest_layers = sum(l.share for l in audit.layers[top:])
    if rest_layers > 0:
        labels.append(f"{len(audit.layers) - top} other layers")
        shares.append(100 * rest_layers)
    labels.append("non-factorizable (norms, biases, …)")
    shares.append(100 * audit.rest_share)
    fig, ax = _fig(7.2, 0.3 * len(labels) + 0.8)
    y = list(range(len(labels)))
    colors = [PALETTE[0]] * len(layers) + ["#94a3b8"] * (len(labels) - len(layers))
    ax.barh(y, shares, color=colors, height=0.7, label="share")
    cum, acc = [], 0.0
    for s in shares:
        acc += s
        cum.append(acc)
    ax.plot(cum, y, color=PALETTE[3], marker="o", markersize=3, linewidth=1.2, label="cumulative share")
    for yi, s in zip(y, shares):
        ax.text(s + 0.8, yi, f"{s:.1f}%", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 104)
    ax.set_xlabel("% of the model's unique parameters")
    ax.axvline(80, color="#cbd5e1", linewidth=0.8, linestyle="--", zorder=0)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    return _uri(fig)


def energy_chart(audit: "Audit", top: int = 6) -> str | None:
    """Energy E(r) of the largest layers, with break-even (dashed) and the suggested rank (dot) marked."""
    curves = [(l, audit.spectra.get(l.name), audit.suggestions.get(l.name)) for l in audit.layers]
    curves = [(l, sp, sg) for l, sp, sg in curves if sp is not None and sp.energy][:top]
    if not curves:
        return None
    fig, ax = _fig(7.2, 3.4)
    for i, (l, sp, sg) in enumerate(curves):
        c = PALETTE[i % len(PALETTE)]
        k = len(sp.energy)
        xs = [100 * (r + 1) / k for r in range(k)]
        ax.plot(xs, sp.energy, color=c, linewidth=1.4, label=f"{_short(l.name, 30)} ({l.m}x{l.n})")
        be = 100 * l.break_even / k
        if be <= 100:
            ax.axvline(be, color=c, linestyle=":", linewidth=0.9)
        if sg is not None and sg.rank:
            ax.plot([100 * sg.rank / k], [sp.energy_at(sg.rank)], "o", color=c, markersize=5)
    ax.axhline(audit.settings.target_energy, color="#64748b", linewidth=0.8, linestyle="--")
    ax.text(101, audit.settings.target_energy, f"target {audit.settings.target_energy:g}", fontsize=7,
            va="center", color="#64748b")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("rank r as % of min(m, n)   (dotted: break-even; dot: suggested rank)")
    ax.set_ylabel("energy kept E(r)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    return _uri(fig)
