"""--emit-plan through tomlkit: every hostile layer name of tests/corpus (and the TOML-specific ones: quotes,
backslashes, newlines, unicode, dots, brackets) reads back to exactly its layer and rank, with tomllib and with
tomlkit; per-line comments are kept; no name shows a raw control or direction character; ``header`` replaces the
top comment."""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch
from safetensors.torch import save_file

import auditor
from auditor.config import tomllib
from auditor.planning.plan import Plan, emit_toml, review_plan

tomlkit = pytest.importorskip("tomlkit")

# The names tests/corpus/make_corpus.py attacks with (TOML injection, terminal escapes, Markdown, bidi, mathtext),
# then what TOML quoting must survive.
CORPUS = ['tiny\n[thresholds]\nfail_on = "never"\n#', "a\x1b]0;pwned\x07\x1b[2J", "b\nPASS: no errors",
          "c`![x](http://e/x.png)\n# evil", "\u202ed", "$\\undefinedcmd{x}$"]
TOML = ['q"uote', "sq'uote", 'back\\slash\\"', "tab\there", "dots.in.the.name", "br[ack]ets", "star*and?mark",
        "ünïcödé.層.😀", "ls\u2028sep\u2029", "c1\x9bctl\x85", "cr\rlf", 'x = 1\n[ranks]\n"y"', "#hash", "=eq"]
HIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _low_rank(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g)


@pytest.fixture(scope="module")
def hostile_audit(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    names = CORPUS + TOML
    save_file({f"{n}.weight": _low_rank(i) for i, n in enumerate(names)}, str(d / "w.safetensors"))
    a = auditor.audit_source(str(d / "w.safetensors"), options=auditor.AuditOptions(cache=False, progress=False))
    return a, names


def test_every_hostile_name_reads_back_to_its_layer_and_rank(hostile_audit):
    a, names = hostile_audit
    text = emit_toml(a)
    assert not HIDDEN.search(text.replace("\n", "")), HIDDEN.findall(text)[:5]
    suggested = {n: s.rank for n, s in a.suggestions.items() if str(s.verdict) == "factorize"}
    assert len(suggested) == len(names)  # every name is targeted: each one is a key in [ranks]
    for parsed in (tomllib.loads(text), tomlkit.parse(text).unwrap()):
        assert set(parsed) == {"finetune", "ranks"}  # no name injected a table or a setting
        assert parsed["finetune"] == ""
        hits: dict[str, int] = {}
        for pattern, rank in parsed["ranks"].items():
            matched = [l.name for l in a.layers if fnmatch.fnmatchcase(l.name, pattern)]
            assert len(matched) == 1, (pattern, matched)  # each key selects exactly its own layer
            hits[matched[0]] = rank
        assert hits == suggested
    review = review_plan(a, Plan.from_dict(tomllib.loads(text), "emitted"))
    assert {it.layer: it.rank for it in review.items} == suggested


def test_each_rank_line_keeps_its_comment(hostile_audit):
    a, names = hostile_audit
    lines = emit_toml(a).splitlines()
    start = lines.index("[ranks]")
    rank_lines = [l for l in lines[start + 1:] if l and not l.startswith("#")]
    assert len(rank_lines) == len(names)
    for line in rank_lines:
        assert re.search(r'^".*" = \d+  # \d+\.\d% energy, \d+\.\d\dx, break-even \d+\.\d, 64x48$', line), line
    assert 'finetune = ""  # the recovery fine-tune budget, e.g. "1 epoch on the training set, lr 1e-4"' in lines


def test_a_c1_or_bidi_name_is_escaped_in_the_key(hostile_audit):
    a, _ = hostile_audit
    text = emit_toml(a)
    assert '"\\u202Ed" = ' in text and '"c1\\u009Bctl\\u0085" = ' in text and '"ls\\u2028sep\\u2029" = ' in text
    assert '"q\\"uote" = ' in text and '"back\\\\slash\\\\\\"" = ' in text  # tomlkit's own quoting
    assert '"dots.in.the.name" = ' in text and '"br[[]ack]ets" = ' in text  # one key; [ escaped for fnmatch


def test_header_replaces_the_top_comment(digits_mlp):
    model, x = digits_mlp
    a = auditor.audit(model, x, cache=False, progress=False)
    default = emit_toml(a)
    assert default.startswith("# Compression plan suggested by lowrank-auditor for DigitsMLP (python object).\n"
                              "# Ranks keep >= 95% spectral energy, rounded up to a multiple of 8.\n")
    custom = emit_toml(a, header=["Ranks from the measured floors (tier 2).", "evil\n[thresholds]", ""])
    assert custom.startswith("# Ranks from the measured floors (tier 2).\n# evil\\n[thresholds]\n#\n\nfinetune")
    assert default.split("finetune", 1)[1] == custom.split("finetune", 1)[1]  # only the header differs
    assert tomllib.loads(custom) == tomllib.loads(default) == {
        "finetune": "", "ranks": {"fc1": 32, "fc2": 16, "fc3": 24}}
