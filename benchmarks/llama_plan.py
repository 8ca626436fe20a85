"""The audit's suggested plan against SVD-LLM-style uniform whitened truncation, on the sample Llama, at the same
held-out perplexity.

    python benchmarks/llama_plan.py                 # sample_models/llama, its calib.txt and holdout.txt
    python benchmarks/llama_plan.py --model DIR     # another Hugging Face directory with the same two texts

1. The tool: ``auditor.audit_source(DIR, calibration=calib.txt, holdout=holdout.txt)`` (the CLI's defaults: tier 1,
   held-out perplexity, tolerance 0.01 = +1%). Its plan is the suggested ranks it reviewed; it reports the plan's
   measured perplexity (the plan check).
2. Measured here, independently of the tool's code: every window of the two texts tokenized with the directory's
   tokenizer (no special tokens, windows of the model's positions, the tail left out: what the tool does), the
   input Gram G = X^T X of every Linear over the calibration windows (float64), and each planned weight W replaced by
   its whitened truncation: S = cholesky(G + 1e-6 mean(diag G) I), U S V^T = svd(W S), W_r = U_r S_r V_r^T S^-1 (the
   rank-r weight with the least layer-output error on the calibration rows; SVD-LLM's truncation-aware whitening).
   Perplexity: exp of the mean next-token cross-entropy over every held-out position.
3. The baseline: the same fraction f of its rank kept in every layer of a set (r = max(1, round(f min(m, n))); a layer
   whose r would not save parameters, r (m + n) >= m n, is left dense), f found by bisection so that the held-out
   perplexity equals the tool's plan's (measured in step 2). Two sets: the decoder blocks' Linears (q, k, v, o, gate,
   up, down: SVD-LLM's), and those plus the output head (every factorizable Linear).
Prints parameters removed by each and the ratio (the goal of issue 22: the tool's plan removes >= 1.3x the baseline's).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import auditor  # noqa: E402


def windows(tokenizer, path: Path, length: int) -> torch.Tensor:
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    n = len(ids) // length
    return torch.tensor(ids[:n * length], dtype=torch.long).view(n, length)


@torch.no_grad()
def perplexity(model: nn.Module, seqs: torch.Tensor, batch: int = 16) -> float:
    nll, count = 0.0, 0
    for chunk in seqs.split(batch):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        nll += float(nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def grams(model: nn.Module, names: list[str], seqs: torch.Tensor, batch: int = 16) -> dict[str, torch.Tensor]:
    mods = dict(model.named_modules())
    out = {n: torch.zeros(mods[n].in_features, mods[n].in_features, dtype=torch.float64) for n in names}
    def hook(n: str):
        def add(_m: nn.Module, args: tuple) -> None:  # returns None: the inputs pass unchanged
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            out[n].add_(x.T @ x)
        return add

    hooks = [mods[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        for chunk in seqs.split(batch):
            model(input_ids=chunk)
    finally:
        for h in hooks:
            h.remove()
    return out


class Truncator:
    """Whitened truncation of a fixed set of weights to any rank, from one SVD per weight."""

    def __init__(self, model: nn.Module, names: list[str], g: dict[str, torch.Tensor]) -> None:
        self.model = model
        mods = dict(model.named_modules())
        self.mods = {n: mods[n] for n in names}
        self.dense = {n: m.weight.detach().clone() for n, m in self.mods.items()}
        self.svd = {}
        for n, m in self.mods.items():
            gn = g[n]
            s = torch.linalg.cholesky(gn + 1e-6 * gn.diagonal().mean() * torch.eye(gn.shape[0], dtype=gn.dtype))
            u, sig, vh = torch.linalg.svd(self.dense[n].double() @ s, full_matrices=False)
            self.svd[n] = (u, sig, torch.linalg.solve_triangular(s, vh, upper=False, left=False))  # V^T S^-1

    def apply(self, ranks: dict[str, int]) -> int:
        """Set every weight to its whitened truncation at ``ranks`` (dense where absent); parameters removed."""
        removed = 0
        with torch.no_grad():
            for n, m in self.mods.items():
                r = ranks.get(n)
                if r is None:
                    m.weight.copy_(self.dense[n])
                    continue
                u, sig, b = self.svd[n]
                m.weight.copy_(((u[:, :r] * sig[:r]) @ b[:r]).to(m.weight.dtype))
                rows, cols = m.weight.shape
                removed += rows * cols - r * (rows + cols)
        return removed


def uniform(mods: dict[str, nn.Module], names: list[str], f: float) -> dict[str, int]:
    ranks = {}
    for n in names:
        rows, cols = mods[n].weight.shape
        r = max(1, round(f * min(rows, cols)))
        if r * (rows + cols) < rows * cols:
            ranks[n] = r
    return ranks


def scan(trunc: Truncator, names: list[str], held: torch.Tensor, target: float, ref: tuple[float, int, int]) -> None:
    """The bisection assumes the perplexity falls as the kept fraction rises; it need not where a layer drops out of
    the set (its rank no longer saves parameters) as f rises. So also: every f in 0.01 steps, the largest removal
    whose perplexity holds the tool's (the rank sets tried by removal, largest first, up to the first that holds)."""
    dense, total, removed_tool = ref
    sets: dict[tuple, float] = {}
    for i in range(1, 100):
        sets.setdefault(tuple(sorted(uniform(trunc.mods, names, i / 100).items())), i / 100)
    tried = 0
    for ranks, f in sorted(sets.items(), key=lambda kv: -trunc.apply(dict(kv[0]))):
        removed = trunc.apply(dict(ranks))
        ppl = perplexity(model=trunc.model, seqs=held)
        tried += 1
        if ppl <= target:
            print(f"  scan (f in 0.01 steps, {tried} rank sets measured): the largest removal that holds keeps {f:.2f} "
                  f"of each rank ({len(ranks)} layers), perplexity {ppl:.4f} ({ppl / dense - 1:+.2%}), removing "
                  f"{removed:,} ({removed / total:.2%}); tool / baseline = {removed_tool / max(removed, 1):.2f}x")
            return
    print(f"  scan: no uniform fraction holds the tool's perplexity ({tried} rank sets)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "sample_models" / "llama")
    ap.add_argument("--steps", type=int, default=12, help="bisection steps over the uniform fraction")
    ap.add_argument("--measure-floor", action="store_true",
                    help="the audit with --measure-floor: its plan from tier-2 curves (measured per layer)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine shared with other jobs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaForCausalLM

    calib, holdout = args.model / "calib.txt", args.model / "holdout.txt"
    t = time.perf_counter()
    audit = auditor.audit_source(str(args.model), options=auditor.AuditOptions(
        calibration=str(calib), holdout=str(holdout), cache=False, progress=False, measure_floor=args.measure_floor))
    cal = audit.calibration
    plan = {i.layer: i.rank for i in audit.review.items}
    check = cal.plan_check
    print(f"tool: {audit.model_name}, {audit.total_params:,} parameters; {cal.fit_rows} calibration rows, "
          f"{cal.holdout_rows} held out; metric {cal.metric}, tolerance {cal.tolerance:g}; dense "
          f"{cal.reference:.4f}; audit {time.perf_counter() - t:.0f} s"
          + ("; tier 2 (--measure-floor)" if args.measure_floor else ""))
    print(f"  suggested plan: {len(plan)} layers; the tool measured {check.measured:.4f} "
          f"({'holds' if check.ok else 'MISSES'}), removing {check.removed:,} parameters")
    for layer, rank in sorted(plan.items()):
        print(f"    {layer}: {rank}")

    tok = AutoTokenizer.from_pretrained(str(args.model))
    model = LlamaForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    length = model.config.max_position_embeddings
    fit, held = windows(tok, calib, length), windows(tok, holdout, length)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    blocks = [n for n in linears if ".layers." in n]
    missing = set(plan) - set(linears)
    if missing:
        raise SystemExit(f"the tool planned layers that are not Linears here: {sorted(missing)}")
    t = time.perf_counter()
    trunc = Truncator(model, linears, grams(model, linears, fit))
    dense = perplexity(model, held)
    total = sum(p.numel() for p in model.parameters())
    removed_tool = trunc.apply(plan)
    target = perplexity(model, held)
    print(f"measured here: {len(fit)} + {len(held)} windows of {length} tokens; dense perplexity {dense:.4f}; the "
          f"tool's plan {target:.4f} ({target / dense - 1:+.2%}), removing {removed_tool:,} "
          f"({removed_tool / total:.2%} of {total:,}); Grams and SVDs {time.perf_counter() - t:.0f} s")

    for label, names in (("decoder blocks (SVD-LLM's set)", blocks), ("every Linear (+ output head)", linears)):
        lo, hi = 0.0, 1.0  # perplexity falls as f rises: lo misses (or is 0), hi holds
        for _ in range(args.steps):
            mid = (lo + hi) / 2
            trunc.apply(uniform(trunc.mods, names, mid))
            if perplexity(model, held) <= target:
                hi = mid
            else:
                lo = mid
        ranks = uniform(trunc.mods, names, hi)
        removed = trunc.apply(ranks)
        ppl = perplexity(model, held)
        ratio = removed_tool / removed if removed > 0 else math.inf
        print(f"uniform whitened truncation, {label}: keep {hi:.4f} of each rank ({len(ranks)} layers "
              f"factorized), perplexity {ppl:.4f} ({ppl / dense - 1:+.2%}), removing {removed:,} ({removed / total:.2%})"
              f"; tool / baseline = {ratio:.2f}x (goal >= 1.3x)")
        scan(trunc, names, held, target, (dense, total, removed_tool))
    trunc.apply({})


if __name__ == "__main__":
    main()
