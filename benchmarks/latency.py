"""Speed, measured two ways in one run: the tool's per-layer and whole-model ratios dense/factorized
(``--measure-speed``: auditor/speed) next to an independent ``torch.utils.benchmark`` measurement of the same
modules, on the digits MLP, the sample char transformer and the sample Llama; then the time break-even rank of a
4096x4096 Linear at batch 1 and at batch 64 x 128.

    python benchmarks/latency.py [--device cpu|cuda] [--threads N] [--skip-4096] [--only digits,chargpt,llama]

Independent means: the dense layer is a fresh ``nn.Linear`` (or ``nn.Embedding``) of the layer's shape and the
factorized one a hand-built ``nn.Sequential`` of two, both timed by ``torch.utils.benchmark.Timer.timeit`` in blocks
of at least 0.5 ms that alternate dense and factorized (a shared machine's slow spells fall on both); the whole model
is the dense model and ``auditor.surgery.apply_plan``'s output, timed in this process the same way (the tool times
it in a fresh process). Agreement is the tool's ratio over the benchmark's: the goal is 0.8-1.25 (within 25%). The
last column is ``blocked_autorange``'s ratio, for reference: its longer blocks take in more preemptions on a busy
machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sample_models"))

MODELS = {"digits": "sample_models/digits.py:mlp", "chargpt": "sample_models/chargpt.py:chargpt",
          "llama": "sample_models/llama"}


def bench(fns, device: str, min_run_time: float = 0.3, block_s: float = 5e-4) -> list[float]:
    """Median seconds per call of each function by torch.utils.benchmark: ``Timer.timeit`` blocks of at least
    ``block_s`` (calls per block found by doubling), the functions' blocks alternated until each has
    ``min_run_time`` seconds; the median of the blocks."""
    import torch
    import torch.utils.benchmark as tb

    timers = [tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()) for fn in fns]
    numbers = []
    for t in timers:
        t.timeit(2)  # warm-up
        n = 1
        while t.timeit(n).median * n < block_s and n < 1 << 20:
            n *= 2
        numbers.append(n)
    per: list[list[float]] = [[] for _ in fns]
    spent = [0.0] * len(fns)
    while min(spent) < min_run_time or min(len(p) for p in per) < 5:
        for i, t in enumerate(timers):
            m = t.timeit(numbers[i]).median
            per[i].append(m)
            spent[i] += m * numbers[i]
    return [statistics.median(p) for p in per]


def autorange(fns, min_run_time: float = 0.2) -> list[float]:
    """torch.utils.benchmark's own ``blocked_autorange`` median of each (its blocks are longer: on a shared machine
    they take in more preemptions)."""
    import torch
    import torch.utils.benchmark as tb

    return [tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            .blocked_autorange(min_run_time=min_run_time).median for fn in fns]


def independent_pair(row, device: str):
    """A fresh dense module of the row's shape and a hand-built factorized one, and an input of its shape."""
    import torch
    from torch import nn

    if row.kind == "embedding":
        dense = nn.Embedding(row.m, row.n)
        fact = nn.Sequential(nn.Embedding(row.m, row.rank), nn.Linear(row.rank, row.n, bias=False))
        x = torch.randint(0, row.m, row.input_shape)
    else:
        dense = nn.Linear(row.n, row.m)
        fact = nn.Sequential(nn.Linear(row.n, row.rank, bias=False), nn.Linear(row.rank, row.m))
        x = torch.randn(row.input_shape)
    return dense.to(device).eval(), fact.to(device).eval(), x.to(device)


