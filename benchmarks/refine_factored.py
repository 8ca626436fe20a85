"""The block refinement's training step with each planned Linear factored against the product A B in its weight's
place (auditor/calibration/statistics/refine.py), side by side in one run.

    python benchmarks/refine_factored.py [--hidden 1024 --intermediate 2816 --heads 16 --kv 4] [--rows 4 --tokens 256]
                                         [--share 0.5] [--steps 3]

builds one random-init Llama decoder layer of that shape (float32), plans its seven Linears at ``share`` of their
break-even rank m n / (m + n) (plain SVD factors), and times a training step (the block's forward with the factors in
place, the mean squared error against the dense block's output, the backward to the factors) both ways on the same
batch, the quicker of ``steps`` each after one warm-up; then prints the ratio, the two losses (equal to float32
rounding: the same map, multiplied in another order) and the peak RSS of the process. ``--hidden 4096
--intermediate 11008 --heads 32 --kv 32`` is the Llama-2-7B block (about 2.4 GB of float32 weights and a batch's
activations: run it on a machine with the memory).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from auditor.calibration.statistics import refine as rf
from auditor.calibration.statistics.whiten import Truncator
from auditor.surgery import checked_plan


def _block(a: argparse.Namespace) -> tuple[torch.nn.Module, tuple, dict]:
    import transformers
    from transformers.models.llama import modeling_llama as ml

    cfg = transformers.LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=1,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv, vocab_size=256,
                                   max_position_embeddings=max(2048, a.tokens))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    blk = ml.LlamaDecoderLayer(cfg, 0).eval()
    x = torch.randn(a.rows, a.tokens, a.hidden)
    pos = torch.arange(a.tokens).unsqueeze(0).expand(a.rows, -1)
    cos_sin = ml.LlamaRotaryEmbedding(cfg)(x, pos)
    return blk, (x,), {"position_embeddings": cos_sin, "position_ids": pos}


def _hidden(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _step_seconds(blk: torch.nn.Module, planned: list, inputs: tuple, target: torch.Tensor, factored: bool,
                  steps: int) -> tuple[float, float]:
    params = dict(blk.named_parameters())
    factors = [rf._factor(layer, name, params[name], ab) for layer, name, ab in planned]
    best, loss = float("inf"), 0.0
    with rf._factored(blk, factors if factored else []), torch.enable_grad():
        frozen = {k: p.detach() for k, p in blk.named_parameters()}
        for i in range(steps + 1):
            t = time.perf_counter()
            err = rf._block_error(blk, factors, frozen, inputs, target, None, _hidden)
            err.backward()
            if i:
                best = min(best, time.perf_counter() - t)
            loss = float(err.detach())
    return best, loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in (("hidden", 1024), ("intermediate", 2816), ("heads", 16), ("kv", 4), ("rows", 4), ("tokens", 256),
                 ("steps", 3)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--share", type=float, default=0.5)
    a = ap.parse_args()
    blk, args, kwargs = _block(a)
    names = [n for n, m in blk.named_modules() if isinstance(m, torch.nn.Linear)]
    ranks = {}
    for n in names:
        m, k = blk.get_submodule(n).weight.shape
        ranks[n] = max(1, int(a.share * m * k / (m + k)))
    plan = checked_plan(blk, ranks)
    planned = [(layer, f"{n}.weight", Truncator(layer, blk.get_submodule(n).weight, None).factors(r))
               for n, (layer, r) in plan.items()]
    with torch.no_grad():
        target = _hidden(blk(*args, **kwargs))
    inputs = (args, kwargs)
    dense, dense_loss = _step_seconds(blk, planned, inputs, target, False, a.steps)
    fact, fact_loss = _step_seconds(blk, planned, inputs, target, True, a.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"block hidden {a.hidden}, intermediate {a.intermediate}, batch {a.rows} x {a.tokens}, ranks at "
          f"{a.share:g} of break-even, {torch.get_num_threads()} threads")
    print(f"training step, product A B as the weight: {dense:.3f} s (loss {dense_loss:.6g})")
    print(f"training step, factored (x B^T) A^T:      {fact:.3f} s (loss {fact_loss:.6g})")
    print(f"ratio {dense / fact:.2f}x; loss relative difference {abs(fact_loss - dense_loss) / dense_loss:.2e}; "
          f"peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
