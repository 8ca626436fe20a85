"""The rules through the command line: the reference cases, plan errors, exit codes and the rules listing. Each
rule alone on a failing and a passing case is in test_rules_table.py; the registry, needs and plugins in
test_rules_registry.py."""

import json

import pytest

from auditor.rules import BUILTIN, RULES, rules_markdown


def test_docs_rules_md_is_generated_from_docstrings():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "rules.md"
    assert doc.read_text(encoding="utf-8") == rules_markdown(BUILTIN), "run `make docs` to regenerate docs/rules.md"


# ---- through the command line -----------------------------------------------------------------------------------

FACTORIES = '''
import torch
from torch import nn
def square():
    return nn.Sequential(nn.Linear(4096, 4096))
def tall():
    return nn.Sequential(nn.Linear(1024, 4096))
def ten_million():
    return nn.Sequential(nn.Linear(3162, 3162), nn.ReLU(), nn.Linear(3162, 64), nn.ReLU(), nn.Linear(64, 64))
def chain():
    return nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512)), (torch.zeros(1, 512),)
'''


@pytest.fixture
def fx(tmp_path):
    p = tmp_path / "models.py"
    p.write_text(FACTORIES)
    return tmp_path


def plan(tmp_path, body, name="plan.toml"):
    p = tmp_path / name
    p.write_text(body)
    return p


def findings(res):
    return json.loads(res.stdout)["findings"]


def test_cli_rank_3000_on_4096_square(cli, fx):
    p = plan(fx, 'finetune = "1 epoch"\n[ranks]\n"0" = 3000\n')
    res = cli(f"{fx}/models.py:square", "--plan", p, "--no-spectra", "--format", "json", "-q")
    assert res.returncode == 1, res.stderr
    (f,) = [f for f in findings(res) if f["code"] == "LR001"]
    assert "2048.0" in f["message"] and f["evidence"]["break_even"] == 2048.0


def test_cli_rank_900_on_4096x1024(cli, fx):
    p = plan(fx, 'finetune = "1 epoch"\n[ranks]\n"0" = 900\n')
    res = cli(f"{fx}/models.py:tall", "--plan", p, "--no-spectra", "--format", "json", "-q")
    assert res.returncode == 1
    (f,) = [f for f in findings(res) if f["code"] == "LR001"]
    assert "819.2" in f["message"]


def test_cli_only_a_64x64_layer_of_10m_model(cli, fx):
    p = plan(fx, 'finetune = "1 epoch"\n[ranks]\n"4" = 16\n')
    res = cli(f"{fx}/models.py:ten_million", "--plan", p, "--no-spectra", "--format", "json", "-q")
    codes = {f["code"] for f in findings(res)}
    assert {"LR003", "LR008"} <= codes
    assert res.returncode == 0  # warnings only; --fail-on error is the default
    res = cli(f"{fx}/models.py:ten_million", "--plan", p, "--no-spectra", "--fail-on", "warning", "-q")
    assert res.returncode == 1


def test_cli_energy_below_floor(cli_inproc, tmp_path):
    p = plan(tmp_path, 'finetune = "1 epoch"\n[ranks]\n"fc2" = 2\n')
    res = cli_inproc("sample_models/digits.py:mlp", "--plan", p, "--format", "json", "-q")
    (f,) = [f for f in findings(res) if f["code"] == "LR004"]
    assert f["evidence"]["energy_kept"] < 0.9 and "% of the spectral energy" in f["message"]


def test_cli_gpt2_tied_wte(cli, tmp_path):
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64,
                                  architectures=["GPT2LMHeadModel"])
    cfg.save_pretrained(tmp_path / "gpt2")
    p = plan(tmp_path, 'finetune = "1 epoch"\n[ranks]\n"transformer.wte" = 16\n')
    res = cli(tmp_path / "gpt2", "--input-ids", "1,16", "--plan", p, "--format", "json", "-q")
    assert res.returncode == 0, res.stderr
    (f,) = [f for f in findings(res) if f["code"] == "LR006"]
    assert "lm_head.weight" in f["message"]


