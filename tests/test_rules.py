"""One test per rule, on a bad and a good example, with only that rule enabled; then the reference cases through
the command line, plan errors, and exit codes."""

import json

import pytest
import torch
from torch import nn

import auditor
from auditor.rules import RULES, rules_markdown


def run(model, inputs, code, plan=None, spectra=True, **settings):
    s = auditor.Settings(select=(code,), **settings)
    a = auditor.audit(model, inputs, plan=plan, settings=s, spectra=spectra, cache=False)
    assert all(f.code == code for f in a.findings)
    return [f for f in a.findings]


def wide():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 64), nn.ReLU(), nn.Linear(64, 64))


def test_lr001_rank_at_or_above_break_even():
    bad = run(wide(), None, "LR001", {"ranks": {"0": 820}, "finetune": "1 epoch"}, spectra=False)
    assert len(bad) == 1 and "819.2" in bad[0].message and bad[0].evidence["break_even"] == 819.2
    assert run(wide(), None, "LR001", {"ranks": {"0": 819}, "finetune": "1 epoch"}, spectra=False) == []


def test_lr002_rank_above_min_side():
    bad = run(wide(), None, "LR002", {"ranks": {"2": 65}, "finetune": "x"}, spectra=False)
    assert len(bad) == 1 and bad[0].evidence["max_rank"] == 64
    assert run(wide(), None, "LR002", {"ranks": {"2": 64}, "finetune": "x"}, spectra=False) == []


def test_lr003_narrow_layer():
    bad = run(wide(), None, "LR003", {"ranks": {"4": 8}, "finetune": "x"}, spectra=False)
    assert len(bad) == 1 and bad[0].layers == ["4"]
    assert run(wide(), None, "LR003", {"ranks": {"0": 256}, "finetune": "x"}, spectra=False) == []


def test_lr004_energy_below_floor(digits_mlp):
    model, x = digits_mlp
    bad = run(model, x, "LR004", {"ranks": {"fc2": 2}, "finetune": "x"})
    assert len(bad) == 1 and bad[0].evidence["energy_kept"] < 0.90
    good = run(model, x, "LR004", {"ranks": {"fc2": "energy:0.95"}, "finetune": "x"})
    assert good == []


def test_lr005_no_finetune_budget():
    assert len(run(wide(), None, "LR005", {"ranks": {"0": 256}}, spectra=False)) == 1
    assert len(run(wide(), None, "LR005", {"ranks": {"0": 256}, "finetune": "none"}, spectra=False)) == 1
    assert run(wide(), None, "LR005", {"ranks": {"0": 256}, "finetune": "2 epochs, lr 1e-4"}, spectra=False) == []


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_lr006_tied_weight():
    ids = (torch.zeros(1, 8, dtype=torch.long),)
    bad = run(Tied(), ids, "LR006", {"ranks": {"emb": 16}, "finetune": "x"}, spectra=False)
    assert len(bad) == 1 and bad[0].evidence["aliases"] == ["head.weight"]
    assert run(Tied(), ids, "LR006", {"ranks": {"mid": 16}, "finetune": "x"}, spectra=False) == []


def test_lr007_chained_linear_maps():
    bad = run(nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512)), torch.zeros(1, 512), "LR007", spectra=False)
    assert len(bad) == 1 and bad[0].layers == ["0", "1"] and bad[0].evidence["inner_rank"] == 64
    good = nn.Sequential(nn.Linear(512, 64), nn.GELU(), nn.Linear(64, 512))
    assert run(good, torch.zeros(1, 512), "LR007", spectra=False) == []


def test_lr008_negligible_saving():
    bad = run(wide(), None, "LR008", {"ranks": {"4": 8}, "finetune": "x"}, spectra=False)
    assert len(bad) == 1 and bad[0].evidence["params_saved"] == 64 * 64 - 8 * 128
    assert run(wide(), None, "LR008", {"ranks": {"0": 256}, "finetune": "x"}, spectra=False) == []


def test_lr009_small_before_wide(digits_mlp):
    model, x = digits_mlp
    bad = run(model, x, "LR009", {"ranks": {"fc1": 32}, "finetune": "x"})
    assert len(bad) == 1 and "fc2" in bad[0].evidence["wider"]
    assert run(model, x, "LR009", {"ranks": {"fc2": 16, "fc3": 24}, "finetune": "x"}) == []


def test_lr010_non_finite_or_zero():
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    assert run(m, None, "LR010") == []
    m[0].weight.data[0, 0] = float("nan")
    bad = run(m, None, "LR010")
    assert len(bad) == 1 and bad[0].layers == ["0"] and "non-finite" in bad[0].message


def test_lr011_tall_thin_left_alone():
    torch.manual_seed(0)
    # a low-rank 4000 x 64 table that factorizes well, beside a small dense layer
    emb = nn.Embedding(4000, 64)
    emb.weight.data = torch.randn(4000, 4) @ torch.randn(4, 64)
    m = nn.Sequential(emb, nn.Linear(64, 64))
    ids = torch.zeros(1, 4, dtype=torch.long)
    bad = run(m, ids, "LR011", {"ranks": {"1": 8}, "finetune": "x"})
    assert len(bad) == 1 and bad[0].layers == ["0"]
    assert run(m, ids, "LR011", {"ranks": {"0": 8}, "finetune": "x"}) == []


def test_every_rule_is_tested_and_documented():
    import inspect
    import sys

    src = inspect.getsource(sys.modules[__name__])
    for code, r in RULES.items():
        assert f'"{code}"' in src, f"{code} has no test"
        assert set(r.sections) >= {"What it flags", "Why it is bad", "Example", "Do instead"}
    assert len(RULES) >= 11


def test_docs_rules_md_is_generated_from_docstrings():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "rules.md"
    assert doc.read_text(encoding="utf-8") == rules_markdown(), "run `make docs` to regenerate docs/rules.md"


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
    assert cli("rules", "LR999").returncode == 2
