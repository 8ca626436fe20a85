"""What a recovery fine-tune buys on the sample char transformer and the sample Llama: plans at about 30%, 50% and
70% of the parameters removed, the held-out metric before recovery and after 50, 200 and 500 distillation steps, and
seconds per step.

    python benchmarks/recovery.py                    # steps 50, 200, 500 (one run of 500 steps per plan, measured
                                                     # at each checkpoint), lr 1e-4, factors only, 8 windows a step
    python benchmarks/recovery.py --steps 50,200 --lr 3e-4 --trainable all --budgets 0.5
    python benchmarks/recovery.py --model llama      # the sample Llama, judged by held-out perplexity

Plans: the Lagrangian allocation (``auditor.calibration.tiers.budget.allocate``) over the tier-1 whitened error curves at
the target removal, without the back-off of ``plan_for_budget`` (the point is to see plans past the tolerance);
whitened initialisation. Calibration: ``chargpt_calib.safetensors`` (64 windows of 128 characters: the fit rows the
recovery trains on, 8 a step by default) and ``chargpt_holdout.safetensors`` (256 windows from held-out files: only measured on). The
metric is the audit's: relative logit error against the dense model, with top-1 agreement, and the held-out KL.
``--model llama``: ``sample_models/llama`` (Hugging Face directory, float32 in memory) with its ``calib.txt`` (the fit
windows of 256 tokens) and ``holdout.txt``, tokenized as the audit does; the metric is the audit's default for a
causal LM, the held-out perplexity's relative increase (the table also gives the perplexity itself and the held-out
next-token KL, the distillation loss).
Each checkpoint is the state after that many steps of one run whose learning-rate schedule spans the longest run
(``recover(..., eval_every=...)``), not separate shorter runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sample_models"))

from auditor.calibration import load_calibration  # noqa: E402
from auditor.calibration.tiers.budget import allocate, curves_from_spectra  # noqa: E402
from auditor.calibration.statistics.stats import by_name  # noqa: E402
from auditor.calibration.tiers.tier1 import tier1  # noqa: E402
from auditor.calibration.apply import factorize  # noqa: E402
from auditor.kinds.registry import SUPPORTED  # noqa: E402
from auditor.surgery import count_params  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from auditor.calibration.recovery import recover  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="50,200,500", help="checkpoints, comma-separated (the largest is the run)")
    ap.add_argument("--budgets", default="0.3,0.5,0.7", help="fractions of the parameters to remove")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--trainable", default="factors", choices=("factors", "all"))
    ap.add_argument("--objective", default="auto", choices=("auto", "kl", "mse"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="windows per step (and per measured batch)")
    ap.add_argument("--model", default="chargpt", choices=("chargpt", "llama"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoints = sorted({int(s) for s in args.steps.split(",")})
    budgets = [float(b) for b in args.budgets.split(",")]

    metric = None
    if args.model == "llama":
        import transformers

        from auditor.calibration.measure.metric import Metric

        here = ROOT / "sample_models" / "llama"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(here), dtype=torch.float32).eval()
        cal = load_calibration(str(here / "calib.txt"), model, str(here / "holdout.txt"), batch_size=args.batch,
                               tokenizer=here)
        metric = Metric(kind="perplexity")
        name = "sample Llama"
    else:
        from chargpt import CALIB, HOLDOUT, chargpt

        model, _ = chargpt()
        cal = load_calibration(str(CALIB), model, str(HOLDOUT), batch_size=args.batch)
        name = "char transformer"
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    layers = {k: v for k, v in layers.items() if v.kind in SUPPORTED}
    stats, spectra = tier1(model, layers, cal)
    curves = curves_from_spectra(spectra, layers)
    total = count_params(model)
    dense_ppl = None
    if metric is not None:
        from auditor.calibration.measure.metric import Evaluator

        dense_ppl = Evaluator(model, cal, metric).reference
    print(f"{name}: {total:,} parameters, {len(curves.options)} factorizable layers; fit {cal.fit_rows} "
          f"windows, held out {cal.holdout_rows}, {args.batch} windows a step; lr {args.lr:g}, {args.trainable}, objective {args.objective}, torch threads {args.threads}"
          + (f"; dense held-out perplexity {dense_ppl:.3f}" if dense_ppl is not None else ""))
    rows = []
    for budget in budgets:
        plan, saved, _ = allocate(curves, budget * total)
        new = factorize(model, plan, stats)
        removed = 1 - count_params(new) / total
        t0 = time.perf_counter()
        rec = recover(new, model, cal, steps=checkpoints[-1], lr=args.lr, trainable=args.trainable,
                      objective=args.objective, eval_at=checkpoints, metric=metric)
        wall = time.perf_counter() - t0
        at = {p.step: p for p in rec.points}
        rows.append((removed, len(plan), rec, at, wall))
        line = " | ".join(f"{s}: {at[s].metric:.4f}" for s in [0] + checkpoints if s in at)
        print(f"  {100 * removed:.1f}% removed ({len(plan)} layers): {line}; {rec.seconds_per_step:.3f} s/step, "
              f"{wall:.0f} s with measurements{'; ' + rec.stopped if rec.stopped else ''}", flush=True)
    head = ["removed", "layers", "before"] + [f"after {s}" for s in checkpoints] + ["s/step"]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for removed, n, rec, at, _ in rows:
        def cell(s: int) -> str:
            p = at.get(s)
            if p is None:
                return "-"
            top = f", top-1 {100 * p.top1:.1f}%" if p.top1 is not None else ""
            if dense_ppl is not None:  # the relative increase, the perplexity, the held-out KL
                return f"+{100 * p.metric:.2f}% (ppl {dense_ppl * (1 + p.metric):.2f}, KL {p.loss:.4f})"
            return f"{p.metric:.4f} (KL {p.loss:.4f}{top})"

        print(f"| {100 * removed:.1f}% | {n} | {cell(0)} | " + " | ".join(cell(s) for s in checkpoints)
              + f" | {rec.seconds_per_step:.3f} |")


if __name__ == "__main__":
    main()
