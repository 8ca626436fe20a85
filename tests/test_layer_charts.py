"""Per-layer charts and the share-by-group chart: real SVG, log axes, marks, hostile names, no overlapping labels."""

from __future__ import annotations

import itertools
import xml.etree.ElementTree as ET

import matplotlib
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from auditor.groups import LayerShape, group_layers
from auditor.render import layer_charts as lc

HOSTILE = [r"$\undefinedcmd{x}$", "a$b$c^_{}", "\x1b]0;title\x07\x1b[31mred", "rtl\u202egpj.exe",
           "<script>alert(1)</script>&amp;", "line\nbreak", "x" * 10_000]


def spectrum(m: int = 96, n: int = 48, seed: int = 0) -> np.ndarray:
    """Singular values of a matrix with a known decaying spectrum (float64 SVD as the reference)."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, n)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = 2.0 ** -np.arange(n, dtype=np.float64) * 10
    return np.linalg.svd(u @ np.diag(s) @ v.T, compute_uv=False)


def energy(s: np.ndarray) -> list[float]:
    e = np.cumsum(s**2)
    return list(e / e[-1])


def svg_texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert not [el for el in root.iter() if el.tag.rsplit("}", 1)[-1].lower() == "script"]
    return ["".join(el.itertext()) for el in root.iter() if el.tag.endswith("}text")]


def build(fn, *args):
    with matplotlib.rc_context(lc._RC):
        fig = fn(*args)
        FigureCanvasAgg(fig).draw()
    return fig


def test_spectrum_chart_log_axes_and_marks():
    s = spectrum()
    assert np.allclose(s[:3], [10, 5, 2.5])
    svg = lc.spectrum_chart(s, "encoder.fc", m=96, n=48, break_even=32.0, suggested=8, planned=12)
    texts = svg_texts(svg)
    assert "encoder.fc   (96 x 48)" in texts
    assert {"break-even 32.0", "suggested r=8", "planned r=12"} <= set(texts)
    assert svg == lc.spectrum_chart(s, "encoder.fc", m=96, n=48, break_even=32.0, suggested=8, planned=12)
    fig = build(lc._spectrum_fig, s, "encoder.fc", 96, 48, 32.0, 8, 12)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    y = ax.lines[0].get_ydata()
    assert y[0] == 1.0 and y[10] == pytest.approx(2.0**-10, rel=1e-9)  # sigma_i / sigma_1, checked against the SVD
    assert not any("mathdefault" in t for t in texts)


def test_energy_chart_log_rank_axis_planned_and_measured():
    s = spectrum()
    e = energy(s)
    svg = lc.energy_chart(e, "fc", m=96, n=48, break_even=32.0, suggested=3, planned=None, target=0.95)
    texts = svg_texts(svg)
    assert "suggested r=3" in texts and not any(t.startswith("planned") for t in texts)
    fig = build(lc._energy_fig, e, "fc", 96, 48, 32.0, 3, 5, 0.95, [(2, 0.5), (4, 0.9), (8, 0.97)], 0.95, "acc")
    ax, ax2 = fig.axes
    assert ax.get_xscale() == "log" and ax2.get_xscale() == "log"
    dots = {c.get_label(): c.get_offsets()[0].tolist() for c in ax.collections}
    assert dots["suggested r=3"] == pytest.approx([3, e[2]]) and dots["planned r=5"] == pytest.approx([5, e[4]])
    assert list(ax2.lines[0].get_xdata()) == [2, 4, 8] and list(ax2.lines[0].get_ydata()) == [0.5, 0.9, 0.97]
    assert ax2.lines[1].get_ydata()[0] == 0.95 and ax2.get_ylabel() == "acc"
    assert ax2.get_ylim() == ax.get_ylim() == (0, 1.02)  # a metric in [0, 1] shares the energy's scale
    fig = build(lc._energy_fig, e, "fc", 96, 48, 32.0, 3, 5, 0.95, [(2, 21.5), (8, 9.1)], 9.5, "perplexity")
    assert fig.axes[1].get_ylim()[1] > 21.5  # any other metric gets its own scale
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert "1" in ticks and "10" in ticks


def test_long_spectra_drawn_at_exact_sampled_ranks(recwarn):
    s = np.sort(np.random.default_rng(1).gamma(2, 1, 4096))[::-1]
    fig = build(lc._spectrum_fig, s, "wide", None, None, None, None, None)
    line = fig.axes[0].lines[0]
    xs, ys = line.get_xdata(), line.get_ydata()
    assert len(xs) <= lc.MAX_POINTS and xs[0] == 1 and xs[-1] == 4096 and list(xs[:5]) == [1, 2, 3, 4, 5]
    assert np.array_equal(ys, s[xs - 1] / s[0])  # exact values at the ranks drawn, nothing interpolated
    fig = build(lc._energy_fig, energy(s), "wide", None, None, None, None, None, None, None, None, "")
    assert fig.axes[0].get_legend() is None and not [w for w in recwarn if "legend" in str(w.message)]


def test_nested_single_group_and_marks_beyond_min_side():
    s = spectrum()
    fig = build(lc._spectrum_fig, [list(s)], "fc", 96, 48, 32.0, None, 60)  # Spectrum.sigma is groups x k
    ax = fig.axes[0]
    assert len(ax.lines) == 1 + 2 and ax.lines[0].get_label().startswith("_")  # one unnamed curve, two marks
    assert ax.get_xlim()[1] == pytest.approx(60 * 1.15)  # a planned rank above min(m, n) stays in view
    fig = build(lc._spectrum_fig, [list(s), list(s)], "conv", 96, 48, None, None, None)
    assert [l.get_label() for l in fig.axes[0].lines] == ["group 0", "group 1"]


def test_identical_curves_stay_distinguishable():
    s = spectrum()
    fig = build(lc._spectrum_fig, {"a": s, "b": s, "c": s}, "same", None, None, None, None, None)
    lines = fig.axes[0].lines
    assert len(lines) == 3
    styles = {(l.get_color(), str(l.get_linestyle()), l.get_marker()) for l in lines}
    assert len(styles) == 3
    marks = [tuple(l.get_markevery()) for l in lines]
    assert len(set(marks)) == 3  # markers shifted so every curve shows its own


def test_many_members_drawn_as_band():
    members = {f"h.{i}.mlp": spectrum(seed=i) for i in range(32)}
    svg = lc.spectrum_chart(members, "h.*.mlp", m=96, n=48)
    assert "32 members: min–max" in svg_texts(svg) and "median" in svg_texts(svg)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_render(name):
    s = spectrum()
    for svg in (lc.spectrum_chart({name: s, name + "2": s}, name, suggested=4),
                lc.energy_chart({name: energy(s)}, name, planned=4, measured=[(4, 0.9)], measured_label=name),
                lc.group_share_chart([name, "b"], [60, 30], 100, counts=[3, 1])):
        texts = " ".join(svg_texts(svg))
        assert "\x1b" not in texts and "\u202e" not in texts and "\n" not in texts.replace("\n(dashed", "")
    if name.startswith("$"):
        assert name in texts  # drawn literally
        from matplotlib.figure import Figure
        with matplotlib.rc_context({"text.parse_math": True}), pytest.raises(ValueError):  # the control
            fig = Figure()
            fig.suptitle(name)
            FigureCanvasAgg(fig).draw()


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("case", ["llama", "one-huge", "equal"])
def test_share_labels_never_collide(case):
    if case == "llama":
        from test_groups import llama7b

        groups = group_layers(llama7b())
        labels, params, counts = [g.label for g in groups], [g.params for g in groups], [g.size for g in groups]
        total = 6_738_415_616
    elif case == "one-huge":
        labels, params, counts, total = ["big", "tiny", "tinier"], [9_990, 9, 1], None, 10_000
    else:
        labels, params, counts, total = [f"g{i}" for i in range(40)], [25] * 40, None, 1_010
    fig = build(lc._share_fig, labels, params, total, counts, 12)
    ax, axc = fig.axes
    r = fig.canvas.get_renderer()
    values = [t for t in ax.texts if t.get_gid() == "share-value"]
    boxes = [t.get_window_extent(r) for t in values]
    assert len(boxes) == len(ax.patches)
    for a, b in itertools.combinations(boxes, 2):
        assert not overlaps(a, b)
    for box in boxes:
        assert box.x1 <= ax.bbox.x1 and not overlaps(box, axc.bbox)  # inside the bars' axes, off the cumulative
    cum = axc.lines[0].get_xdata()
    assert cum[-1] == pytest.approx(100.0)
    if case == "llama":
        assert [t.get_text() for t in values] == ["21.4%"] * 3 + ["8.0%"] * 4 + ["1.9%", "1.9%", "0.0%"]
        assert ax.get_yticklabels()[2].get_text() == "model.layers.*.mlp.down_proj  ×32"
    if case == "equal":
        assert ax.get_yticklabels()[12].get_text() == "28 other groups"
        assert values[12].get_text() == "69.3%" and values[-1].get_text() == "1.0%" and len(values) == 14


def test_nothing_to_draw_and_bad_lengths():
    assert lc.spectrum_chart([0.0, 0.0], "zero") is None
    assert lc.spectrum_chart([], "empty") is None
    assert lc.energy_chart([], "empty") is None
    assert lc.group_share_chart([], [], 0) is None
    with pytest.raises(ValueError, match="same length"):
        lc.group_share_chart(["a"], [1, 2], 3)


def test_labels():
    enc = lc.short_label("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    dec = lc.short_label("decoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    assert enc != dec and len(enc) == len(dec) == 40 and enc.endswith("relative_attention_bias")
    assert lc.safe_label("a\x1bb\u2066") == "a\\u001Bb\\u2066"
    assert lc.data_uri("<svg/>") == "data:image/svg+xml;base64,PHN2Zy8+"
    assert group_layers([LayerShape("a", 2, 2)])[0].label == "a"
