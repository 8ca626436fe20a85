"""Issue 13, the emitted plan: names reach TOML only as escaped strings (never raw in a comment), the plan reads back
to exactly the suggested ranks whatever the names hold, and the tool's own plan passes its own review."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from auditor.config import tomllib

INJECTION = 'tiny\n[thresholds]\nfail_on = "never"\n#'


def low_rank_file(path: Path, names: list[str], m: int = 96, n: int = 80, r: int = 4, dense: tuple[str, ...] = ()):
    """A safetensors file of rank-``r`` m x n tensors (rank 8 suggested for each), and full-rank ``dense`` ones."""
    g = torch.Generator().manual_seed(len(names))
    tensors = {name: (torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)).contiguous() for name in names}
    tensors.update({name: torch.randn(m, n, generator=g) for name in dense})
    save_file(tensors, str(path))
    return path


def review(cli_inproc, *args) -> tuple[int, dict]:
    res = cli_inproc(*args, "-q", "--format", "json")
    assert "Traceback" not in res.stderr
    return res.returncode, (json.loads(res.stdout) if res.returncode in (0, 1) else {"stderr": res.stderr})


def test_a_name_cannot_become_toml(cli_inproc, tmp_path):
    src = low_rank_file(tmp_path / "w.safetensors", [INJECTION, "fc.weight"], dense=[INJECTION + "2"])
    plan = tmp_path / "plan.toml"
    code, suggested = review(cli_inproc, src, "--emit-plan", plan)
    assert code == 0
    text = plan.read_text(encoding="utf-8")
    assert "\n[thresholds]" not in text and '\nfail_on = "never"' not in text
    data = tomllib.loads(text)
    assert set(data) == {"finetune", "ranks"}
    assert data["ranks"] == {"tiny\n[[]thresholds]\nfail_on = \"never\"\n#": 8, "fc": 8}
    # the dense layer's name is in a comment, escaped
    assert '# tiny\\n[thresholds]\\nfail_on = \\"never\\"\\n#2: keep dense' in text
    code, reviewed = review(cli_inproc, src, "--plan", plan, "--fail-on", "warning")
    assert code == 1  # LR005: the emitted plan asks for a fine-tune budget; nothing turned fail_on to never
    assert [f["code"] for f in reviewed["findings"] if f["severity"] != "info"] == ["LR005"]
    assert {i["layer"]: i["rank"] for i in reviewed["plan_review"]["items"]} == \
        {i["layer"]: i["rank"] for i in suggested["plan_review"]["items"]}


NAMES = {
    "non-bmp": ["\U0001d534\U0001f642.weight", "\U00020000x.weight"],
    "controls": ["a\x01b\x7f.weight", "c\x1b]0;title\x07.weight", "\u202eevil\u2028x.weight", "d\r\n\t.weight"],
    "globs": ["w[0]*?.weight", "w[1]*?.weight", "[!a].weight", "*.weight", "?.weight"],
    "quotes": ['q"\\\'.weight', "''' \"\"\".weight"],
    "groups": [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1, 2, 10)]
    + ["model.layers.x.mlp.down_proj.weight"],
}


@pytest.mark.parametrize("case", sorted(NAMES))
def test_emitted_plan_reads_back_to_the_same_ranks(cli_inproc, tmp_path, case):
    src = low_rank_file(tmp_path / "w.safetensors", NAMES[case])
    plan = tmp_path / "plan.toml"
    code, suggested = review(cli_inproc, src, "--emit-plan", plan)
    assert code == 0
    plan.write_text(plan.read_text(encoding="utf-8").replace('finetune = ""', 'finetune = "1 epoch"'),
                    encoding="utf-8")
    code, reviewed = review(cli_inproc, src, "--plan", plan, "--fail-on", "warning")
    want = {i["layer"]: i["rank"] for i in suggested["plan_review"]["items"]}
    assert len(want) == len(NAMES[case])
    assert {i["layer"]: i["rank"] for i in reviewed["plan_review"]["items"]} == want
    assert code == 0, reviewed["findings"]


def test_members_that_agree_become_one_glob(cli_inproc, tmp_path):
    src = low_rank_file(tmp_path / "w.safetensors", NAMES["groups"][:4])
    plan = tmp_path / "plan.toml"
    assert review(cli_inproc, src, "--emit-plan", plan)[0] == 0
    assert tomllib.loads(plan.read_text())["ranks"] == {"model.layers.*.mlp.down_proj": 8}


GPT2 = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=0)
    m = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape[0], 4) @ torch.randn(4, p.shape[1]) / 8)
    return m, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
'''


def test_own_plan_passes_own_review_on_tied_gpt2(cli_inproc, tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "gpt2.py").write_text(GPT2)
    src = f"{tmp_path / 'gpt2.py'}:model"
    plan = tmp_path / "plan.toml"
    code, suggested = review(cli_inproc, src, "--emit-plan", plan)
    assert code == 0
    text = plan.read_text()
    ranks = tomllib.loads(text)["ranks"]
    # the tied embedding/decoder is not suggested (one factorization would change both uses): left dense, saying why
    assert "transformer.wte" not in ranks and "# transformer.wte: keep dense (tied or shared (transformer.wte.weight, " \
        "lm_head.weight; 2 use(s) per forward)" in text
    assert suggested["suggestions"]["transformer.wte"]["verdict"] == "keep dense"
    assert ranks == {"transformer.h.*.attn.c_attn": 8, "transformer.h.*.attn.c_proj": 8,
                     "transformer.h.*.mlp.c_fc": 8, "transformer.h.*.mlp.c_proj": 8, "transformer.wpe": 8}
    code, reviewed = review(cli_inproc, src, "--plan", plan, "--fail-on", "warning")
    assert code == 1 and [f["code"] for f in reviewed["findings"] if f["severity"] == "warning"] == ["LR005"]
    plan.write_text(text.replace('finetune = ""', 'finetune = "1 epoch, lr 1e-4"'))  # the one edit it asks for
    code, reviewed = review(cli_inproc, src, "--plan", plan, "--fail-on", "warning")
    assert code == 0, reviewed["findings"]
    assert len(reviewed["plan_review"]["items"]) == 9 and reviewed["plan_review"]["params_saved"] == 83_200
