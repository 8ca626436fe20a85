"""Rank or bits on text the tool never read (issue 54): the byte plans of ``--budget-bytes`` (joint, bits only, rank
only) against uniform int4 round-to-nearest and uniform whitened truncation, at uniform int4's size and at the size
of 20% of the parameters removed, judged by the perplexity increase on unseen text.

    python sample_models/train_llama.py --shape wide --out /tmp/wide    # the held-back Llama (~13 min)
    PYTHONPATH=. python benchmarks/rank_or_bits.py /tmp/wide [--dtype bfloat16] [--threads 2]

The calibration and the unseen windows are ``benchmarks/quality.py``'s (the held-out standard-library files the
model never trained on; the audit splits the calibration into fit, search and verification rows). The passes run
as the audit runs them (tier 1, the references, the scope, the gradient pass), then each family's plan is chosen
by the knapsack on the same costs the audit uses (the joint plan's recalibrated by the bits-only and rank-only plans
measured on the verification rows, as the audit does) and written into the model (dequantized codes plus corrections,
factor products) to measure it on the unseen windows. Printed per size: each plan's bytes, bits per weight of the
rewritten layers, its unseen perplexity increase and its ratio to uniform int4's, and the layers' choices.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from quality import perplexity, texts, unseen_windows  # noqa: E402

from auditor import AuditOptions, pipeline  # noqa: E402
from auditor.calibration.stage import through_sensitivity  # noqa: E402
from auditor.calibration.tiers import bits  # noqa: E402
from auditor.quantize.knapsack import choose  # noqa: E402


def unseen_increase(model, c: bits.Costed, recipes: dict[str, bits.Recipe], unseen, dense: float) -> float:
    named = {k: c.layers[k].layer for k in recipes}
    weights = {k: c.layers[k].weight(r) for k, r in recipes.items() if r.label != "keep"}
    with bits.swapped(model, weights, named):
        return perplexity(model, unseen) / dense - 1


def row(label: str, c: bits.Costed, plan, recipes, model, unseen, dense, ref: float | None) -> float:
    if plan is None:
        print(f"  {label:<20} cannot reach this size")
        return float("nan")
    nbytes = c.rest_bytes + sum(ch.nbytes for ch in plan.values())
    weights = sum(lb.weight_ref.numel() for lb in c.layers.values())
    inc = unseen_increase(model, c, recipes, unseen, dense)
    counts: dict[str, int] = {}
    for r in recipes.values():
        key = (("rank int8" if r.int8_factors else "rank") if r.label.startswith("rank") else r.label)
        counts[key] = counts.get(key, 0) + 1
    ratio = f"{inc / ref:.2f}x uniform int4" if ref else ""
    print(f"  {label:<20} {nbytes:>10,} B  {8 * (nbytes - c.rest_bytes) / weights:5.2f} bits/weight  "
          f"{100 * inc:+8.3f}%  {ratio:<18} {dict(sorted(counts.items()))}", flush=True)
    return inc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--costs", choices=["isotropic", "output"], default="output",
                    help="judge the options with G itself (the default, the audit's) or its mean diagonal")
    args = ap.parse_args()
    bits.ISOTROPIC_COSTS = args.costs == "isotropic"
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.model)).eval().to(getattr(torch, args.dtype))
    calib, rest, _ = texts()
    unseen = unseen_windows(args.model, rest, model.config.max_position_embeddings)
    dense = perplexity(model, unseen)
    with tempfile.TemporaryDirectory() as tmp:
        for name, t in calib:
            (Path(tmp) / name).write_text(t, encoding="utf-8")
        t0 = time.perf_counter()
        options = AuditOptions(calibration=tmp, tokenizer=str(args.model), cache=False, progress=False)
        plain = pipeline.audit(model, options=AuditOptions(progress=False, cache=False))
        ctx, refs, scope, sens = through_sensitivity(model, plain.layers, plain.settings, options)
        c = bits.costed(ctx, scope.planned, sens.loss_metric)
        print(f"{args.model} in {args.dtype}: dense unseen perplexity {dense:.3f} on {len(unseen)} windows; "
              f"{len(c.layers)} layers costed ({c.weighted}) in {time.perf_counter() - t0:.0f} s", flush=True)
        int4 = c.uniform("int4 g128 sym")
        params = sum(p.numel() for p in model.parameters())
        item = next(model.parameters()).element_size()
        sizes = [("uniform int4's size", c.rest_bytes + sum(ch.nbytes for ch in int4.values())),
                 ("20% of the parameters removed", c.dense_bytes - round(0.2 * params) * item)]
        for words, size in sizes:
            print(f"at {size:,} bytes ({words}):", flush=True)
            ref = row("uniform int4", c, int4, {k: bits.Recipe(ch.label) for k, ch in int4.items()}, model,
                      unseen, dense, None)
            picked = {fam: choose(c.family(fam), size - c.rest_bytes) for fam in ("bits", "rank")}
            # as the audit chooses the joint plan: its factorizations' costs recalibrated by what the two
            # single-family plans measured on the verification rows
            rho = bits.ratio(*(bits._measure(ctx, refs, c, fam, size, picked[fam]) for fam in ("rank", "bits")))
            picked["joint"] = choose(c.recalibrated(rho), size - c.rest_bytes)
            print(f"  (the joint plan's factorization costs scaled by {rho:.2f})")
            for fam in ("joint", "bits", "rank"):
                plan = picked[fam]
                recipes = {k: c.layers[k].recipes[ch.label] for k, ch in plan.items()} if plan else {}
                row(fam, c, plan, recipes, model, unseen, dense, ref)
            svd = bits._uniform_truncation(c, size)
            row("uniform truncation", c, *(svd or (None, None)), model, unseen, dense, ref)


if __name__ == "__main__":
    main()
