"""The width-1024 Llama shapes of ``benchmarks/llm_calibration.py`` as command-line sources, for measuring
``--estimate`` against a real run (docs/performance.md): ``benchmarks/estimate_shapes.py:llama_d2`` (and ``_d4``,
``_d8``), random init (cost only), vocabulary 8,000, and ``python benchmarks/estimate_shapes.py OUT.safetensors``
writes their calibration file: 24 windows of 128 random token ids. ``benchmarks/estimate_shapes.py:tinyllama``: the
TinyLlama-1.1B shape (hidden 2048, 22 layers, GQA 32/4, intermediate 5632, vocabulary 32,000) in bfloat16, random
init; ``python benchmarks/estimate_shapes.py OUT.safetensors --tinyllama`` writes its calibration: 64 windows of
256 random token ids (read with ``--compute-dtype float32``). ``benchmarks/estimate_shapes.py:gqa135m``: a 135M
shape with a large vocabulary (hidden 576, 30 layers, GQA 9/3, intermediate 1536, vocabulary 49,152, tied
embeddings) in bfloat16, random init; ``python benchmarks/estimate_shapes.py OUT.safetensors --gqa135m`` writes 48
windows of 512 random token ids (about what 100,000 characters of English make with such a tokenizer)."""

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


def tinyllama() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=2048, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with _default_dtype(torch.bfloat16):
        return transformers.LlamaForCausalLM(cfg).eval()


class _default_dtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.before = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.before)


def gqa135m() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with _default_dtype(torch.bfloat16):
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
    vocab, rows, tokens = ((32000, 64, 256) if "--tinyllama" in sys.argv else (49152, 48, 512)
                           if "--gqa135m" in sys.argv else (VOCAB, WINDOWS, TOKENS))
    save_file({"input_ids": torch.randint(0, vocab, (rows, tokens), generator=g)}, sys.argv[1])
