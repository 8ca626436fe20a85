"""The share-by-group chart and the chart helpers: real SVG, hostile names, no overlapping labels."""

from __future__ import annotations

import itertools
import xml.etree.ElementTree as ET

import matplotlib
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from auditor.planning.groups import LayerShape, group_layers
from auditor.render.parts import layer_charts as lc

HOSTILE = [r"$\undefinedcmd{x}$", "a$b$c^_{}", "\x1b]0;title\x07\x1b[31mred", "rtl\u202egpj.exe",
           "<script>alert(1)</script>&amp;", "line\nbreak", "x" * 10_000]


def svg_texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert not [el for el in root.iter() if el.tag.rsplit("}", 1)[-1].lower() == "script"]
    return ["".join(el.itertext()) for el in root.iter() if el.tag.endswith("}text")]


def build(fn, *args):
    with matplotlib.rc_context(lc._RC):
        fig = fn(*args)
        FigureCanvasAgg(fig).draw()
    return fig


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_render(name):
    texts = " ".join(svg_texts(lc.group_share_chart([name, "b"], [60, 30], 100, counts=[3, 1])))
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
    assert lc.group_share_chart([], [], 0) is None
    with pytest.raises(ValueError, match="same length"):
        lc.group_share_chart(["a"], [1, 2], 3)


def test_log_rank_axis_keeps_marks_beyond_min_side_in_view():
    from matplotlib.figure import Figure

    with matplotlib.rc_context(lc._RC):
        fig = Figure()
        ax = fig.subplots()
        ax.plot([1, 48], [0.0, 1.0])
        lc._log_rank_axis(ax, 48, 32.0, None, 60)  # a planned rank 60 above min(m, n) = 48
        FigureCanvasAgg(fig).draw()
    assert ax.get_xscale() == "log" and ax.get_xlim() == pytest.approx((0.85, 60 * 1.15))
    lo, hi = ax.get_xlim()
    shown = [t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= x <= hi]
    assert shown == ["1", "2", "5", "10", "20", "50"]
    ax.cla()
    lc._log_rank_axis(ax, 48, None, 0, -1)  # absent or non-positive marks do not widen the axis
    assert ax.get_xlim() == pytest.approx((0.85, 48 * 1.15))


