"""Rules own their settings: the built-in thresholds are declared in their rule's module and still read from
pyproject.toml, a plan's [thresholds] and the flags; a plug-in rule declares its own threshold (the example
docs/rules.md shows) and reads it from a config file, with the same checks as the global settings."""

from __future__ import annotations

import json

import pytest

import auditor
from auditor.config import Setting, Settings, validate
from auditor.errors import AuditError
from auditor.rules import BUILTIN, RULES, RuleDefinitionError, find_rule, rule, rule_doc
from test_rules_registry import BIG_LAYER, DOC, big_low_rank, install  # noqa: F401 - install is a fixture

MODELS = '''
import torch
from torch import nn
def big():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 64))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(4096, 8) @ torch.randn(8, 1024))
    return m
'''


def test_the_builtin_thresholds_are_owned_by_their_rules_in_the_order_reports_list_them():
    owned = {r.code: [s.name for s in r.settings] for r in BUILTIN if r.settings}
    assert owned == {"LR004": ["energy_floor"], "LR008": ["negligible_share"], "LR009": ["wider_factor"],
                     "LR011": ["tall_ratio", "tall_min_share"]}
    resolved = validate(Settings(), RULES.settings())
    assert list(resolved.as_dict()) == [
        "energy_targets", "target_energy", "align", "min_share", "min_break_even", "min_compression", "energy_floor",
        "negligible_share", "wider_factor", "tall_ratio", "tall_min_share", "select", "ignore", "fail_on"]
    assert (resolved.energy_floor, resolved.negligible_share, resolved.wider_factor, resolved.tall_ratio,
            resolved.tall_min_share) == (0.9, 0.01, 4.0, 8.0, 0.05)
    assert "| `energy_floor` | 0.9 | (0, 1] |" in rule_doc(find_rule("LR004"))


@pytest.mark.parametrize("key, value, says", [
    ("energy_floor", "nan", "setting 'energy_floor' in plan.toml has a bad value 'nan'. Use a finite number, e.g. 0.9."),
    ("energy_floor", 0, "setting energy_floor = 0.0 in plan.toml is out of range (0, 1]. e.g. energy_floor = 0.9."),
    ("wider_factor", 0, "setting wider_factor = 0.0 in plan.toml is not a finite number above 0. e.g. wider_factor = 4."),
    ("tall_ratio", 0.5, "setting tall_ratio = 0.5 in plan.toml is not a finite number at least 1. e.g. tall_ratio = 8."),
    ("tall_min_share", 2, "setting tall_min_share = 2.0 in plan.toml is out of range [0, 1]. e.g. tall_min_share = 0.05."),
    ("negligible_shar", 0.1, "unknown setting 'negligible_shar' in plan.toml. Known settings: align, energy_floor,"),
])
def test_a_bad_rule_threshold_is_one_line_as_before(key, value, says):
    with pytest.raises(AuditError) as e:
        Settings().with_overrides({key: value}, "plan.toml", RULES.settings())
    assert e.value.line().startswith(says)


def test_a_rule_threshold_set_directly_is_checked_and_an_unknown_one_refused():
    assert validate(Settings(tall_ratio=16), RULES.settings()).tall_ratio == 16
    with pytest.raises(AuditError, match=r"^setting tall_ratio = 0\.5 is not a finite number at least 1"):
        validate(Settings(tall_ratio=0.5), RULES.settings())
    with pytest.raises(AuditError, match=r"^unknown setting 'tall_ration'\. Known settings: align, energy_floor"):
        auditor.audit(big_low_rank(), settings=Settings(tall_ration=16), spectra=False, cache=False)


