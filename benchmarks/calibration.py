"""Calibration tiers side by side in one run, on sample models with real trained weights and real inputs.

    python benchmarks/calibration.py                      # digits MLP and CNN, and the char transformer if shipped
    python benchmarks/calibration.py --bert               # ... and the 26M BERT-style masked LM (cost only, ~15 min)
    python benchmarks/calibration.py --only bert          # one case: digits-mlp, digits-cnn, chargpt or bert
    python benchmarks/calibration.py --chargpt DIR        # the char transformer from another sample_models/ folder
    python benchmarks/calibration.py --tolerance 0.02     # the quality every plan is held to (relative output error)

Per model:
- cost: tier 1 (one forward pass with input-statistics hooks, then the whitened spectra) against one plain forward
  pass over the same calibration rows plus the weight-only audit (goal: under 2x); tier 2 (bisection from the tier-1
  rank, prefix replayed from a cache) against the brute-force sweep over the same grid, with evaluations counted;
- parameters removed by each plan and its metric measured all at once on the held-out rows (before any recovery
  fine-tune): the weight-energy plan at the same quality (the audit's own suggestion rules, ``auditor.suggest``,
  at the lowest energy threshold of a grid whose whole plan holds the tolerance; plain SVD init), the audit's default
  95%-energy plan (shown, marked: it may miss the tolerance), tier 1 (suggested ranks), tier 2 (measured floors,
  applied together) and tier 3 (Lagrangian over the measured curves, checked and backed off), each with its ratio to
  the same-quality weight-energy plan.
A plan that misses the tolerance is marked "NO": its removal is not at the same quality.

The 26M BERT-style masked LM (``--bert``, opt-in because its tier-2 sweep alone takes longer than every other case
together on a 2-core machine) is ``transformers.BertForMaskedLM`` from a config built here (hidden 512, 8 layers, 8
heads, intermediate 2048, the char transformer's vocabulary plus 5 BERT specials, 512 positions), random-init (no
model hub): it measures COST only (tier-1 ratio, tier-2 seconds and evaluations, per layer), never quality. Its
calibration is real text: windows of the standard library's sources encoded with ``sample_models/chargpt.py``'s
``encode`` ([CLS] + 126 characters + [SEP], 15% of the characters replaced by [MASK]), 64 windows to fit and 32 from
held-out files to measure.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import replace
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
from auditor.calibration.data.inputs import run  # noqa: E402
from auditor.calibration.statistics.stats import by_name  # noqa: E402
from auditor.calibration.tiers.sweep import Sweeper  # noqa: E402
from auditor.calibration.statistics.whiten import whitened_spectra  # noqa: E402
from auditor.calibration.apply import factorize  # noqa: E402
from auditor.kinds.registry import SUPPORTED  # noqa: E402
from auditor.surgery import count_params  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from auditor.planning.suggest import suggest  # noqa: E402

ENERGY_GRID = (0.90, 0.95, 0.955, 0.96, 0.965, 0.97, 0.98, 0.99, 0.995, 0.999, 0.9999)
CASES = ("digits-mlp", "digits-cnn", "chargpt", "bert")


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses in the module look themselves up there
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(mod)
    return mod


def cases(chargpt_dir: Path | None, only: set[str]):
    """(case key, display name, model, calibration) for each case in ``only``."""
    if only & {"digits-mlp", "digits-cnn"}:
        digits = _import(ROOT / "sample_models" / "digits.py", "_bench_digits")
        from sklearn.datasets import load_digits

        x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
        if "digits-mlp" in only:
            mlp = digits.mlp()[0]
            yield "digits-mlp", "digits MLP", mlp, load_calibration({"x": x}, mlp, holdout=0.25, batch_size=256)
        if "digits-cnn" in only:
            cnn = digits.cnn()[0]
            yield "digits-cnn", "digits CNN", cnn, load_calibration({"x": x.reshape(-1, 1, 8, 8)}, cnn, holdout=0.25,
                                                                    batch_size=256)
    folder = chargpt_dir or ROOT / "sample_models"
    if "chargpt" in only:
        if (folder / "chargpt.py").is_file() and (folder / "chargpt.safetensors").is_file():
            cg = _import(folder / "chargpt.py", "_bench_chargpt")
            model = cg.model()
            cal = load_calibration(folder / "chargpt_calib.safetensors", model,
                                   holdout=folder / "chargpt_holdout.safetensors", batch_size=32)
            yield "chargpt", "char transformer", model, cal
        else:
            print(f"(no char transformer: {folder / 'chargpt.py'} not found)\n")
    if "bert" in only:
        model, cal = bert_case()
        yield "bert", "BERT-style masked LM (random init)", model, cal


BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids after the char vocabulary, in this order


def bert_case(fit: int = 64, held: int = 32, length: int = 128, mask_share: float = 0.15):
    """A 26M BERT-style masked LM (random init, config built here) and real-text calibration for it: windows of the
    standard library's sources encoded with chargpt's ``encode`` ([CLS] + characters + [SEP], ``mask_share`` of the
    characters replaced by [MASK]); ``fit`` windows from the training files, ``held`` from the held-out files."""
    from transformers import BertConfig, BertForMaskedLM

    train_cg = _import(ROOT / "sample_models" / "train_chargpt.py", "_bench_train_chargpt")
    vocab = len(sys.modules["chargpt"].VOCAB)  # train_chargpt imported chargpt beside it
    pad, _, cls, sep, mask = (vocab + i for i in range(len(BERT_SPECIALS)))
    cfg = BertConfig(vocab_size=vocab + len(BERT_SPECIALS), hidden_size=512, num_hidden_layers=8,
                     num_attention_heads=8, intermediate_size=2048, max_position_embeddings=512, pad_token_id=pad)
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).eval()
    train_ids, held_ids, _ = train_cg.corpus()
    gen = torch.Generator().manual_seed(0)

    def framed(ids: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        body = train_cg.windows(ids, n, length - 2).long()
        body = torch.where(torch.rand(body.shape, generator=gen) < mask_share, torch.full_like(body, mask), body)
        col = torch.ones(n, 1, dtype=torch.long)
        input_ids = torch.cat([col * cls, body, col * sep], dim=1)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    fit_b, held_b = framed(train_ids, fit), framed(held_ids, held)
    for b in (fit_b, held_b):  # every id must index the embedding
        lo, hi = int(b["input_ids"].min()), int(b["input_ids"].max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise SystemExit(f"BERT calibration ids span {lo}..{hi}, outside the vocabulary 0..{cfg.vocab_size - 1}")
    return model, load_calibration(fit_b, model, holdout=held_b, batch_size=32)


def weight_only_audit(model: torch.nn.Module):
    with tempfile.TemporaryDirectory() as d:
        return auditor.audit(model, cache=False, cache_dir=Path(d), progress=False)


def energy_plan(audit, threshold: float, align: int, allowed: set[str]) -> dict[str, int]:
    """The weight-energy plan at ``threshold``: the audit's own suggestion rules (``auditor.suggest.suggest``:
    smallest rank keeping the energy, aligned up, kept dense at/above break-even or the useful maximum, or when it
    compresses too little) with ``target_energy`` set to ``threshold``."""
    settings = replace(audit.settings, target_energy=threshold, align=align)
    plan = {}
    for layer in audit.layers:
        s = suggest(layer, audit.spectra.get(layer.name), settings)
        if s.rank is not None and layer.name in allowed:
            plan[layer.name] = s.rank
    return plan


def tier1_cost(model, layers, table, cal, align: int, tolerance: float, repeat: int = 3):
    """(statistics, spectra, printed line): tier 1 timed against one forward pass plus the weight-only audit."""
    t_fwd = best(lambda: [run(model, b) for b in cal.fit], repeat=repeat)
    t_audit = best(lambda: weight_only_audit(model), repeat=min(repeat, 2))
    t_stats = best(lambda: input_statistics(model, layers, cal), repeat=repeat)
    stats = input_statistics(model, layers, cal)

    weights = {layer.param: table.tensor(layer.param) for layer in layers.values()}

    def spectra_all():  # what the calibrate stage runs: one thread per core, one BLAS thread each
        return whitened_spectra(layers, weights, stats, align, tolerance)

    t_spec = best(spectra_all, repeat=repeat)
    spectra = spectra_all()
    cost = t_stats + t_spec
    line = (f"  tier 1 {cost:.3f} s (statistics {t_stats:.3f} + whitened spectra {t_spec:.3f})  vs  "
            f"forward {t_fwd:.3f} + weight-only audit {t_audit:.3f} = {t_fwd + t_audit:.3f} s  ->  "
            f"{cost / (t_fwd + t_audit):.2f}x (goal < 2x)")
    return stats, spectra, line


def header(name: str, model, layers, cal, tolerance: float) -> None:
    kinds: dict[str, int] = {}
    for l in layers.values():
        kinds[str(l.kind)] = kinds.get(str(l.kind), 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    print(f"== {name}: {count_params(model):,} parameters, {len(layers)} factorizable weights ({what}), "
          f"{cal.fit_rows} calibration rows, {cal.holdout_rows} held out; tolerance {tolerance:g} relative output error")
    for w in cal.warnings:
        print(f"  warning: {w}")


def bench(name: str, model: torch.nn.Module, cal, tolerance: float, align: int, brute: bool) -> None:
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    table = ParamTable.of(model)
    total = count_params(model)
    header(name, model, layers, cal, tolerance)
    stats, spectra, line = tier1_cost(model, layers, table, cal, align, tolerance)
    print(line)

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
    t3 = plan_for_budget(model, layers, cal, curves_from_floors(floors, layers, spectra), tolerance=tolerance,
                         stats=stats)
    t_plan = time.perf_counter() - t
    print(f"  tier 3 {t_plan:.2f} s, {len(t3.tries)} plans measured all at once")

    ev = Evaluator(model, cal, Metric(tolerance=tolerance))
    ok_kinds = {k for k, l in layers.items() if l.kind in SUPPORTED and not l.aliases}
    audit = weight_only_audit(model)

    def measure(plan, init):
        new = factorize(model, plan, init) if plan else model
        return total - count_params(new), ev.measure(new)

    # the weight-energy plan at the same quality: the lowest threshold of the grid whose whole plan holds
    grid = []
    for thr in ENERGY_GRID:
        plan = energy_plan(audit, thr, align, ok_kinds)
        removed, m = measure(plan, None)
        grid.append((thr, plan, removed, m))
    print("  weight-energy grid (all at once, SVD init): " + ", ".join(
        f"{thr:g} -> {100 * removed / total:.1f}% at {m.value:.4f}{'' if m.ok else ' NO'}"
        for thr, _, removed, m in grid))
    same = next(((thr, plan) for thr, plan, _, m in grid if m.ok), None)

    plans = {}
    if same is not None:
        plans[f"weight energy {100 * same[0]:g}% (same quality)"] = (same[1], None)
    plans["weight energy 95% (audit default)"] = (energy_plan(audit, 0.95, align, ok_kinds), None)
    plans.update({
        "tier 1 (whitened, 1-pass)": ({k: s.suggested for k, s in spectra.items()
                                       if s.suggested is not None and k in ok_kinds}, stats),
        "tier 2 floors, all at once": ({k: f.floor for k, f in floors.floors.items()
                                        if f.floor is not None and k in ok_kinds}, stats),
        "tier 3 budgeted plan": (t3.plan, stats),
    })
    base = None
    print(f"  {'plan':<36} {'layers':>6} {'removed':>10} {'share':>7} {'metric':>9} {'top-1':>7}  holds  x energy")
    for label, (plan, init) in plans.items():
        removed, m = measure(plan, init)
        if base is None:
            base = removed if same is not None else 0
        ratio = f"{removed / base:.1f}x" if base and m.ok else "-"  # a plan that misses is not at the same quality
        top1 = f"{100 * m.top1:.1f}%" if m.top1 is not None else "-"
        print(f"  {label:<36} {len(plan):>6} {removed:>10,} {100 * removed / total:>6.1f}% {m.value:>9.4f} {top1:>7}"
              f"  {'yes' if m.ok else 'NO ':<5}  {ratio}")
    if not base:
        print("  (x energy: the same-quality weight-energy plan removes nothing, so no ratio is defined)")
    print("  frontier (all at once): " + ", ".join(
        f"{100 * p.removed_fraction:.1f}% -> {p.metric:.4f}{'' if p.ok else ' (fails)'}" for p in t3.frontier))
    print()


def bench_cost(name: str, model: torch.nn.Module, cal, tolerance: float, align: int, goal_s: float = 300.0) -> None:
    """Cost only (random-init weights: floors and removals would mean nothing): tier 1 against one forward pass plus
    the weight-only audit, and tier 2 timed layer by layer (``Sweeper``, the unit ``measure_floors`` loops over)."""
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    table = ParamTable.of(model)
    header(name, model, layers, cal, tolerance)
    print("  random-init weights: this case measures COST only (tier-1 ratio, tier-2 seconds and evaluations); "
          "its floors and removals say nothing about quality, so no quality table")
    stats, spectra, line = tier1_cost(model, layers, table, cal, align, tolerance, repeat=2)
    print(line)

    t_held = best(lambda: [run(model, b) for b in cal.measure], repeat=2)
    t0 = time.perf_counter()
    sweeper = Sweeper(model, layers, cal, tolerance=tolerance, align=align, stats=stats, spectra=spectra)
    t_setup = time.perf_counter() - t0
    rows = []
    for lname in sweeper.layers:
        n0, t = sweeper.evaluations, time.perf_counter()
        f = sweeper.floor(lname)
        rows.append((lname, f, sweeper.evaluations - n0, time.perf_counter() - t, replayed(sweeper, lname)))
    total_s = time.perf_counter() - t0
    evals = sum(r[2] for r in rows)
    print(f"  tier 2 bisection {total_s:.1f} s ({total_s / 60:.1f} min, goal < {goal_s / 60:.0f} min: "
          f"{'meets' if total_s < goal_s else 'MISSES'}), {evals} evaluations over {len(rows)} layers; "
          f"setup (copy, dense reference, prefix recording) {t_setup:.1f} s")
    print(f"  one plain forward over the held-out rows {t_held:.2f} s; {evals} of them would take {evals * t_held:.0f} s")
    groups: dict[str, list] = {}
    for lname, f, n, s, rep in rows:
        parts = lname.split(".")
        key = ".".join(parts[:4]) if "layer" in parts else lname
        groups.setdefault(key, []).append((f, n, s, rep))
    print(f"  {'block':<40} {'layers':>6} {'evals':>6} {'seconds':>8} {'s/eval':>7} {'vs forward':>10}  "
          f"{'prefix replayed':<16} keep dense")
    for key, items in groups.items():
        n = sum(i[1] for i in items)
        s = sum(i[2] for i in items)
        dense = sum(1 for f, *_ in items if f.keep_dense)
        per = s / n if n else 0.0
        print(f"  {key:<40} {len(items):>6} {n:>6} {s:>8.1f} {per:>7.2f} {per / t_held:>9.2f}x  {items[0][3]:<16} {dense}")
    print("  (s/eval against the plain forward timed before the sweep: read it with the load average, which moves)")
    print()


def replayed(sweeper: Sweeper, layer: str) -> str:
    """How much of the prefix the cache replays for ``layer``: modules replayed of the candidates (first batch)."""
    if sweeper.cache is None:
        return "no cache"
    counts = sweeper.cache.replay(layer).replayed
    hit = sum(1 for v in counts[0].values() if v) if counts else 0
    return f"{hit} of {len(sweeper.cache.candidates[layer])} modules"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chargpt", type=Path, help="a sample_models/ folder holding chargpt.py and its files")
    ap.add_argument("--bert", action="store_true", help="also the 26M BERT-style masked LM (cost only; long)")
    ap.add_argument("--only", action="append", choices=CASES, help="run only this case (repeatable)")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--align", type=int, default=8)
    ap.add_argument("--no-brute", action="store_true", help="skip the brute-force sweep")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows when redirected to a file
    only = set(args.only) if args.only else {c for c in CASES if c != "bert" or args.bert}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    for key, name, model, cal in cases(args.chargpt, only):
        if key == "bert":
            bench_cost(name, model, cal, args.tolerance, args.align)
        else:
            bench(name, model, cal, args.tolerance, args.align, brute=not args.no_brute and key != "chargpt")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
