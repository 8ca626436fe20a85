"""Python factories and source strings: whatever the user's code does at import or call (exit, raise any
BaseException, print) ends in one error line or a clean report; shapes are parsed strictly."""

import json
import sys

import pytest

from auditor.errors import AuditError
from auditor.sources import load_source, parse_shape

MODEL = "from torch import nn\ndef model():\n    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))\n"


def write(tmp_path, body, name="f.py"):
    p = tmp_path / name
    p.write_text(body)
    return p


@pytest.mark.parametrize("body, spec, what", [
    ("import sys\nsys.exit(0)\n" + MODEL, "model", "importing {p} called sys.exit(0) instead of returning"),
    (MODEL + "def bye():\n    raise SystemExit('done')\n", "bye",
     "factory bye() called sys.exit('done') instead of returning"),
    ("class Odd(BaseException):\n    pass\n" + MODEL + "def odd():\n    raise Odd('strange')\n", "odd",
     "factory odd() raised Odd: strange (at {p}:7)"),  # the line of the user's code that raised (issue 40)
    ("raise GeneratorExit('at import')\n", "model", "importing {p} failed: GeneratorExit: at import (at {p}:1)"),
])
def test_base_exceptions_become_one_error(tmp_path, body, spec, what):
    p = write(tmp_path, body)
    with pytest.raises(AuditError) as exc:
        load_source(f"{p}:{spec}")
    assert exc.value.what == what.format(p=p)
    if "sys.exit(0)" in what:
        assert '__name__ == "__main__"' in exc.value.fix