def test_cli_chained_linears(cli, fx):
    res = cli(f"{fx}/models.py:chain", "--no-spectra", "--format", "json", "-q")
    assert [f["code"] for f in findings(res)] == ["LR007"]


def test_cli_plan_errors_exit_2(cli_inproc, fx):
    cases = [
        ('[ranks]\n"fc9" = 8\n', "matches no factorizable layer", "Closest layer names: fc3, fc2, fc1"),
        ('[ranks]\n"fc2" = 0\n', "must be positive", "layer fc2"),
        ('[ranks]\n"fc2" = 8.5\n', "is not an integer", "layer fc2"),
        ('[ranks]\n"fc2" = 600\n', "LR002", "fc2"),
        ('[ranks]\n"fc2" = "lots"\n', "cannot read rank", "fc2"),
        ('[ranks\n', "not valid TOML", ""),
    ]
    for body, a, b in cases:
        p = plan(fx, body, "bad.toml")
        res = cli_inproc("sample_models/digits.py:mlp", "--plan", p, "-q", "--format", "html", "-o", fx / "out")
        assert res.returncode == 2, (body, res.stderr)
        assert a in res.stderr and b in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (fx / "out").exists()


def test_cli_json_plan_and_fraction_of_break_even(cli_inproc, tmp_path):
    p = plan(tmp_path, json.dumps({"ranks": {"fc*": "0.25be"}, "finetune": "1 epoch"}), "plan.json")
    res = cli_inproc("sample_models/digits.py:mlp", "--plan", p, "--format", "json", "-q")
    assert res.returncode == 0, res.stderr
    items = {i["layer"]: i["rank"] for i in json.loads(res.stdout)["plan_review"]["items"]}
    assert items == {"fc1": 14, "fc2": 64, "fc3": 42}  # floor(0.25 * m*n/(m+n))


def test_cli_exit_codes_and_deterministic_findings(cli_inproc, tmp_path):
    p = plan(tmp_path, '[ranks]\n"fc2" = 300\n"fc1" = 4\n')
    one = cli_inproc("sample_models/digits.py:mlp", "--plan", p, "--format", "json", "-q")
    two = cli_inproc("sample_models/digits.py:mlp", "--plan", p, "--format", "json", "-q", "--no-cache")
    assert one.returncode == two.returncode == 1
    assert findings(one) == findings(two)
    assert cli_inproc("sample_models/digits.py:mlp", "-q").returncode == 0
    assert cli_inproc("sample_models/digits.py:mlp", "--plan", p, "-q", "--fail-on", "never").returncode == 0


def test_cli_thresholds_precedence(cli_inproc, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.lowrank-auditor]\nenergy_floor = 0.5\n')
    p = plan(tmp_path, 'finetune = "x"\n[ranks]\n"fc2" = 4\n')
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    model = f"{root}/sample_models/digits.py:mlp"
    codes = lambda res: {f["code"] for f in findings(res)}  # noqa: E731
    assert "LR004" not in codes(cli_inproc(model, "--plan", p, "--format", "json", "-q", cwd=tmp_path))
    p2 = plan(tmp_path, 'finetune = "x"\n[ranks]\n"fc2" = 4\n[thresholds]\nenergy_floor = 0.99\n', "p2.toml")
    assert "LR004" in codes(cli_inproc(model, "--plan", p2, "--format", "json", "-q", cwd=tmp_path))
    assert "LR004" not in codes(cli_inproc(model, "--plan", p2, "--energy-floor", "0.1", "--format", "json", "-q",
                                    cwd=tmp_path))


def test_cli_rules_listing(cli):
    res = cli("rules")
    assert res.returncode == 0 and all(code in res.stdout for code in RULES)
    one = cli("rules", "LR001")
    assert "## LR001 rank-at-or-above-break-even" in one.stdout and "### Why it is bad" in one.stdout
    assert cli("rules", "energy-below-floor").stdout == cli("rules", "lr004").stdout == \
        cli("rules", "LR004").stdout
    assert cli("rules", "energy-below-floor").stdout.startswith("## LR004 energy-below-floor\n")
    bad = cli("rules", "energy-below-flor")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Did you mean energy-below-floor" in bad.stderr
