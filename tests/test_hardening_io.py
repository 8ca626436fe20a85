"""Issue 32, part B: what the tool writes and prints. The Action's audit step with hostile inputs, a closed pipe on
stdout and stderr, and the properties behind the corpus cases of ``tests/corpus/round4_io.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIGITS = f"{ROOT / 'sample_models' / 'digits.py'}:mlp"


# ---- the Action ------------------------------------------------------------------------------------------------
def _action_step(tmp_path: Path, **inputs: str) -> tuple[subprocess.CompletedProcess, list[str], str]:
    """The audit step as the runner runs it; the raw lines of $GITHUB_OUTPUT (a second line would be an injection)."""
    yaml = pytest.importorskip("yaml")
    from test_integrations import _env, _shim

    action = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
    step = next(s for s in action["runs"]["steps"] if s.get("id") == "audit")
    values = {**{k: str(v.get("default", "")) for k, v in action["inputs"].items()}, **inputs}
    env = _env()
    for name, expr in step["env"].items():
        env[name] = values[expr.removeprefix("${{ inputs.").removesuffix(" }}")]
    env["PATH"] = f"{_shim(tmp_path / 'bin')}{os.pathsep}{env['PATH']}"
    env["GITHUB_OUTPUT"] = str(tmp_path / "github_output")
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "summary.md")
    r = subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    return r, (tmp_path / "github_output").read_text().splitlines(), (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("field", ["output-dir", "plan", "model", "fail-on"])
def test_action_input_with_a_line_break_adds_no_output_line(tmp_path, field):
    inputs = {"model": DIGITS, "args": "--no-spectra", field: "x\nexit-code=0"}
    r, lines, summary = _action_step(tmp_path, **inputs)
    assert r.returncode == 0, r.stderr
    assert lines == ["exit-code=2"], lines  # one line: the failing step cannot be turned into a passing one
    assert f"the {field} input holds a line break" in r.stderr and "line break" in summary
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


def test_action_model_that_looks_like_an_option_is_a_model(tmp_path):
    r, lines, _ = _action_step(tmp_path, model="--version", args="--no-spectra")
    assert lines[-1] == "exit-code=2" and lines.count("exit-code=2") == 1, (lines, r.stderr)
    assert "lowrank-audit " not in r.stdout  # --version was not read as the option
    assert "error: " in r.stderr and "--version" in r.stderr


def test_action_args_are_not_glob_expanded(tmp_path):
    (tmp_path / "--no-spectra").write_text("")  # a file a glob in args would expand to
    (tmp_path / "--oops").write_text("")
    r, lines, _ = _action_step(tmp_path, model=DIGITS, args="--energy 0.9 --select LR00*")
    # "LR00*" reaches the tool as written: it is a rule-code pattern the tool refuses, not a list of file names
    assert lines[-1] == "exit-code=2", (lines, r.stderr)
    assert "LR00*" in r.stderr and "--oops" not in r.stderr, r.stderr


# ---- what the tool writes reads back -------------------------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=6))
_tree = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                   st.dictionaries(st.text(max_size=4), kids, max_size=4)),
                     max_leaves=25)


def _pointer(doc: object, pointer: str) -> object:
    for part in pointer.split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]  # type: ignore[index]
    return doc


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4).filter(lambda k: k != "non_finite"), _tree, max_size=5))
def test_strict_json_reads_back_with_every_strict_reader(data):
    """Any report-shaped data: the text is strict JSON (the readers of plan files, baselines and plan.json accept
    it), every non-finite number is null there and named under non_finite, and nothing else changes."""
    import json
    import math

    from auditor.artifacts.outputs import strict_json
    from auditor.planning.plan import loads_json

    text = strict_json(data)
    back = loads_json(text)  # the tool's own strict reader (no NaN/Infinity, no duplicate keys)
    flat: list[float] = []

    def walk(x: object) -> None:
        if isinstance(x, float) and not math.isfinite(x):
            flat.append(x)
        elif isinstance(x, dict):
            [walk(v) for v in x.values()]
        elif isinstance(x, list):
            [walk(v) for v in x]

    walk(data)
    named = back.pop("non_finite", {})
    assert len(named) == len(flat)
    for pointer, word in named.items():
        assert _pointer(back, pointer) is None and word in ("inf", "-inf", "nan")
        original = _pointer(data, pointer)
        assert word == ("nan" if math.isnan(original) else "inf" if original > 0 else "-inf")
    if not flat:
        assert text == json.dumps(data)


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(1, 10**6), lr=st.floats(1e-9, 10.0, allow_nan=False, allow_infinity=False),
       trainable=st.sampled_from(["factors", "all"]), objective=st.sampled_from(["auto", "kl", "mse"]))
def test_emitted_recovery_command_repeats_the_measured_setting(steps, lr, trainable, objective):
    """The ``lowrank-audit factorize`` command an emitted plan and LR019 quote, parsed by factorize's own parser,
    gives back exactly the recovery the audit measured (the objective and the learning rate's every bit included)."""
    import shlex

    from auditor.calresults import RecoverySetup
    from auditor.cli.factorize_command import _parser
    from auditor.cli.recovery_flags import cli_settings

    command = RecoverySetup(steps, lr, trainable, objective, 0, True).command()
    argv = shlex.split(command)
    assert argv[:2] == ["lowrank-audit", "factorize"]
    args = _parser().parse_args(["m.py:model", "--plan", "p.toml", "-o", "out", "--calibration", "c.pt", *argv[2:]])
    assert cli_settings(args) == {"steps": steps, "lr": lr, "trainable": trainable, "objective": objective}


def test_action_never_publishes_a_planted_report(tmp_path):
    """A checkout that plants lowrank-audit/lowrank-audit.md and .sarif as links to a secret: the audit refuses to
    write through them (exit 2), and the step neither copies the secret into the job summary nor names it for the
    SARIF upload."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN=hunter2\n")
    (tmp_path / "lowrank-audit").mkdir()
    for name in ("lowrank-audit.md", "lowrank-audit.sarif"):
        (tmp_path / "lowrank-audit" / name).symlink_to(secret)
    r, lines, summary = _action_step(tmp_path, model=DIGITS, args="--no-spectra")
    assert lines == ["exit-code=2"], (lines, r.stderr)
    assert "hunter2" not in summary and summary.startswith("lowrank-audit wrote no report (exit 2)")
