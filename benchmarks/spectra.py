"""Spectral engine speed, side by side in one run.

    python benchmarks/spectra.py            # weightwatcher column only where weightwatcher 0.7.7 is importable
    make bench                              # the same, in a benchmark-only venv that has weightwatcher

For each case it times, in interleaved rounds (best of 5 for a matrix, of 3 for the model): the engine (cache off),
a loop of torch.linalg.svdvals on the same matrices, the bare linear algebra the engine does (the same float64 Gram
products and eigensolves, one after another, nothing else), and for the model weightwatcher's analyze(). svdvals / bare LA is the ceiling for any engine that does this
exact float64 work on one matrix: only a model, whose layers can run side by side, can go past it. Then a first and
a cached re-audit, and the peak RSS.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import PeakSampler, best, best_interleaved, peak_rss_mb  # noqa: E402

import auditor  # noqa: E402
from auditor.structure.layers import matrix_view  # noqa: E402
from auditor.results import Kind, Layer  # noqa: E402
from auditor.spectra import (SpectraStats, SpectrumCache, ThreadExecutor, compute_spectra, eig_svdvals,  # noqa: E402
                              gram64, ref_for)


class Engine:
    """:func:`auditor.spectra.compute_spectra` over (layer, weight or loader) pairs, largest first, with a thread
    executor, the LAPACK backend and an optional cache; ``.stats`` adds up the runs' counts."""

    def __init__(self, cache_dir: Path | None = None, use_cache: bool = True, workers: int | None = None) -> None:
        self.cache = SpectrumCache(cache_dir) if use_cache else None
        self.executor = ThreadExecutor(workers)
        self.stats = SpectraStats()

    def run(self, items: list) -> dict:
        pairs = [(layer.name, ref_for(layer, src)) for layer, src in sorted(items, key=lambda it: -it[0].params)]
        out, stats = compute_spectra(pairs, targets=(0.90, 0.95, 0.99), executor=self.executor, cache=self.cache)
        for f in ("computed", "cached", "exact_fallbacks", "skipped"):
            setattr(self.stats, f, getattr(self.stats, f) + getattr(stats, f))
        return out

    def one(self, layer: Layer, w: torch.Tensor):
        return self.run([(layer, w)])[layer.name]


def layer_for(m: int, n: int) -> Layer:
    return Layer(name=f"{m}x{n}", param=f"{m}x{n}", kind=Kind.LINEAR, module_type="Linear", shape=(m, n), m=m, n=n)


def bare(mats: list[torch.Tensor]) -> None:
    for a in mats:  # the Gram product and the eigensolve the engine calls, one matrix after another, nothing else
        eig_svdvals(gram64(a))


def svdvals_loop(mats: list[torch.Tensor]) -> None:
    for a in mats:
        torch.linalg.svdvals(a)


def row(name: str, engine: float, svd: float, lin: float, ww: float | None = None) -> None:
    ww_s = f"{ww:8.2f}s  {ww / engine:6.1f}x" if ww is not None else "       -        -"
    print(f"{name:<28} {engine:8.3f}s {svd:8.3f}s {svd / engine:6.2f}x {lin:8.3f}s {engine / lin:6.2f}x  {ww_s}")


def bert_25m() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                                intermediate_size=1536, vocab_size=30522)).eval()


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"{'case':<28} {'engine':>9} {'svdvals':>9} {'speedup':>7} {'bare LA':>9} {'eng/LA':>7}  {'weightwatcher':>8}")
    for m, n in [(1024, 1024), (4096, 1024), (30000, 768)]:
        w = torch.randn(m, n) / n**0.5
        layer = layer_for(m, n)
        eng = Engine(use_cache=False, workers=1)
        t_eng, t_svd, t_lin = best_interleaved(
            [lambda: eng.one(layer, w), lambda: torch.linalg.svdvals(w), lambda: bare([w])], rounds=5)
        row(f"{m}x{n} fp32", t_eng, t_svd, t_lin)
        ref = np.linalg.svd(w.double().numpy(), compute_uv=False)
        e_eng = np.max(np.abs(np.asarray(eng.one(layer, w).sigma[0]) - ref)) / ref[0]
        e_svd = np.max(np.abs(torch.linalg.svdvals(w).double().numpy() - ref)) / ref[0]
        print(f"{'':<28} max |sigma - float64 SVD| / sigma_max: engine {e_eng:.1e}, svdvals (fp32) {e_svd:.1e}; "
              f"ceiling svdvals / bare LA {t_svd / t_lin:.2f}x")

    model = bert_25m()
    a = auditor.audit(model, spectra=False)
    params = dict(model.named_parameters())
    items = [(l, (lambda p=l.param: params[p])) for l in a.layers]
    mats = [matrix_view(l, params[l.param].detach())[0] for l in a.layers]
    n_params = a.total_params
    with PeakSampler() as mem:  # the first engine run on this model, before anything else has grown the heap
        Engine(use_cache=False).run(items)
    eng = Engine(use_cache=False)
    fns = [lambda: eng.run(items), lambda: svdvals_loop(mats), lambda: bare(mats)]
    try:
        import weightwatcher as ww

        fns.append(ww.WeightWatcher(model=model).analyze)
    except ImportError:
        print("(weightwatcher not importable here: run `make bench` for that column)")
    t_eng, t_svd, t_lin, *rest = best_interleaved(fns, rounds=3)
    t_ww = rest[0] if rest else None
    row(f"BERT-style {n_params / 1e6:.1f}M ({len(mats)} w)", t_eng, t_svd, t_lin, t_ww)

    firsts, agains = [], []
    for _ in range(2):  # a first audit fills an empty cache; the re-audits then read it (best of each)
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            Engine(cache_dir=Path(cache)).run(items)
            firsts.append(time.perf_counter() - t0)
            for _ in range(3):
                again = Engine(cache_dir=Path(cache))
                t0 = time.perf_counter()
                again.run(items)
                agains.append(time.perf_counter() - t0)
    t_first, t_again = min(firsts), min(agains)
    print(f"cached re-audit: first {t_first:.3f}s, again {t_again:.3f}s = {100 * t_again / t_first:.1f}% of the first "
          f"({again.stats.cached} of {len(items)} from cache; best of 2 and of 6)")
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    largest_mb = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"memory: {mem.base:.0f} MB resident before the spectra (torch, transformers and the {model_mb:.0f} MB "
          f"model), +{mem.increase:.0f} MB at the peak while computing them; goal: model + 3 x largest weight = "
          f"{model_mb:.0f} + {3 * largest_mb:.0f} MB, i.e. at most +{3 * largest_mb:.0f} MB "
          f"({'met' if mem.increase <= 3 * largest_mb else 'NOT met'}); process peak {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
