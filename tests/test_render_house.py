"""The report package's house rules (issue 30): every function of ``auditor/render`` at most 60 lines and 8
parameters, every figure drawn behind ``layer_charts``' public functions, and one table of output formats that the
command line reads instead of naming formats."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

RENDER = Path(__file__).resolve().parents[1] / "auditor" / "render"
MAX_LINES, MAX_PARAMS = 60, 8


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, lines, parameters other than self/cls) of every function in ``path``, nested ones included."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            params += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            out.append((n.name, n.end_lineno - n.lineno + 1, len(params)))  # type: ignore[operator]
    return out


@pytest.mark.parametrize("path", sorted(RENDER.rglob("*.py")), ids=lambda p: p.relative_to(RENDER).as_posix())
def test_render_functions_are_short_and_take_few_parameters(path):
    over = [f"{name}: {lines} lines, {params} parameters" for name, lines, params in _functions(path)
            if lines > MAX_LINES or params > MAX_PARAMS]
    assert not over, f"{path.name}: split these into named steps or pass a parameter object: {over}"


def test_the_counter_counts(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text("def f(a, b, *c, d=1, **e):\n" + "    x = 1\n" * 70 + "\n\nclass C:\n    def m(self, a):\n"
                 "        return a\n", encoding="utf-8")
    assert _functions(p) == [("f", 71, 5), ("m", 2, 1)]


def test_no_module_reaches_into_the_charts_private_parts():
    private = re.compile(r"from \.layer_charts import [^\n]*\b_\w+|layer_charts\._\w+")
    hits = [p.name for p in RENDER.rglob("*.py") if p.name != "layer_charts.py" and private.search(p.read_text())]
    assert hits == []


def test_the_command_line_names_no_format():
    # the one exception: the JSON report may replace the --baseline it was compared with (a baseline is JSON)
    cli = "\n".join(line for line in (RENDER.parent / "cli" / "audit_command.py").read_text(encoding="utf-8")
                    .splitlines() if "--baseline" not in line)
    from auditor.render import REPORTERS

    named = [f for f in REPORTERS if re.search(rf"""(==|!=|in \(|\[)\s*["']{f}["']""", cli)]
    assert named == []  # where a format goes, it asks the table (Reporter.stdout), whatever the formats are


def test_no_renderer_and_no_verdict_asks_the_metric_direction():
    """What the reports and the verdict need of the metric's direction (which values hold, how a value and a change
    read, which side of the tolerance line fails) they ask ``CalibrationReport.facts`` (auditor.calresults.MetricFacts,
    built from the metric kind's answers); the metric kinds' own direction is read through ``MetricKind.better``."""
    hits = [f"{p.relative_to(RENDER.parent).as_posix()}:{i}" for root in (RENDER, RENDER.parent / "verdict")
            for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "higher_is_better" in line]
    assert hits == []
