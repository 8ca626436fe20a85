"""--tie: layers whose ranks must be equal (q/k/v of one attention, gate/up of one MLP), on the shipped sample Llama
(grouped-query attention: q 128 x 128, k and v 64 x 128; SwiGLU gate/up 344 x 128): the groups resolved per block,
each bad tie one line and exit 2, the search's plan and the emitted plan at one rank per group, the factorized
model's shapes, what the ties cost in removal in every format, LR021 and factorize's refusal of a broken tie."""

from __future__ import annotations

import fnmatch
import html
import json
from pathlib import Path

import pytest

import auditor
from auditor.calibration.tiers.budget import Curves, Option, allocate
from auditor.calibration.tiers.tied import removal_within, tie_cost, tie_curves
from auditor.errors import AuditError
from auditor.options import AuditOptions, tie_specs
from auditor.planning.ties import resolve_ties, violations
from auditor.render.parts.safe import md_text
from auditor.results import TieGroup

pytest.importorskip("transformers")

LLAMA = Path(__file__).resolve().parents[1] / "sample_models" / "llama"
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _bad(res, line: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert lines == [line], res.stderr


# ---- the groups ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def structure():
    return auditor.audit_source(str(LLAMA), options=AuditOptions(spectra=False, cache=False, progress=False))


def test_auto_ties_q_k_v_and_gate_up_in_every_block(structure):
    ties = resolve_ties(structure.layers, tie_specs("auto"))
    assert [(g.label, g.block) for g in ties] == [
        *(("q_proj/k_proj/v_proj", f"model.layers.{i}.self_attn") for i in range(4)),
        *(("gate_proj/up_proj", f"model.layers.{i}.mlp") for i in range(4))]
    assert ties[0].members == tuple(f"model.layers.0.self_attn.{p}" for p in QKV)
    assert {(structure.layer(m).m, structure.layer(m).n) for m in ties[0].members} == {(128, 128), (64, 128)}


def test_patterns_match_a_names_last_parts_and_the_rest_is_the_block(structure):
    ties = resolve_ties(structure.layers, tie_specs("self_attn.q_proj,self_attn.k_proj"))
    assert [g.block for g in ties] == [f"model.layers.{i}" for i in range(4)]
    assert ties[2].members == ("model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj")


@pytest.mark.parametrize("ties, line", [
    (("q_proj,k_prj",), "error: --tie q_proj,k_prj: pattern 'k_prj' matches no layer. Closest layer names: k_proj, "
                        "v_proj, q_proj."),
    (("q_proj,k_proj", "k_proj,v_proj"),
     "error: --tie k_proj,v_proj: layer model.layers.0.self_attn.k_proj is already in the tie q_proj/k_proj "
     "(model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj): a layer takes one rank. Put each layer in "
     "one --tie group (join the groups into one to tie them all)."),
    (("q_proj",), "error: --tie q_proj is a group of one: a tie makes two or more layers share one rank. Name every "
                  "member, e.g. --tie q_proj,k_proj,v_proj (or --tie auto for the known defaults)."),
    (("lm_head,model.embed_tokens",),
     "error: --tie lm_head,model.embed_tokens: members of different kinds in block (the model): lm_head (linear), "
     "model.embed_tokens (embedding). Tie layers of one kind (a fused kernel concatenates one kind of product)."),
    (("q_proj,gate_proj",),
     "error: --tie q_proj,gate_proj: in block model.layers.0.self_attn only model.layers.0.self_attn.q_proj matches; "
     "'gate_proj' matches none there. Tie layers that every block holds, or narrow the patterns to the blocks that "
     "hold them all."),
    (("*_proj,lm_head",),
     "error: --tie *_proj,lm_head: pattern '*_proj' matches 3 layers in block model.layers.0.mlp "
     "(model.layers.0.mlp.down_proj, model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj). Give patterns that "
     "select one layer per block."),
    (("q_proj,,v_proj",), "error: --tie q_proj,,v_proj holds an empty layer pattern. Separate patterns with single "
                          "commas, e.g. --tie q_proj,k_proj,v_proj."),
])
def test_a_bad_tie_is_one_line_and_exit_2(cli_inproc, tmp_path, ties, line):
    args = [a for t in ties for a in ("--tie", t)]
    _bad(cli_inproc(LLAMA, "--no-spectra", *args, "-o", tmp_path / "out", "--format", "json"), line)
    assert not (tmp_path / "out").exists()


def test_auto_on_a_model_of_no_known_family_is_a_note_not_an_error(digits_mlp):
    a = auditor.audit(digits_mlp[0], spectra=False, ties="auto", cache=False, progress=False)
    assert a.ties == () and ("--tie auto: no tie group of a family the tool knows (q/k/v, gate/up; auditor/planning/"
                             "ties.py) is in this model; ranks are chosen per layer") in a.notes


def test_a_plans_ties_are_read_and_checked(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('ties = ["q_proj"]\n[ranks]\n"lm_head" = 8\n')
    with pytest.raises(AuditError, match=r"^plan .*plan.toml: ties: q_proj is a group of one"):
        auditor.planning.plan.Plan.load(p)
    p.write_text('ties = "q_proj,k_proj"\n[ranks]\n"lm_head" = 8\n')
    with pytest.raises(AuditError, match=r"'ties' is text \('q_proj,k_proj'\), not a list of tie groups"):
        auditor.planning.plan.Plan.load(p)
    p.write_text('ties = ["q_proj,k_proj", ["gate_proj", "up_proj"]]\n[ranks]\n"lm_head" = 8\n')
    assert auditor.planning.plan.Plan.load(p).ties == (("q_proj", "k_proj"), GATE_UP)


def test_final_suggestions_that_would_break_a_tie_keep_the_group_dense():
    from auditor.planning.ties import keep_ties
    from auditor.results import Suggestion, Verdict

    g = TieGroup("q/k", "b", ("b.q", "b.k"))
    sgs = {"b.q": Suggestion("b.q", Verdict.FACTORIZE, 16, "calibrated"),
           "b.k": Suggestion("b.k", Verdict.FACTORIZE, 8, "data-free"),
           "c": Suggestion("c", Verdict.FACTORIZE, 4, "alone")}
    out = keep_ties(sgs, [g])
    assert [(k, s.verdict, s.rank) for k, s in out.items()] == [
        ("b.q", Verdict.KEEP_DENSE, None), ("b.k", Verdict.KEEP_DENSE, None), ("c", Verdict.FACTORIZE, 4)]
    assert out["b.k"].reason == "tied (--tie q/k), and the members' ranks differ (b.q 16, b.k 8); alone: data-free"
    assert keep_ties({**sgs, "b.k": Suggestion("b.k", Verdict.FACTORIZE, 16, "x")}, [g])["b.q"].rank == 16


# ---- the search on one group ----------------------------------------------------------------------------------------
def test_a_group_is_one_option_list_at_the_ranks_every_member_offers_and_never_split():
    c = Curves({"q": [Option(8, 100, 1.0), Option(16, 50, 0.2), Option(24, 10, 0.1)],
                "k": [Option(8, 40, 0.5), Option(16, 20, 0.3)], "o": [Option(8, 70, 0.6)]}, "tier1")
    t, dense = tie_curves(c, [TieGroup("q/k", "b", ("q", "k"))])
    assert t.options["q\x00k"] == [Option(8, 140, 1.5), Option(16, 70, 0.5)] and dense == []
    for target in range(0, 211, 10):
        plan = allocate(t, target)[0]
        assert plan.get("q") == plan.get("k")
    # a member without an option keeps the whole group dense, said
    t2, dense2 = tie_curves(c, [TieGroup("q/x", "b", ("q", "x"))])
    assert "q" not in t2.options and [g.label for g in dense2] == ["q/x"]


def test_the_ties_cost_is_read_off_the_hull_and_never_negative():
    c = Curves({"q": [Option(8, 100, 1.0), Option(16, 50, 0.2)], "k": [Option(8, 40, 0.1), Option(16, 20, 0.05)]},
               "tier1")
    # untied at cost 0.3: k at 8 (40 for 0.1) and q at 16 (50 for 0.2): 90; tied: rank 16 (70 for 0.25), then a
    # fifth of the way to rank 8 (140 for 1.1): 70 + 70 * 0.05 / 0.85
    assert removal_within(c, 0.3) == pytest.approx(90.0)
    cost = tie_cost(c, [TieGroup("q/k", "b", ("q", "k"))], 0.3, 1000)
    assert (cost.untied, cost.removed) == (90, 74)
    assert cost.each == {"q/k": pytest.approx((90 - (70 + 70 * 0.05 / 0.85)) / 1000)}
    assert cost.words() == ("ties cost 1.59 points of removal (q/k: 1.59), against the same search without them "
                            "at the plan's predicted cost")


# ---- the sample Llama, calibrated, --tie auto -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """The README's calibrated audit of the sample Llama with ties="auto" (--tie auto), every format written."""
    out = tmp_path_factory.mktemp("tied")
    a = auditor.audit_source(str(LLAMA), options=AuditOptions(
        calibration=str(LLAMA / "calib.txt"), holdout=str(LLAMA / "holdout.txt"), ties="auto", cache=False,
        progress=False))
    (out / "report").mkdir()
    for name, text in (("json", a.to_json()), ("txt", a.to_text()), ("md", a.to_markdown()), ("html", a.to_html()),
                       ("notebook.html", a._repr_html_())):
        (out / "report" / f"lowrank-audit.{name}").write_text(text)
    a.emit_plan(out / "plan.toml")
    return out, json.loads((out / "report" / "lowrank-audit.json").read_text())


def test_the_searched_plan_gives_each_group_one_rank(tied_run):
    out, d = tied_run
    plan = d["calibration"]["budget"]["plan"]
    ties = [TieGroup(t["tie"], t["block"], tuple(t["members"])) for t in d["ties"]]
    assert len(ties) == 8 and violations(plan, ties) == []
    assert plan == PLAN
    assert not [f for f in d["findings"] if f["code"] == "LR021"]


def test_the_emitted_plan_carries_the_ties_and_reviews_clean(tied_run):
    out, _ = tied_run
    text = (out / "plan.toml").read_text()
    assert 'ties = ["q_proj,k_proj,v_proj", "gate_proj,up_proj"]' in text
    plan = auditor.planning.plan.Plan.load(out / "plan.toml")
    assert plan.ties == (QKV, GATE_UP)
    ranks = {n: r for p, r in plan.ranks.items() for n in _all_names(out) if fnmatch.fnmatchcase(n, p)}
    assert ranks == PLAN  # the emitted lines read back to the searched plan: each group at one rank


def test_what_the_ties_cost_is_in_every_format(tied_run):
    out, d = tied_run
    t = d["calibration"]["budget"]["ties"]
    assert (t["removed"], t["untied"], t["groups"], t["dense"]) == (COST["removed"], COST["untied"], 8, [])
    assert t["each"] == {k: pytest.approx(v, abs=1e-6) for k, v in COST["each"].items()}
    assert t["cost"] == pytest.approx(sum(t["each"].values()), abs=1e-12) and all(v >= 0 for v in t["each"].values())
    words = t["words"]
    assert words == COST["words"]
    line = (f"Tie groups (--tie, 8 groups, each at one rank): {words} (157,694 -> 153,792 parameters the curves "
            "remove at that cost).")
    for name, form in (("txt", line), ("md", md_text(line)), ("html", line), ("notebook.html", words)):
        text = (out / "report" / f"lowrank-audit.{name}").read_text()
        flat = " ".join((html.unescape(text) if name.endswith("html") else text).split())
        assert form in flat, name


def _all_names(out: Path) -> list[str]:
    return [l["name"] for l in json.loads((out / "report" / "lowrank-audit.json").read_text())["layers"]]


def _shapes(folder: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def test_factorize_writes_one_rank_per_group_whatever_the_widths(tied_run, cli_inproc, tmp_path):
    """q (128 wide) and k, v (64 wide) at one rank 24: one first-factor height for the stacked [A_q; A_k; A_v]."""
    p = tmp_path / "qkv.toml"
    p.write_text('ties = ["q_proj,k_proj,v_proj", "gate_proj,up_proj"]\nfinetune = "1 epoch"\n[ranks]\n'
                 '"model.layers.*.self_attn.[qkv]_proj" = 24\n"model.layers.*.mlp.gate_proj" = 48\n'
                 '"model.layers.*.mlp.up_proj" = 48\n')
    res = cli_inproc("factorize", LLAMA, "--plan", p, "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    shapes = _shapes(tmp_path / "out")
    for i in range(4):
        a = f"model.layers.{i}.self_attn"
        assert [shapes[f"{a}.{x}.0.weight"] for x in QKV] == [[24, 128]] * 3
        assert [shapes[f"{a}.{x}.1.weight"] for x in QKV] == [[128, 24], [64, 24], [64, 24]]
        assert [shapes[f"model.layers.{i}.mlp.{x}.0.weight"] for x in GATE_UP] == [[48, 128]] * 2


def test_a_plan_that_breaks_a_tie_is_lr021_and_factorize_refuses_it(cli_inproc, tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text('ties = ["gate_proj,up_proj"]\nfinetune = "1 epoch"\n[ranks]\n"model.layers.*.mlp.gate_proj" = 48\n'
                 '"model.layers.1.mlp.up_proj" = 40\n')
    res = cli_inproc(LLAMA, "--plan", p, "--format", "json", "--no-cache")
    assert res.returncode == 1
    found = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "LR021"]
    assert [(f["layers"], f["evidence"]["ranks"]) for f in found] == [
        ([f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"],
         {f"model.layers.{i}.mlp.gate_proj": 48, f"model.layers.{i}.mlp.up_proj": 40 if i == 1 else 0})
        for i in range(4)]
    res = cli_inproc("factorize", LLAMA, "--plan", p, "-o", tmp_path / "out")
    _bad(res, f"error: LR021 plan {p} breaks the tie gate_proj/up_proj in model.layers.0.mlp: "
              "model.layers.0.mlp.gate_proj at rank 48, model.layers.0.mlp.up_proj dense (and 3 more groups). Give "
              "every member of a tie group one rank (or keep them all dense), or drop the tie (--tie, the plan's "
              "ties); factorize writes no model that breaks a tie.")
    assert not (tmp_path / "out").exists()
    # --tie on the command line ties a plan that names no ties
    q = tmp_path / "untied.toml"
    q.write_text('finetune = "1 epoch"\n[ranks]\n"model.layers.0.self_attn.q_proj" = 24\n')
    res = cli_inproc("factorize", LLAMA, "--plan", q, "--tie", "q_proj,k_proj,v_proj", "-o", tmp_path / "out2")
    assert res.returncode == 2 and "LR021 plan" in res.stderr and "breaks the tie q_proj/k_proj/v_proj" in res.stderr


def test_the_library_factorize_refuses_a_plan_that_breaks_its_ties(tmp_path):
    import transformers

    p = tmp_path / "broken.toml"
    p.write_text('ties = ["q_proj,k_proj,v_proj"]\n[ranks]\n"model.layers.0.self_attn.[qk]_proj" = 24\n')
    model = transformers.LlamaForCausalLM.from_pretrained(str(LLAMA))
    with pytest.raises(AuditError, match=r"^LR021 the plan breaks the tie q_proj/k_proj/v_proj in "
                                         r"model\.layers\.0\.self_attn: .*k_proj at rank 24, .*v_proj dense\."):
        auditor.factorize(model, p)


def test_without_tie_nothing_changes(structure):
    assert structure.ties == () and "ties" not in auditor.audit_source(
        str(LLAMA), options=AuditOptions(spectra=False, cache=False, progress=False)).to_dict()


# the search over the gradient-predicted curves at the default tolerance (perplexity +1%): q/k/v dense in every block
# (k and v, 64 x 128, offer ranks up to 32 at the 1.1x compression floor: the group's ranks are those), gate/up at
# one rank in three blocks
PLAN = {"model.layers.3.mlp.down_proj": 72, "model.layers.1.self_attn.o_proj": 48,
        "model.layers.2.self_attn.o_proj": 40, "model.layers.3.self_attn.o_proj": 40,
        **{f"model.layers.{b}.self_attn.{p}_proj": 32 for b in (1, 2, 3) for p in "qkv"},
        "model.layers.1.mlp.gate_proj": 56, "model.layers.1.mlp.up_proj": 56, "model.layers.2.mlp.gate_proj": 56,
        "model.layers.2.mlp.up_proj": 56, "model.layers.3.mlp.gate_proj": 72, "model.layers.3.mlp.up_proj": 72}
# at the plan's predicted cost the untied curves remove 157,694 parameters, the tied ones 153,792 (of 1,250,432):
# q/k/v's tie costs 0.27 points, gate/up's 0.04 (same shapes, alike costs: the hull barely moves)
COST = {"removed": 153792, "untied": 157694, "each": {"q_proj/k_proj/v_proj": 0.002725596861938865,
                                                       "gate_proj/up_proj": 0.00039525527140120013},
        "words": "ties cost 0.31 points of removal (q_proj/k_proj/v_proj: 0.27, gate_proj/up_proj: 0.04), against the "
                 "same search without them at the plan's predicted cost"}