def test_labels():
    enc = lc.short_label("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    dec = lc.short_label("decoder.block.0.layer.0.SelfAttention.relative_attention_bias", 40)
    assert enc != dec and len(enc) == len(dec) == 40 and enc.endswith("relative_attention_bias")
    assert lc.safe_label("a\x1bb\u2066") == "a\\u001Bb\\u2066"
    assert lc.data_uri("<svg/>") == "data:image/svg+xml;base64,PHN2Zy8+"
    assert group_layers([LayerShape("a", 2, 2)])[0].label == "a"


# ---- the layer pages' charts, the energy overview and the shared legend (matplotlib only) -----------------------
def _page(**kw):
    import numpy as np

    sig = [np.array([1.0, 0.5, 0.1, 0.02, 0.001])]
    en = [np.cumsum(sig[0] ** 2) / np.sum(sig[0] ** 2)]
    args = dict(be=2.5, sug=2, plan=3, target=0.95, measured=None, metric="relative output error") | kw
    measured = lc.MeasuredPanel(args["measured"], args["metric"]) if args["measured"] else None
    return build(lc._page_fig, sig, en, lc.Marks(args["be"], args["sug"], args["plan"], args["target"]), measured)


def test_page_chart_axes_and_a_log_axis_where_the_data_span_decades():
    fig = _page(measured=[[(2, 0.5), (3, 0.01), (4, 0.001)]])
    spec, energy, meas = fig.axes
    assert [a.get_gid() for a in fig.axes] == ["panel-spectrum", "panel-energy", "panel-measured"]
    assert spec.get_yscale() == "log" and spec.get_xscale() == "log"
    assert energy.get_yscale() == "log" and energy.yaxis_inverted()  # 1 - E, E growing upwards
    assert meas.get_yscale() == "log"  # 0.5 to 0.001: more than two decades
    assert 2 / 1.5 < meas.get_xlim()[0] < 2  # the measured axis starts just below the first rank measured
    assert "\\mathdefault" not in " ".join(t.get_text() for t in spec.get_yticklabels())
    flat = _page(measured=[[(2, 0.05), (3, 0.02), (4, 0.01)]]).axes[2]
    assert flat.get_yscale() == "linear"  # under two decades: linear
    assert energy.get_legend() is None and spec.get_legend() is None  # one legend for every page, drawn apart


def test_page_legend_swatches_are_the_lines_styles():
    from matplotlib.colors import to_hex

    fig = _page()
    marks = {l.get_gid(): l for l in fig.axes[1].get_lines() if (l.get_gid() or "").startswith("mark-")}
    assert set(marks) == {"mark-break-even", "mark-suggested", "mark-planned", "mark-target"}
    kinds = ["break-even", "suggested", "planned", "target", "curve"]
    legend = build(lc._legend_fig, [(k, k) for k in kinds]).legends[0]
    for kind, h in zip(kinds, legend.legend_handles):
        line = marks.get(f"mark-{kind}") or next(l for l in fig.axes[1].get_lines() if l.get_gid() == "curve-0")
        assert (to_hex(h.get_color()), h.get_linestyle(), h.get_linewidth()) == \
            (to_hex(line.get_color()), line.get_linestyle(), line.get_linewidth()), kind
        assert h._dash_pattern == line._dash_pattern, kind  # the very dashes, not only "dashed"
    assert len({to_hex(lc.STYLE[k]["color"]) for k in ("break-even", "suggested", "planned", "measured")}) == 4


def test_charts_are_deterministic_and_carry_no_date():
    import numpy as np

    e = [np.linspace(0.1, 1.0, 40)]
    one = lc.energy_overview_chart(e, ["a"], 0.9)
    assert one == lc.energy_overview_chart(e, ["a"], 0.9)
    assert "<dc:date>" not in one and "dc:date" not in one
    s = lc.page_chart([np.linspace(1, 0.01, 40)], e, lc.Marks(break_even=20.0, target=0.9))
    assert s == lc.page_chart([np.linspace(1, 0.01, 40)], e, lc.Marks(break_even=20.0, target=0.9))
    assert lc.page_chart([], []) is None and lc.legend_chart([]) is None
    for name in HOSTILE:
        svg_texts(lc.energy_overview_chart(e, [name], 0.9))  # well-formed, no script


def _tight(fig) -> str:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="svg", dpi=72, bbox_inches="tight", pad_inches=lc.PAD, metadata={"Date": None})
    return buf.getvalue().decode("utf-8")


def _size(svg: str) -> tuple[float, float]:
    root = ET.fromstring(svg)
    return float(root.get("width").removesuffix("pt")), float(root.get("height").removesuffix("pt"))


def test_a_chart_is_cropped_to_the_box_bbox_inches_tight_gives_in_one_draw():
    """A layer page's chart (everything inside its figure) is drawn once and cropped by its root's viewBox to the
    size ``bbox_inches="tight"`` gives, its background under all of it; a chart with its legend outside the figure is
    that tight output itself (drawn on the figure's canvas, the legend's lines would be cut)."""
    import numpy as np

    s = [np.linspace(1.0, 0.01, 96)]
    e = [np.cumsum(s[0] ** 2) / np.sum(s[0] ** 2)]
    args = (s, e, lc.Marks(48.0, 20, 24), lc.MeasuredPanel([[(8, 3.0), (16, 1.0), (32, 0.2)]], "ppl", 0.5))
    with matplotlib.rc_context(lc._RC):
        once, tight = lc._svg(lc._page_fig(*args)), _tight(lc._page_fig(*args))
        assert once != tight and _size(once) == pytest.approx(_size(tight), abs=1e-3)
        root = ET.fromstring(once)
        box = [float(v) for v in root.get("viewBox").split()]
        ground = next(el for el in root if el.tag.endswith("}rect"))
        assert [float(ground.get(k)) for k in ("x", "y", "width", "height")] == pytest.approx(box)
        assert box[2:] == pytest.approx(list(_size(once)))
        outside = (e * 3, ["a", "b", "c"], 0.99)  # the overview's legend stands right of its figure
        assert lc._svg(lc._overview_fig(*outside)) == _tight(lc._overview_fig(*outside))
