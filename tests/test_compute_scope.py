"""--compute-dtype float32 for every forward of a calibrated audit (auditor/calibration/data/precision.py): a bf16
model's dense reference, gradients, plans and verification computed as its float32 copy computes them, the weights
left bf16 and bit-identical, nothing left shadowing a parameter, also after a forward that raised."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import auditor
from auditor.calibration.data.precision import computing_in


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _no_shadow(model: nn.Module) -> bool:
    return not any(k in m.__dict__ for m in model.modules() for k in [*m._parameters, *m._buffers])


def test_forward_and_backward_as_the_float32_copy_and_the_weights_untouched():
    model = _tiny_llama()
    ref = copy.deepcopy(model).float()
    before = _bits(model)
    ids = torch.randint(1, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with computing_in(model, torch.float32) as on:
        y = model(input_ids=ids).logits
        h = model.model.embed_tokens(ids).detach().requires_grad_(True)
        g, = torch.autograd.grad(model.model.layers[0](h, position_embeddings=model.model.rotary_emb(h, torch.arange(
            9)[None]))[0].square().sum(), h)
    hr = ref.model.embed_tokens(ids).detach().requires_grad_(True)
    gr, = torch.autograd.grad(ref.model.layers[0](hr, position_embeddings=ref.model.rotary_emb(hr, torch.arange(
        9)[None]))[0].square().sum(), hr)
    assert on and y.dtype == torch.float32 and torch.equal(y, ref(input_ids=ids).logits)
    assert torch.equal(g, gr)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert _no_shadow(model)
    with torch.no_grad():  # outside the block: the model's own dtype again
        assert model(input_ids=ids).logits.dtype == torch.bfloat16


def test_a_forward_that_raises_leaves_no_shadow_and_float32_models_are_left_alone():
    model = _tiny_llama()
    with pytest.raises(IndexError), computing_in(model, torch.float32):
        model(input_ids=torch.tensor([[1, 2, 500]]))  # an id beyond the vocabulary: the embedding raises
    assert _no_shadow(model)
    plain = nn.Linear(3, 2)
    with computing_in(plain, torch.float32) as on:
        assert not on and not torch.nn.modules.module._global_forward_pre_hooks
    with computing_in(model, None) as on:
        assert not on


def test_a_bf16_audit_in_float32_measures_what_its_float32_copy_measures():
    """The dense reference (held-out perplexity) and the gradient-predicted costs of a bf16 model audited with
    --compute-dtype float32 are its float32 copy's, bit for bit; in bf16 arithmetic (the model's own dtype, which
    the statistics alone used to escape) the reference differs."""
    model = _tiny_llama()
    before = _bits(model)
    ids = torch.randint(1, 101, (16, 24), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids}

    def run(m: nn.Module, **kw) -> auditor.Audit:
        return auditor.audit(m, {"input_ids": ids[:1]}, cache=False, progress=False, calibration=data,
                             probe_sensitivity=False, **kw)

    half = run(model, compute_dtype="float32").calibration
    full = run(copy.deepcopy(model).float()).calibration
    own = run(model).calibration
    assert half.reference == full.reference and own.reference != full.reference
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert _no_shadow(model) and not torch.nn.modules.module._global_forward_pre_hooks
