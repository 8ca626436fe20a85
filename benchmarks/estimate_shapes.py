"""The width-1024 Llama shapes of ``benchmarks/llm_calibration.py`` as command-line sources, for measuring
``--estimate`` against a real run (docs/performance.md): ``benchmarks/estimate_shapes.py:llama_d2`` (and ``_d4``,
``_d8``), random init (cost only), vocabulary 8,000, and ``python benchmarks/estimate_shapes.py OUT.safetensors``
writes their calibration file: 24 windows of 128 random token ids."""

from __future__ import annotations

import sys

import torch

VOCAB, WINDOWS, TOKENS = 8000, 24, 128


def _llama(layers: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=2048)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def llama_d2() -> torch.nn.Module:
    return _llama(2)


def llama_d4() -> torch.nn.Module:
    return _llama(4)


def llama_d8() -> torch.nn.Module:
    return _llama(8)


if __name__ == "__main__":
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(0, VOCAB, (WINDOWS, TOKENS), generator=g)}, sys.argv[1])
