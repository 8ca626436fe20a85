"""Hugging Face models built from configs (random init, no network): exact unique-parameter counts, ties, shares."""

import math

import pytest
import torch

import auditor

transformers = pytest.importorskip("transformers")


def ids(n=16):
    return {"input_ids": torch.zeros(1, n, dtype=torch.long)}


def test_bert_base_unique_params():
    a = auditor.audit(transformers.BertModel(transformers.BertConfig()), spectra=False)
    assert a.total_params == 109_482_240
    assert [l.name for l in a.layers[1:4]] == ["encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense",
                                               "encoder.layer.1.intermediate.dense"]  # natural order among equals
    assert math.isclose(sum(l.share for l in a.layers) + a.rest_share, 1.0, rel_tol=1e-12)


def test_gpt2_tied_lm_head_is_a_use_of_wte():
    cfg = transformers.GPT2Config(use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    a = auditor.audit(model, ids(), spectra=False)
    assert a.total_params == 124_439_808
    assert a.trace_method == "torch.export"
    wte = a.layer("transformer.wte")
    assert wte.aliases == ["lm_head.weight"]
    assert {(u.site, u.op) for u in wte.uses} == {("transformer.wte", "embedding"), ("lm_head", "linear")}
    assert wte.macs == 16 * 50257 * 768  # the head's matmul; the lookup itself costs no MACs
    assert wte.lookups == 16
    assert not any(l.name == "lm_head" for l in a.layers)  # counted once
    c_attn = a.layer("transformer.h.0.attn.c_attn")
    assert (c_attn.m, c_attn.n) == (2304, 768) and c_attn.macs == 16 * 2304 * 768


def test_albert_shared_layers_listed_with_twelve_uses():
    cfg = transformers.AlbertConfig(embedding_size=128, hidden_size=768, num_hidden_layers=12,
                                    num_attention_heads=12, intermediate_size=3072, vocab_size=30000)
    a = auditor.audit(transformers.AlbertModel(cfg), ids(), spectra=False)
    assert a.total_params == 11_683_584
    shared = [l for l in a.layers if "albert_layers.0" in l.name]
    assert len(shared) == 6
    assert all(l.calls == 12 for l in shared)
    ffn = a.layer("encoder.albert_layer_groups.0.albert_layers.0.ffn")
    assert ffn.macs == 12 * 16 * 3072 * 768


def test_llama_7b_structure_on_meta_device_allocates_nothing():
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    a = auditor.audit(model)
    assert a.total_params == 6_738_415_616
    q = a.layer("model.layers.0.self_attn.q_proj")
    assert q.break_even == 2048.0
    assert a.layer("model.layers.0.mlp.up_proj").m == 11008
    assert all(s.verdict == "skipped" for s in a.suggestions.values())
    assert any("meta device" in n for n in a.notes)