def run_model(name: str, spec: str, device: str) -> list[tuple]:
    import torch
    from auditor.surgery import apply_plan
    from auditor.options import AuditOptions, LoadOptions
    from auditor.pipeline import audit_source, load_model
    from auditor.structure.trace import ExampleInputs

    t0 = time.perf_counter()
    a = audit_source(spec, options=AuditOptions(measure_speed=True, device=device, cache=False, progress=False))
    took = time.perf_counter() - t0
    sp = a.speed
    rows = []
    print(f"\n{name}: {spec}; tool measured in {took:.0f} s on {sp.where()}, {sp.dtype}; plan "
          f"{len(a.review.items)} layers, {100 * a.review.share_saved:.1f}% of the parameters removed")
    seen = set()
    print(f"  {'layer':<34} {'rank':>5} {'input':>12} {'tool x':>8} {'bench x':>8} {'agree':>6} {'autorange x':>11}")
    with torch.inference_mode():
        for row in sp.layers:
            key = (row.kind, row.m, row.n, row.rank, row.input_shape)
            if key in seen:
                continue
            seen.add(key)
            dense, fact, x = independent_pair(row, device)
            d, f = bench([lambda: dense(x), lambda: fact(x)], device)
            ad, af = autorange([lambda: dense(x), lambda: fact(x)])
            agree = row.ratio / (d / f)
            rows.append((name, row.layer, row.ratio, d / f, agree))
            print(f"  {row.layer:<34} {row.rank:>5} {'x'.join(map(str, row.input_shape)):>12} {row.ratio:>8.2f} "
                  f"{d / f:>8.2f} {agree:>6.2f} {ad / af:>11.2f}")
        loaded = load_model(spec, LoadOptions())
        model = loaded.model.to(device).eval()
        ex = ExampleInputs.of(loaded.example_inputs)
        args = tuple(v.to(device) for v in ex.args)
        kwargs = {k: v.to(device) for k, v in ex.kwargs.items()}
        plan = {it.layer: it.rank for it in a.review.items}
        fmodel = apply_plan(model, plan).to(device).eval()
        d, f = bench([lambda: model(*args, **kwargs), lambda: fmodel(*args, **kwargs)], device)
        ad, af = autorange([lambda: model(*args, **kwargs), lambda: fmodel(*args, **kwargs)])
    m = sp.model
    agree = m.ratio / (d / f)
    rows.append((name, "(whole model)", m.ratio, d / f, agree))
    print(f"  {'(whole model, ' + m.where + ')':<34} {'':>5} {'':>12} {m.ratio:>8.2f} {d / f:>8.2f} {agree:>6.2f} "
          f"{ad / af:>11.2f}")
    print(f"  whole model: dense {m.dense.timing.median * 1e3:.3f} ms (IQR {m.dense.timing.iqr * 1e3:.3f}), "
          f"factorized {m.factorized.timing.median * 1e3:.3f} ms (IQR {m.factorized.timing.iqr * 1e3:.3f}); "
          f"peak {m.dense.memory} {m.dense.peak_bytes / 2**20:.0f} -> {m.factorized.peak_bytes / 2**20:.0f} MiB; "
          f"torch.utils.benchmark {d * 1e3:.3f} -> {f * 1e3:.3f} ms")
    for n in sp.notes:
        print(f"  note: {n}")
    return rows


def break_even_4096(device: str) -> None:
    import torch
    from torch import nn
    import auditor
    from auditor.speed.layer_timing import Timer, time_break_even

    lin = nn.Linear(4096, 4096)
    layer = auditor.audit(nn.Sequential(lin), torch.zeros(1, 4096), spectra=False, cache=False).layer("0")
    for lead, points, min_time in (((1,), 16, 0.3), ((64, 128), 8, 0.5)):
        x = torch.randn(*lead, 4096)
        timer = Timer(device=device, min_time=min_time, min_blocks=3, warmup=1)
        t0 = time.perf_counter()
        be = time_break_even(layer, lin, x, timer, align=8, at="traced", points=points)
        probes = ", ".join(f"r={r}: {t.median * 1e3:.3f} ms (dense beside it {d.median * 1e3:.3f})"
                           for (r, t), d in zip(be.probes, be.paired))
        print(f"\n4096x4096 Linear, input {'x'.join(map(str, x.shape))} on {device} ({torch.get_num_threads()} "
              f"threads): time break-even rank {be.label()} (grid step {be.step}, parameter break-even "
              f"{be.param_break_even:.0f}); dense {be.dense.median * 1e3:.3f} ms; probes {probes}; "
              f"{time.perf_counter() - t0:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads here and in the tool's processes (OMP_NUM_THREADS)")
    p.add_argument("--only", default="digits,chargpt,llama")
    p.add_argument("--skip-4096", action="store_true")
    args = p.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    rows = []
    for name in args.only.split(","):
        rows += run_model(name, MODELS[name], args.device)
    bad = [r for r in rows if not 0.8 <= r[4] <= 1.25]
    print(f"\nagreement (tool ratio / torch.utils.benchmark ratio) within 25%: {len(rows) - len(bad)} of {len(rows)}"
          + ("; outside: " + ", ".join(f"{r[0]} {r[1]} {r[4]:.2f}" for r in bad) if bad else ""))
    if not args.skip_4096:
        break_even_4096(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
