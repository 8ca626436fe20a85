"""Bad input through the command line: one clear line, exit code 2, no traceback, no report written."""

import json

import pytest

from auditor.errors import AuditError


def _assert_bad(res, *needles):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], lines[0]


FACTORIES = '''
import torch
from torch import nn
def good():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
def raises():
    raise RuntimeError("cannot build today")
def not_a_module():
    return 42
'''


@pytest.fixture
def factories(tmp_path):
    p = tmp_path / "models.py"
    p.write_text(FACTORIES)
    return p


def test_missing_file(cli, tmp_path):
    _assert_bad(cli(tmp_path / "nope.py:f", "-o", tmp_path / "out", "--format", "json"), "does not exist")
    assert not (tmp_path / "out").exists()


def test_missing_factory_suggests_close_name(cli, factories):
    _assert_bad(cli(f"{factories}:goood"), "no factory named 'goood'", "Did you mean good")


def test_factory_that_raises(cli, factories):
    _assert_bad(cli(f"{factories}:raises"), "raised RuntimeError: cannot build today")


def test_factory_returning_non_module(cli, factories):
    _assert_bad(cli(f"{factories}:not_a_module"), "returned int, not a torch.nn.Module")


def test_unreadable_config(cli, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    _assert_bad(cli(bad), "cannot read the Hugging Face config")


def test_input_shape_that_does_not_fit(cli, factories, tmp_path):
    out = tmp_path / "out"
    res = cli(f"{factories}:good", "--input-shape", "2,17", "--format", "json,html", "-o", out)
    _assert_bad(res, "do not fit the model", "float32[2, 17]")
    assert not out.exists() or not any(out.iterdir())


def test_bad_shape_text(cli, factories):
    _assert_bad(cli(f"{factories}:good", "--input-shape", "2,x"), "is not a shape")


def test_jobs_below_one(cli, factories):
    _assert_bad(cli(f"{factories}:good", "--jobs", "0"), "--jobs 0")


def test_good_factory_exit_zero_and_json(cli, factories):
    res = cli(f"{factories}:good", "--input-shape", "3,16", "--format", "json", "-q", "--jobs", "2")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["format_version"] == 1
    assert data["totals"]["params"] == 16 * 32 + 32 + 32 * 4 + 4
    assert data["totals"]["macs"] == 3 * (16 * 32 + 32 * 4)
    assert data["meta"]["trace_method"] == "torch.fx.symbolic_trace"


def test_nan_weights_exit_2_without_a_report(cli, tmp_path):
    p = tmp_path / "nan.py"
    p.write_text("import torch\nfrom torch import nn\n"
                 "def model():\n    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n"
                 "    m[0].weight.data[1, 2] = float('nan')\n    return m\n")
    res = cli(f"{p}:model", "--format", "html,json", "-o", tmp_path / "out")
    _assert_bad(res, "LR010", "0 has non-finite values (1 NaN/Inf entries)")
    assert not (tmp_path / "out").exists()


def test_zoo_names_through_a_stand_in_registry(tmp_path, monkeypatch):
    """torchvision:NAME / timm:NAME build with random init and load --weights; the registries themselves are
    stood in for here (PyPI's torchvision does not import beside the pinned CPU torch)."""
    import sys
    import types

    import torch
    from torch import nn

    from auditor.sources import load_source

    tv = types.ModuleType("torchvision")
    tv.models = types.SimpleNamespace(get_model=lambda name, weights=None: nn.Sequential(nn.Linear(4, 3)))
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", tv.models)
    state = {"0.weight": torch.ones(3, 4), "0.bias": torch.zeros(3)}
    torch.save(state, tmp_path / "w.pt")
    loaded = load_source("torchvision:tiny", weights=str(tmp_path / "w.pt"))
    assert torch.equal(loaded.model[0].weight, torch.ones(3, 4))
    monkeypatch.setitem(sys.modules, "timm", None)  # importing timm fails
    with pytest.raises(AuditError) as exc:
        load_source("timm:resnet18")
    assert "timm cannot be imported" in exc.value.what and "pip install timm" in exc.value.fix


def test_import_auditor_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, auditor; auditor.Settings(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_all_zero_weight_is_a_finding_not_bad_input(cli_inproc, tmp_path):
    p = tmp_path / "zero.py"
    p.write_text("import torch\nfrom torch import nn\n"
                 "def model():\n    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n"
                 "    m[0].weight.data.zero_()\n    return m\n")
    res = cli_inproc(f"{p}:model", "--format", "json", "-q")
    assert res.returncode == 1  # an error finding, reported; not exit 2
    assert [f["code"] for f in json.loads(res.stdout)["findings"] if f["code"] == "LR010"] == ["LR010"]


def test_the_audit_and_factorize_take_their_common_flags_from_one_definition():
    """cli/shared_flags.py: the flags both commands take have the same strings, help, metavar, type and choices in
    both; --metric's and --tolerance's help are what the metric registry says (written out: --help imports no
    torch)."""
    from auditor.calibration import metrics
    from auditor.cli import audit_command, factorize_command
    from auditor.cli.shared_flags import FLAGS, METRIC_HELP, TOLERANCE_HELP, metric_help, tolerance_help

    def actions(p):
        p.format_help()  # fills in the help a registry gives
        return {a.dest: (a.option_strings, a.help, a.metavar, a.type, a.choices) for a in p._actions}

    audit, factorize = actions(audit_command._parser()), actions(factorize_command._parser())
    shared = [name.replace("-", "_") for name in FLAGS]
    assert len(shared) == 16 and "document_separator" in shared and "tie" in shared
    assert [d for d in shared if audit[d] != factorize[d]] == []
    names = [n for k in metrics.kinds() for n in metrics.for_kind(k).names]
    assert names and all(n in audit["metric"][1] for n in names)
    assert all(metrics.for_kind(k).units in audit["tolerance"][1] for k in metrics.kinds() if metrics.for_kind(k).units)
    assert (metric_help(), tolerance_help()) == (METRIC_HELP, TOLERANCE_HELP)


def test_factorize_help_names_the_kinds_it_rewrites_from_the_registry():
    from auditor import kinds
    from auditor.cli import factorize_command

    text = " ".join(factorize_command._parser().format_help().split())
    assert f"Rewrites {kinds.rewritable_labels()} layers." in text and "Embedding" in text


def test_factory_that_raises_names_the_users_line(cli, factories):
    """Without --verbose the one line says where the user's code raised; with it, the user's traceback comes first
    (the tool's own frames left out) and the line still ends the output."""
    res = cli(f"{factories}:raises")
    _assert_bad(res, "raised RuntimeError: cannot build today (at ")
    assert f"{factories.name}:7)" in res.stderr  # `raise RuntimeError(...)` is line 7 of FACTORIES
    loud = cli(f"{factories}:raises", "--verbose")
    assert loud.returncode == 2
    lines = loud.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert f'{factories}", line 7, in raises' in loud.stderr
    assert "auditor" not in "\n".join(lines[:-1]).replace(str(factories), "")  # none of the tool's frames
    assert lines[-2] == "RuntimeError: cannot build today"
    assert lines[-1].startswith("error: factory raises() raised RuntimeError: cannot build today (at ")


@pytest.mark.parametrize("spec, folder", [("gpt2", "gpt2"), ("meta-llama/Llama-3.2-1B", "Llama-3.2-1B")])
def test_hub_id_is_not_downloaded(cli, tmp_path, spec, folder):
    res = cli(spec, cwd=tmp_path)
    _assert_bad(res, f"{spec!r} is no file or folder here", "hub ids are not downloaded",
                f"huggingface-cli download {spec} --local-dir {folder}")


def test_a_missing_path_is_not_taken_for_a_hub_id(cli, tmp_path):
    _assert_bad(cli("./no-such-dir", cwd=tmp_path), "cannot tell what kind of model source './no-such-dir' is")


def test_quiet_keeps_a_failing_runs_verdict(cli_inproc):
    """Issue 40: `-q` on a failing run printed nothing. Like ruff's -q, it keeps the verdict and the findings; a
    passing run keeps its verdict line alone."""
    res = cli_inproc("sample_models/digits.py:mlp", "--fail-on", "unmeasured", "-q")
    assert res.returncode == 1
    assert res.stdout.startswith("UNMEASURED: no errors or warnings; the ranks are energy-based estimates")
    assert len(res.stdout.splitlines()) == 1
    ok = cli_inproc("sample_models/digits.py:mlp", "-q")
    assert ok.returncode == 0 and ok.stdout == res.stdout  # exit 0 under the default --fail-on, the same verdict
    doc = cli_inproc("sample_models/digits.py:mlp", "--fail-on", "unmeasured", "-q", "--format", "json")
    assert doc.returncode == 1 and json.loads(doc.stdout)  # stdout carries the JSON alone


def test_a_folder_it_may_not_search_is_one_line_and_exit_2(cli_inproc, tmp_path, monkeypatch):
    """A model file in a folder this user may not search (mode 0700 of another user; root ignores modes, so the
    EACCES is raised where the file is looked at): one line naming it, exit 2, not an internal error (exit 3)."""
    import errno
    import pathlib

    locked = tmp_path / "locked"
    real = pathlib.Path.stat

    def stat(self, *a, **k):
        if str(self).startswith(str(locked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    r = cli_inproc(f"{locked}/m.py:model", "-q")
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: permission denied: {locked}/m.py"), r.stderr
    assert "internal error" not in r.stderr
