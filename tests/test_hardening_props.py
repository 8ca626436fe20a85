"""Property-based checks (hypothesis) over plan files, layer names and shapes, through the command line in this
process: the exit code is 0, 1 or 2, there is never a traceback, a refusal is one line, nothing is written outside
-o (and --emit-plan there), and an emitted plan reads back to exactly the suggested ranks.

Bounded and deterministic: ``derandomize=True`` (the same examples on every run, no example database), few examples
(the file runs in well under a minute once torch is imported)."""

from __future__ import annotations

import json
import math
import tempfile
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from auditor.config import Settings
from auditor.planning.groups import toml_string
from _factories import write_low_rank_mlp

BOUNDED = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])



def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check_run(res, root: Path, before: set[str], out: Path) -> None:
    """Exit 0/1/2, no traceback, a refusal is one 'error:' line and leaves no output, nothing new outside out/."""
    assert res.returncode in (0, 1, 2), res
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    new = _files(root) - before
    assert all(p == out.name or p.startswith(out.name + "/") for p in new), new
    if res.returncode == 2:
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert not out.exists()
    else:
        json.loads((out / "lowrank-audit.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))


# -- plan files ------------------------------------------------------------------------------------------------------

SETTING_NAMES = [f.replace("_", "-") if i % 3 == 0 else f for i, f in enumerate(Settings.__dataclass_fields__)]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["0be", "0.5be", "1be", "2be", "energy:0.9", "energy:0", "energy:1.5", "8", "-8", " 16 ",
                     "1e3", "nan", "error", "warning", "never", "nevr", "LR004", "LR0O4", "0.9,0.95"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=6)
patterns = st.one_of(st.sampled_from(["0", "2", "4", "*", "[02]", "0.weight", "fc1", "?", "[", "2*"]),
                     st.text(max_size=6))
rank_specs = st.one_of(st.integers(min_value=-4, max_value=80), st.integers(min_value=2**31 - 2, max_value=2**64),
                       st.sampled_from(["0be", "0.5be", "0.01be", "0.9be", "energy:0.9", "energy:0.5", "8", "x"]),
                       st.floats(), st.booleans())
plans = st.one_of(
    values,
    st.fixed_dictionaries(
        {"ranks": st.dictionaries(patterns, rank_specs, max_size=4)},
        optional={"finetune": st.one_of(st.text(max_size=10), values),
                  "thresholds": st.dictionaries(st.sampled_from(SETTING_NAMES), values, max_size=3),
                  "extra": values}),
)


def _toml_value(v) -> str | None:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        try:
            return toml_string(v)
        except ValueError:
            return None
    if isinstance(v, list):
        items = [_toml_value(x) for x in v]
        return None if None in items else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(v, dict):
        items = [(_toml_value(k), _toml_value(x)) for k, x in v.items()]
        if any(a is None or b is None for a, b in items):
            return None
        return "{" + ", ".join(f"{a} = {b}" for a, b in items) + "}"
    return None  # None has no TOML form


def _toml(data) -> str:
    """``data`` as TOML text where it has a form (a top-level non-table becomes ``value = ...``)."""
    if not isinstance(data, dict):
        return f"value = {_toml_value(data) or 0}\n"
    lines = [f"{toml_string(k)} = {_toml_value(v)}" for k, v in data.items()
             if _toml_value(v) is not None and _safe(k)]
    return "\n".join(lines) + "\n"


def _safe(k: str) -> bool:
    try:
        toml_string(k)
        return True
    except ValueError:
        return False


@BOUNDED
@given(plan=plans, as_json=st.booleans())
def test_any_plan_file_is_handled(cli_inproc, plan, as_json):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        src = write_low_rank_mlp(root)
        path = root / ("plan.json" if as_json else "plan.toml")
        path.write_text(json.dumps(plan) if as_json else _toml(plan), encoding="utf-8", errors="surrogatepass")
        before = _files(root)
        out = root / "out"
        res = cli_inproc(src, "-q", "--plan", path, "--format", "json", "-o", out, cwd=root)
        _check_run(res, root, before, out)
        if res.returncode != 2:  # a plan the tool accepted: every rank it reviews is a whole number >= 1
            items = json.loads((out / "lowrank-audit.json").read_text())["plan_review"]["items"]
            assert all(isinstance(i["rank"], int) and i["rank"] >= 1 for i in items)


# -- names and shapes ------------------------------------------------------------------------------------------------

SPECIAL = ["\n", "\r", "\t", "\x00", "\x1b[31m", "\x1b]0;t\x07", "\u202e", "\u2028", "\x85", "[", "]", "*", "?", "!",
           "`", "<b>", "](x)", "$\\x$", "#", '"', "'", "\\", "|", "\U0001d534", "\U0001f642", "0", "1", "."]
name_parts = st.one_of(st.sampled_from(SPECIAL),
                       st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=4))
base_names = st.lists(name_parts, min_size=1, max_size=4).map("".join).filter(
    lambda s: s.strip(".") == s and ".." not in s)
layers = st.lists(st.tuples(base_names, st.integers(8, 24), st.integers(8, 24), st.integers(1, 3)),
                  min_size=1, max_size=4, unique_by=lambda t: t[0])


@BOUNDED
@given(spec=layers)
def test_emitted_plans_read_back_whatever_the_names(cli_inproc, spec):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        g = torch.Generator().manual_seed(1)
        tensors = {f"{name}.weight": (torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)).contiguous()
                   for name, m, n, r in spec}
        save_file(tensors, str(root / "w.safetensors"))
        before = _files(root)
        out = root / "out"
        res = cli_inproc(root / "w.safetensors", "-q", "--format", "json", "-o", out, "--emit-plan",
                         out / "plan.toml", cwd=root)
        _check_run(res, root, before, out)
        assert res.returncode == 0, res.stderr
        suggested = json.loads((out / "lowrank-audit.json").read_text())
        want = {i["layer"]: i["rank"] for i in suggested["plan_review"]["items"]}
        assert sorted(l["name"] for l in suggested["layers"]) == sorted(name for name, *_ in spec)
        text = (out / "plan.toml").read_text(encoding="utf-8")
        assert not any(unicodedata.category(c) == "Cc" and c != "\n" for c in text)  # controls only escaped
        if not want:
            return
        plan = root / "plan.toml"
        plan.write_text(text.replace('finetune = ""', 'finetune = "1 epoch"'), encoding="utf-8")
        res = cli_inproc(root / "w.safetensors", "-q", "--format", "json", "-o", root / "again", "--plan", plan,
                         cwd=root)
        assert res.returncode in (0, 1), res.stderr
        reviewed = json.loads((root / "again" / "lowrank-audit.json").read_text())
        assert {i["layer"]: i["rank"] for i in reviewed["plan_review"]["items"]} == want


_RAW = {c for c in map(chr, range(0x20)) if c != "\n"} | {"\x7f", "\x85", "\u202e", "\u2028"}


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=layers)
def test_markdown_and_terminal_show_no_raw_controls_from_names(cli_inproc, spec):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        g = torch.Generator().manual_seed(2)
        save_file({f"{name}.weight": torch.randn(m, n, generator=g) for name, m, n, _ in spec},
                  str(root / "w.safetensors"))
        res = cli_inproc(root / "w.safetensors", "--format", "text,md", "-o", root / "out", cwd=root)
        assert res.returncode in (0, 1), res.stderr
        md = (root / "out" / "lowrank-audit.md").read_text(encoding="utf-8")
        for text in (md, res.stdout, res.stderr):
            assert not (_RAW & set(text)), [c for c in text if c in _RAW][:5]