def test_a_plugin_rule_owns_a_threshold_and_reads_it_from_the_config_file(install, cli_inproc, tmp_path):
    dist = install(BIG_LAYER)  # the example docs/rules.md shows: big_layer_weights, default 1,000,000
    assert [s.name for s in find_rule("XY001").settings] == ["big_layer_weights"]
    assert RULES.settings()[-1].name == "big_layer_weights"
    assert "| `big_layer_weights` | 1000000 | at least 1 | layers with more weights than this are flagged |" \
        in rule_doc(find_rule("XY001"))
    (tmp_path / "models.py").write_text(MODELS)
    model = f"{tmp_path}/models.py:big"
    (tmp_path / "plan.toml").write_text('finetune = "x"\n[ranks]\n"2" = 4\n')  # layer 0 left dense
    args = (model, "--no-cache", "--select", "XY001", "--format", "json", "-q")

    def run(config: str | None):
        if config is not None:
            (tmp_path / "pyproject.toml").write_text(f"[tool.lowrank-auditor]\n{config}\n")
        return cli_inproc(*args, "--plan", str(tmp_path / "plan.toml"), cwd=tmp_path)

    default = run(None)  # layer 0: 4,194,304 weights, above the default million
    assert default.returncode == 0, default.stderr
    doc = json.loads(default.stdout)
    assert [(f["code"], f["layers"]) for f in doc["findings"]] == [("XY001", ["0"])]
    assert doc["meta"]["settings"]["big_layer_weights"] == 1_000_000
    raised = run("big_layer_weights = 5_000_000")
    assert raised.returncode == 0, raised.stderr
    doc = json.loads(raised.stdout)
    assert doc["findings"] == [] and doc["meta"]["settings"]["big_layer_weights"] == 5_000_000
    # the plan's [thresholds] and the API's overrides come after the config file, as for every setting
    plan = tmp_path / "plan2.toml"
    plan.write_text('finetune = "x"\n[ranks]\n"2" = 4\n[thresholds]\nbig-layer-weights = 4_000_000\n')
    res = cli_inproc(*args, "--plan", str(plan), cwd=tmp_path)
    assert [f["layers"] for f in json.loads(res.stdout)["findings"]] == [["0"]]
    a = auditor.audit(big_low_rank(), plan={"ranks": {"2": 4}}, overrides={"big_layer_weights": 4_200_000},
                      settings=Settings(select=("XY001",)), cache=False)
    assert a.findings == [] and a.settings.big_layer_weights == 4_200_000
    # bad values: one line, exit 2, as for the global settings
    for config, says in [
        ("big_layer_weights = 0", "setting big_layer_weights = 0 in pyproject.toml [tool.lowrank-auditor] is not a "
                                  "finite number at least 1. e.g. big_layer_weights = 1000000."),
        ("big_layer_weights = 1.5", "setting 'big_layer_weights' in pyproject.toml [tool.lowrank-auditor] has a bad "
                                    "value 1.5. Use a whole number, e.g. 1000000."),
        ('big_layer_weights = "lots"', "setting 'big_layer_weights' in pyproject.toml [tool.lowrank-auditor] has a "
                                       "bad value 'lots'. Use a whole number, e.g. 1000000."),
    ]:
        bad = run(config)
        assert (bad.returncode, bad.stdout, bad.stderr) == (2, "", f"error: {says}\n"), config
    assert find_rule("XY001").origin == dist


def test_without_the_plugin_its_setting_is_an_unknown_one(cli_inproc, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.lowrank-auditor]\nbig_layer_weights = 5_000_000\n")
    res = cli_inproc(f"{auditor.__file__.rsplit('/auditor/', 1)[0]}/sample_models/digits.py:mlp", "--no-spectra", "-q",
                     cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith(
        "error: unknown setting 'big_layer_weights' in pyproject.toml [tool.lowrank-auditor]. Known settings: align,")


@pytest.mark.parametrize("name, says", [
    ("energy_floor", "declares the setting 'energy_floor' for XY001, which lowrank-auditor already declares for LR004 "
                     "energy-below-floor"),
    ("min_share", "cannot be loaded: RuleDefinitionError: rule 'XY001' (lrplug_rules_"),
])
def test_a_plugin_may_not_take_a_setting_already_declared(install, name, says):
    dist = install(BIG_LAYER.replace('"big_layer_weights"', f'"{name}"'))
    with pytest.raises(AuditError) as e:
        RULES.settings()
    assert says in e.value.line() and dist in e.value.line()
    if name == "min_share":
        assert "the setting 'min_share' is a global setting; give yours another name" in e.value.line()


def test_a_badly_declared_setting_says_what_is_wrong():
    def check(ctx, emit):
        pass

    check.__doc__ = DOC.format(summary="s")
    with pytest.raises(RuleDefinitionError, match="declared twice"):
        rule("XY950", "twice", "info", settings=[Setting("xy_a", 1, "a"), Setting("xy_a", 2, "b")])(check)
    with pytest.raises(RuleDefinitionError, match="must be auditor.config.Setting objects"):
        rule("XY951", "not-a-setting", "info", settings=[("xy_a", 1)])(check)
    for kwargs, says in [({"name": "Bad-Name", "default": 1, "doc": "d"}, "lowercase words"),
                         ({"name": "xy_b", "default": 2, "doc": "d", "high": 1}, "outside its range"),
                         ({"name": "xy_c", "default": float("nan"), "doc": "d"}, "not a finite number"),
                         ({"name": "xy_d", "default": "text", "doc": "d", "low": 0}, "a range needs a numeric default"),
                         ({"name": "xy_e", "default": 1, "doc": " "}, "needs a one-line doc")]:
        with pytest.raises(ValueError, match=says):
            Setting(**kwargs)


def test_the_design_recipe_rule_runs_as_written(install):
    """docs/design.md's worked example, as a plugin (its relative imports made absolute), flags what it says."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    recipe = text.split("### Adding a rule", 1)[1]
    code = re.search(r"```python\n(.*?)\n```\n\n- The check", recipe, re.S).group(1)
    for rel, absolute in (("...config", "auditor.config"), ("...results", "auditor.results"),
                          ("..context", "auditor.rules.context"), ("..registry", "auditor.rules.registry")):
        code = code.replace(f"from {rel} import", f"from {absolute} import")
    install(code.replace("LR020", "XY017"))
    plan = {"ranks": {"0": 12, "2": 16}, "finetune": "x"}
    a = auditor.audit(big_low_rank(), plan=plan, settings=Settings(select=("XY017",)), spectra=False, cache=False)
    assert [(f.code, f.layers, f.fix) for f in a.findings] == [("XY017", ["0"], "Use rank 16")]
    b = auditor.audit(big_low_rank(), plan={**plan, "thresholds": {"rank_multiple": 4}},
                      settings=Settings(select=("XY017",)), spectra=False, cache=False)
    assert b.findings == []