def test_ctrl_c_in_a_factory_still_interrupts(tmp_path):
    p = write(tmp_path, "def model():\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_source(f"{p}:model")


def test_sys_exit_at_import_exits_2_not_0(tmp_path, cli):
    p = write(tmp_path, "import sys\nsys.exit(0)\n" + MODEL)
    res = cli(f"{p}:model", "--format", "json")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: importing") and res.stderr.count("\n") == 1


def test_factory_prints_do_not_corrupt_json_on_stdout(tmp_path, cli):
    body = ("import os, sys\nprint('hello at import')\nos.write(1, b'raw fd write\\n')\n" + MODEL +
            "def loud():\n    print('building...')\n    sys.stdout.write('more')\n    return model()\n")
    p = write(tmp_path, body)
    res = cli(f"{p}:loud", "--format", "json", "-q", "--no-spectra")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["totals"]["params"] == 8 * 6 + 6 + 6 * 4 + 4
    for text in ("hello at import", "raw fd write", "building...", "more"):
        assert text in res.stderr


def test_print_redirect_restores_stdout(tmp_path, capfd):
    p = write(tmp_path, MODEL + "def loud():\n    print('inside')\n    return model()\n")
    before = sys.stdout
    load_source(f"{p}:loud")
    print("after")
    out, err = capfd.readouterr()
    assert sys.stdout is before and out == "after\n" and "inside" in err


def test_wrong_factory_name_lists_own_callables_sorted_with_a_count(tmp_path):
    names = ["zeta", "Alpha", "beta_model", "Gamma", "delta", "eps", "Zoo", "mlp", "cnn", "rnn", "vit", "lstm"]
    body = "import torch\nfrom pathlib import Path\nfrom torch import nn\n" + "".join(
        f"def {n}():\n    return nn.Linear(2, 2)\n" for n in names) + "_hidden = lambda: None\n"
    p = write(tmp_path, body)
    with pytest.raises(AuditError) as exc:
        load_source(f"{p}:nothing_like_it")
    assert exc.value.what == f"{p} has no factory named 'nothing_like_it'"
    assert exc.value.fix == ("Callables there: Alpha, beta_model, cnn, delta, eps, Gamma, lstm, mlp, rnn, vit, "
                             "... and 2 more")
    with pytest.raises(AuditError) as exc:
        load_source(f"{p}:mlpp")
    assert exc.value.fix.startswith("Did you mean mlp? Callables there: Alpha, ")


@pytest.mark.parametrize("spec", ["", "   ", ":model"])
def test_empty_sources_are_errors_not_the_current_directory(spec, cli_inproc, tmp_path):
    with pytest.raises(AuditError):
        load_source(spec)
    res = cli_inproc(spec, cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1


@pytest.mark.parametrize("text, reason", [
    ("1,,3", "a dimension is missing between separators"),
    ("-1", "'-1' is not a positive whole number"),
    ("0", "a dimension is 0"),
    ("1,0,3", "a dimension is 0"),
    ("1e3", "'1e3' is not a positive whole number"),
    ("1.5", "'1.5' is not a positive whole number"),
    ("\u0661\u0662", "'\u0661\u0662' is not a positive whole number"),  # Arabic-Indic digits pass str.isdigit
    ("2\u00b2", "'2\u00b2' is not a positive whole number"),  # superscript two: isdigit, but int() fails
    ("9" * 5000, f"'{'9' * 5000}' is too large"),  # int() of > 4300 digits raises by default
    ("100000,100000,100", "1,000,000,000,000 elements, more than the 268,435,456 an example input may have"),
    ("1,2,3,4,5,6,7,8,9", "9 dimensions, more than 8"),
    ("", "it is empty"),
    (" , ", "a dimension is missing between separators"),
    ("1,\x1b]0;pwned\x07", "'\\x1b]0;pwned\\x07' is not a positive whole number"),
])
def test_odd_shapes_give_one_clear_line(text, reason):
    with pytest.raises(AuditError) as exc:
        parse_shape(text, "--input-shape")
    assert exc.value.what == f"--input-shape {text!r} is not a shape: {reason}"
    assert exc.value.fix == "Give positive whole numbers separated by commas, e.g. --input-shape 1,3,224,224"
    line = exc.value.line()
    assert "\n" not in line and "\x1b" not in line


def test_good_shapes():
    assert parse_shape("1x3x224x224", "--input-shape") == (1, 3, 224, 224)
    assert parse_shape(" 1, 128 ", "--input-ids") == (1, 128)
    assert parse_shape("16384,16384", "--input-shape") == (16384, 16384)  # exactly the element limit
    with pytest.raises(AuditError, match="e.g. --input-ids 1,128"):
        parse_shape("1,x", "--input-ids")


def test_odd_shape_on_the_command_line_exits_2(cli_inproc):
    res = cli_inproc("sample_models/digits.py:mlp", "--input-shape", "1,,64")
    assert res.returncode == 2
    assert res.stderr == ("error: --input-shape '1,,64' is not a shape: a dimension is missing between separators. "
                          "Give positive whole numbers separated by commas, e.g. --input-shape 1,3,224,224.\n")


def test_a_factory_file_with_a_dataclass_loads(tmp_path):
    # dataclasses look their module up in sys.modules: a file imported by path must be registered there
    (tmp_path / "m.py").write_text(
        "from dataclasses import dataclass\nimport torch\n\n@dataclass\nclass Cfg:\n    d: int = 6\n\n"
        "def build():\n    return torch.nn.Linear(Cfg().d, 4)\n"
    )
    loaded = load_source(f"{tmp_path / 'm.py'}:build")
    assert sum(p.numel() for p in loaded.model.parameters()) == 6 * 4 + 4


def test_input_shape_follows_a_bf16_model(tmp_path, cli_inproc):
    """--input-shape for a bfloat16 model makes bfloat16 inputs: the audit traces it and counts its MACs (float32
    inputs made the forward fail: a dtype mismatch in the first Linear)."""
    (tmp_path / "half.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def mlp():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10)).to(torch.bfloat16)\n")
    r = cli_inproc(f"{tmp_path / 'half.py'}:mlp", "--input-shape", "4,64", "--format", "json", "-o", tmp_path / "out",
                   "-q", "--no-cache")
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "out" / "lowrank-audit.json").read_text())
    assert d["totals"]["macs"] == 4 * (64 * 96 + 96 * 10)
