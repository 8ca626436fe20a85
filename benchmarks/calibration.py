"""Calibration tiers side by side in one run, on sample models with real trained weights and real inputs.

    python benchmarks/calibration.py                      # digits MLP and CNN, and the char transformer if shipped
    python benchmarks/calibration.py --chargpt DIR        # the char transformer from another sample_models/ folder
    python benchmarks/calibration.py --tolerance 0.02     # the quality every plan is held to (relative output error)

Per model:
- cost: tier 1 (one forward pass with input-statistics hooks, then the whitened spectra) against one plain forward
  pass over the same calibration rows plus the weight-only audit (goal: under 2x); tier 2 (bisection from the tier-1
  rank, prefix replayed from a cache) against the brute-force sweep over the same grid, with evaluations counted;
- parameters removed by each plan and its metric measured all at once on the held-out rows: the weight-energy plan
  (the audit's 95%-energy ranks, plain SVD init), tier 1 (suggested ranks), tier 2 (measured floors, applied
  together) and tier 3 (Lagrangian over the measured curves, checked and backed off), with ratios to weight energy.
A plan that misses the tolerance is marked "NO": its removal is not at the same quality.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best  # noqa: E402

import auditor  # noqa: E402
from auditor.calibration import (  # noqa: E402
    Evaluator, Metric, curves_from_floors, input_statistics, load_calibration, measure_floors, plan_for_budget,
)
from auditor.calibration.inputs import run  # noqa: E402
from auditor.calibration.stats import by_name  # noqa: E402
from auditor.calibration.whiten import whitened_spectrum  # noqa: E402
from auditor.factorize import SUPPORTED, count_params, factorize  # noqa: E402
from auditor.layers import ParamTable, collect_layers  # noqa: E402


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses in the module look themselves up there
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(mod)
    return mod


def cases(chargpt_dir: Path | None):
    digits = _import(ROOT / "sample_models" / "digits.py", "_bench_digits")
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    mlp = digits.mlp()[0]
    yield "digits MLP", mlp, load_calibration({"x": x}, mlp, holdout=0.25, batch_size=256)
    cnn = digits.cnn()[0]
    yield "digits CNN", cnn, load_calibration({"x": x.reshape(-1, 1, 8, 8)}, cnn, holdout=0.25, batch_size=256)
    folder = chargpt_dir or ROOT / "sample_models"
    if (folder / "chargpt.py").is_file() and (folder / "chargpt.safetensors").is_file():
        cg = _import(folder / "chargpt.py", "_bench_chargpt")
        model = cg.model()
        cal = load_calibration(folder / "chargpt_calib.safetensors", model,
                               holdout=folder / "chargpt_holdout.safetensors", batch_size=32)
        yield "char transformer", model, cal
    else:
        print(f"(no char transformer: {folder / 'chargpt.py'} not found)\n")


def weight_only_audit(model: torch.nn.Module):
    with tempfile.TemporaryDirectory() as d:
        return auditor.audit(model, cache=False, cache_dir=Path(d), progress=False)


def bench(name: str, model: torch.nn.Module, cal, tolerance: float, align: int, brute: bool) -> None:
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    table = ParamTable.of(model)
    total = count_params(model)
    print(f"== {name}: {total:,} parameters, {len(layers)} factorizable weights, "
          f"{cal.fit_rows} calibration rows, {cal.holdout_rows} held out; tolerance {tolerance:g} relative output error")
    for w in cal.warnings:
        print(f"  warning: {w}")

    t_fwd = best(lambda: [run(model, b) for b in cal.fit])
    t_audit = best(lambda: weight_only_audit(model), repeat=2)
    t_stats = best(lambda: input_statistics(model, layers, cal))
    stats = input_statistics(model, layers, cal)

    def spectra_all():
        return {k: whitened_spectrum(layers[k], table.tensor(layers[k].param), inp, align, tolerance)
                for k, inp in stats.layers.items()}

    t_spec = best(spectra_all)
    spectra = spectra_all()
    tier1_cost = t_stats + t_spec
    print(f"  tier 1 {tier1_cost:.3f} s (statistics {t_stats:.3f} + whitened spectra {t_spec:.3f})  vs  "
          f"forward {t_fwd:.3f} + weight-only audit {t_audit:.3f} = {t_fwd + t_audit:.3f} s  ->  "
          f"{tier1_cost / (t_fwd + t_audit):.2f}x")

    t = time.perf_counter()
    floors = measure_floors(model, layers, cal, tolerance, align=align, stats=stats, spectra=spectra)
    t_floor = time.perf_counter() - t
    line = f"  tier 2 bisection {t_floor:.2f} s, {floors.evaluations} evaluations"
    if brute:
        t = time.perf_counter()
        bf = measure_floors(model, layers, cal, tolerance, align=align, stats=stats, search="all", prefix_cache=False)
        t_bf = time.perf_counter() - t
        same = all(bf.floors[k].floor == f.floor for k, f in floors.floors.items())
        line += (f"  vs  brute force, full forward {t_bf:.2f} s, {bf.evaluations} evaluations  ->  "
                 f"{t_bf / t_floor:.1f}x faster, floors {'equal' if same else 'DIFFER'}")
    print(line)

    t = time.perf_counter()
    t3 = plan_for_budget(model, layers, cal, curves_from_floors(floors, layers), tolerance=tolerance, stats=stats)
    t_plan = time.perf_counter() - t
    print(f"  tier 3 {t_plan:.2f} s, {len(t3.tries)} plans measured all at once")

    ev = Evaluator(model, cal, Metric(tolerance=tolerance))
    ok_kinds = {k for k, l in layers.items() if l.kind in SUPPORTED and not l.aliases}
    audit = weight_only_audit(model)
    energy = {k: s.rank for k, s in audit.suggestions.items() if s.rank is not None and k in ok_kinds}
    plans = {
        "weight energy 95% (SVD init)": (energy, None),
        "tier 1 (whitened, 1-pass)": ({k: s.suggested for k, s in spectra.items()
                                       if s.suggested is not None and k in ok_kinds}, stats),
        "tier 2 floors, all at once": ({k: f.floor for k, f in floors.floors.items()
                                        if f.floor is not None and k in ok_kinds}, stats),
        "tier 3 budgeted plan": (t3.plan, stats),
    }
    base = None
    print(f"  {'plan':<30} {'layers':>6} {'removed':>9} {'share':>7} {'metric':>9} {'top-1':>7}  holds  x energy")
    for label, (plan, init) in plans.items():
        new = factorize(model, plan, init) if plan else model
        m = ev.measure(new)
        removed = total - count_params(new)
        if base is None:
            base = removed
        ratio = f"{removed / base:.1f}x" if base else "-"  # read it with the "holds" column
        top1 = f"{100 * m.top1:.1f}%" if m.top1 is not None else "-"
        print(f"  {label:<30} {len(plan):>6} {removed:>9,} {100 * removed / total:>6.1f}% {m.value:>9.4f} {top1:>7}"
              f"  {'yes' if m.ok else 'NO ':<5}  {ratio}")
    print("  frontier (all at once): " + ", ".join(
        f"{100 * p.removed_fraction:.1f}% -> {p.metric:.4f}{'' if p.ok else ' (fails)'}" for p in t3.frontier))
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chargpt", type=Path, help="a sample_models/ folder holding chargpt.py and its files")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--align", type=int, default=8)
    ap.add_argument("--no-brute", action="store_true", help="skip the brute-force sweep")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores\n")
    for name, model, cal in cases(args.chargpt):
        bench(name, model, cal, args.tolerance, args.align, brute=not args.no_brute and name != "char transformer")


if __name__ == "__main__":
    main()
