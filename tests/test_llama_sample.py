"""The shipped sample Llama (sample_models/llama, made by sample_models/train_llama.py): it loads as a grouped-query
attention LlamaForCausalLM with a SwiGLU MLP, its tokenizer round-trips standard-library source, a structure-only
audit counts its parameters exactly (by hand from the config), and the held-out perplexity a short text-calibration
audit reports equals a hand computation on the same windows (as does the evaluator's on a right-padded batch, pads
excluded)."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

import auditor
from auditor.calibration import load_calibration
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.options import LoadOptions

transformers = pytest.importorskip("transformers")

LLAMA = Path(__file__).resolve().parents[1] / "sample_models" / "llama"
CFG = json.loads((LLAMA / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(LLAMA))


@pytest.fixture(scope="module")
def model():
    return transformers.LlamaForCausalLM.from_pretrained(str(LLAMA), dtype=torch.float32).eval()


def _windows(tokenizer, path: Path, length: int, limit: int | None = None) -> torch.Tensor:
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    n = len(ids) // length if limit is None else min(limit, len(ids) // length)
    return torch.tensor(ids[:n * length]).view(n, length)


def _hand_perplexity(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """exp(mean next-token cross-entropy), a target counted when it and the position predicting it are real."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(2, ids[:, 1:, None])[..., 0]
    keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    return math.exp(float(nll[keep].mean()))


def test_files_and_size():
    names = sorted(p.name for p in LLAMA.iterdir())
    assert names == ["calib.txt", "config.json", "holdout.txt", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in LLAMA.iterdir()) < 10 << 20
    calib, held = ((LLAMA / n).read_text(encoding="utf-8") for n in ("calib.txt", "holdout.txt"))
    assert 64 << 10 <= len(calib.encode()) <= 128 << 10 and 64 << 10 <= len(held.encode()) <= 128 << 10
    # disjoint files of the standard library: no line of 60+ characters in both
    long_lines = {line for line in calib.splitlines() if len(line) >= 60}
    assert long_lines and not long_lines & {line for line in held.splitlines() if len(line) >= 60}


def test_config_is_gqa_swiglu(model, tokenizer):
    assert type(model).__name__ == "LlamaForCausalLM"
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.head_dim) == (4, 2, 128, 32)
    assert c.num_key_value_heads < c.num_attention_heads and c.hidden_act == "silu"
    assert (c.vocab_size, len(tokenizer)) == (2048, 2048) and not c.tie_word_embeddings
    block = model.model.layers[0]
    assert block.self_attn.k_proj.weight.shape == (64, 128) and block.self_attn.q_proj.weight.shape == (128, 128)
    assert {n for n, _ in block.mlp.named_children()} >= {"gate_proj", "up_proj", "down_proj"}
    assert block.mlp.gate_proj.weight.shape == (344, 128) and block.mlp.down_proj.weight.shape == (128, 344)
    assert type(block.input_layernorm).__name__ == "LlamaRMSNorm"
    # the shipped weights are bfloat16 values: float32 to bfloat16 and back changes none
    w = model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(w, w.to(torch.bfloat16).float())


def test_tokenizer_round_trips_stdlib(tokenizer):
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text(encoding="utf-8")[:3000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # BPE merges: well under a token per two bytes on Python source
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)


def _hand_params() -> tuple[int, dict[str, int]]:
    d, f, v, L = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], CFG["num_hidden_layers"]
    kv = CFG["num_key_value_heads"] * CFG["head_dim"]
    per_block = d * d + 2 * kv * d + d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    total = v * d + L * per_block + d + d * v  # embedding, blocks, final norm, untied head
    return total, {"q_proj": d * d, "k_proj": kv * d, "v_proj": kv * d, "o_proj": d * d, "gate_proj": d * f,
                   "up_proj": d * f, "down_proj": f * d}


def test_structure_only_counts():
    total, per = _hand_params()
    assert total == 1_250_432
    a = auditor.audit_source(str(LLAMA), options=auditor.AuditOptions(spectra=False, cache=False, progress=False),
                             load=LoadOptions(structure_only=True))
    assert a.total_params == total
    by = {layer.name: layer for layer in a.layers}
    for i in range(CFG["num_hidden_layers"]):
        for part, n in per.items():
            sub = "self_attn" if part.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            layer = by[f"model.layers.{i}.{sub}.{part}"]
            assert layer.m * layer.n == n
    assert (by["lm_head"].m, by["lm_head"].n) == (2048, 128)


def test_text_calibration_perplexity_equals_hand(model, tokenizer, tmp_path):
    """A short audit with text calibration (a few windows of each shipped text): the dense held-out perplexity it
    reports is the hand computation on the windows the tokenizer gives."""
    length = 64
    for name in ("calib.txt", "holdout.txt"):  # the first few kilobytes of each text, cut at a line end
        text = (LLAMA / name).read_text(encoding="utf-8")[:4000]
        (tmp_path / name).write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
    a = auditor.audit_source(str(LLAMA), options=auditor.AuditOptions(
        calibration=str(tmp_path / "calib.txt"), holdout=str(tmp_path / "holdout.txt"), calibration_length=length,
        cache=False, progress=False))
    cal = a.calibration
    held = _windows(tokenizer, tmp_path / "holdout.txt", length)
    assert held.shape[0] >= 8 and cal.holdout_rows == held.shape[0]
    assert cal.metric.startswith("perplexity") or "perplexity" in cal.metric
    search = min(held.shape[0] - 1, max(1, round(held.shape[0] * 0.5)))  # the search half measures the reference
    assert cal.reference == pytest.approx(_hand_perplexity(model, held[:search]), rel=1e-6)
    assert 1 < cal.reference < 2048  # a trained model: well under the uniform guess's perplexity


def test_padded_perplexity_equals_hand(model, tokenizer):
    """Right-padded held-out rows (pad id 1, attention_mask 0): the evaluator's perplexity counts the real tokens."""
    ids = _windows(tokenizer, LLAMA / "holdout.txt", 48, limit=4)
    mask = torch.ones_like(ids)
    for row, real in enumerate((48, 30, 17, 5)):
        ids[row, real:] = 1
        mask[row, real:] = 0
    fit = _windows(tokenizer, LLAMA / "calib.txt", 48, limit=4)
    cal = load_calibration({"input_ids": fit, "attention_mask": torch.ones_like(fit)}, model,
                           holdout={"input_ids": ids, "attention_mask": mask}, batch_size=4)
    ev = Evaluator(model, cal, Metric(kind="perplexity"))
    hand = _hand_perplexity(model, ids, mask)
    assert ev.reference == pytest.approx(hand, rel=1e-6)
    assert hand != pytest.approx(_hand_perplexity(model, ids), rel=1e-3)  # the pads would have changed it


def test_shipped_weights_are_the_trained_ones(model, tokenizer):
    """train_llama.py's 1,500 steps: the perplexity of the first 16 windows of 128 tokens of each shipped text, as
    measured when the weights were made (float32; BLAS differences move it by far less than 1e-4). The calibration
    text is training text, so it reads as the easier of the two."""
    held = _hand_perplexity(model, _windows(tokenizer, LLAMA / "holdout.txt", 128, limit=16))
    fit = _hand_perplexity(model, _windows(tokenizer, LLAMA / "calib.txt", 128, limit=16))
    assert held == pytest.approx(55.3502, rel=1e-4)
    assert fit == pytest.approx(25.6343, rel=1e-4)
