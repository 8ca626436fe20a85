"""A 2-worker Dask LocalCluster (127.0.0.1) against the local engine on the same sharded checkpoint, and the
per-matrix times a 70B estimate is built from (docs/cluster.md).

1. Per-task overhead: a checkpoint of many tiny tensors (the spectrum itself is microseconds), whole spectra stage
   on the cluster and locally; overhead per task = (cluster - local) / tasks.
2. Whole audit: a sharded checkpoint of mid-size matrices (the local engine and the cluster both use 2 cores here),
   cache off, best of ``--repeat``; printed as the ratio cluster / local.
3. Per-matrix parts on one core: the float64 Gram (m k^2 flops) and the eigensolver (k^3) for given shapes.
4. Tier-2 rank-floor sweeps (``--measure-floor``), local against the cluster (one task per layer, the model loaded
   by each worker from its source, the calibration sent once by the worker plugin): the sweep's own seconds
   (``calibration.seconds["tier2"]``) for the digits MLP and the char transformer, and the overhead per task,
   (2 x cluster - local) / tasks: worker-seconds beyond the local compute (plugin transfer, model load, the
   worker's Sweeper: its dense reference and prefix cache), spread over the layers.

    python benchmarks/cluster.py [--shapes 4096x11008,2048x7168] [--repeat 2] [--sweep digits,chargpt]
    python benchmarks/cluster.py --only-sweep --sweep digits          # a short smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best  # noqa: E402


def write_checkpoint(folder: Path, shapes: list[tuple[int, int]], shards: int = 2, seed: int = 0) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(len(shapes))]
    per = -(-len(names) // shards)
    wm = {}
    for s in range(shards):
        chunk = list(range(s * per, min(len(names), (s + 1) * per)))
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: torch.randn(*shapes[i], generator=g) for i in chunk}, str(folder / fname))
        wm.update({names[i]: fname for i in chunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def audit_time(path: Path, repeat: int, **kw) -> float:
    import auditor
    from auditor.sources import load_source

    w = load_source(str(path)).model
    return best(lambda: auditor.audit(w, cache=False, progress=False, **kw), repeat)


def part_times(m: int, n: int) -> tuple[float, float]:
    """(Gram seconds, eigensolver seconds) for one m x n float32 matrix on one BLAS thread."""
    from threadpoolctl import threadpool_limits

    from auditor.spectra.backend import eig_svdvals, gram64

    w = torch.randn(m, n)
    with threadpool_limits(1, user_api="blas"):
        t = time.perf_counter()
        g = gram64(w)
        tg = time.perf_counter() - t
        t = time.perf_counter()
        eig_svdvals(g)
        te = time.perf_counter() - t
    return tg, te


def sweep_cases(names: list[str], folder: Path) -> list[tuple[str, str, dict]]:
    """(label, source spec, calibration options) for the sample models asked for."""
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    out = []
    root = Path(__file__).resolve().parents[1] / "sample_models"
    if "digits" in names:
        x = torch.tensor(load_digits().data[:1200], dtype=torch.float32) / 16.0
        save_file({"x": x.contiguous()}, str(folder / "digits_calib.safetensors"))
        out.append(("digits MLP", f"{root}/digits.py:mlp",
                    {"calibration": str(folder / "digits_calib.safetensors"), "holdout": 0.25}))
    if "chargpt" in names:
        out.append(("char transformer", f"{root}/chargpt.py:chargpt",
                    {"calibration": str(root / "chargpt_calib.safetensors"),
                     "holdout": str(root / "chargpt_holdout.safetensors")}))
    return out


def sweep_seconds(spec: str, cal: dict, **kw) -> tuple[float, int, str]:
    """(tier-2 seconds, layers swept, where) for one audit with --measure-floor (spectra off: not timed here)."""
    import auditor

    a = auditor.audit_source(spec, options=auditor.AuditOptions(spectra=False, cache=False, progress=False,
                                                                measure_floor=True, **cal, **kw))
    c = a.calibration
    return c.seconds["tier2"], sum(1 for l in c.layers.values() if l.floor is not None), \
        a.environment.get("sweep", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", type=int, default=400, help="tiny tensors for the overhead run")
    ap.add_argument("--mid", default="1024x2752", help="shape of the whole-audit run's matrices")
    ap.add_argument("--count", type=int, default=16, help="matrices in the whole-audit run")
    ap.add_argument("--shapes", default="4096x11008,2048x7168", help="per-matrix timing shapes (k x m)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sweep", default="digits", help="sample models for the sweep rows: digits, chargpt (the char "
                    "transformer: over 6 minutes locally on a loaded 2-core box), or empty for none")
    ap.add_argument("--only-sweep", action="store_true", help="only the sweep rows (a short smoke run)")
    a = ap.parse_args()

    from distributed import Client, LocalCluster

    with tempfile.TemporaryDirectory() as tmp:
        tiny, mid = Path(tmp) / "tiny", Path(tmp) / "mid"
        tiny.mkdir()
        mid.mkdir()
        write_checkpoint(tiny, [(16, 8)] * a.tiny)
        k, m = map(int, a.mid.split("x"))
        write_checkpoint(mid, [(k, m)] * a.count, seed=1)
        with LocalCluster(processes=True, n_workers=2, threads_per_worker=1, host="127.0.0.1",
                          dashboard_address=None, silence_logs=40) as lc, Client(lc, set_as_default=False) as c:
            audit_time(tiny, 1, scheduler=c)  # workers import torch and the auditor once
            if not a.only_sweep:
                t_tiny_c = audit_time(tiny, a.repeat, scheduler=c)
                t_tiny_l = audit_time(tiny, a.repeat, jobs=2)
                t_mid_c = audit_time(mid, a.repeat, scheduler=c)
                t_mid_l = audit_time(mid, a.repeat, jobs=2)
            cases = sweep_cases([n for n in a.sweep.split(",") if n], Path(tmp))
            if cases:  # each row printed as soon as it is measured
                print(f"{'tier-2 sweep (--measure-floor)':34}{'local':>18}{'dask (2 workers)':>18}{'ratio':>8}",
                      flush=True)
            for label, spec, cal in cases:
                runs = []
                for _ in range(a.repeat):  # interleaved: a slow spell on a shared machine hits both alike
                    runs.append((sweep_seconds(spec, cal), sweep_seconds(spec, cal, scheduler=c)))
                local, cluster = min(r[0][0] for r in runs), min(r[1][0] for r in runs)
                tasks, where = runs[0][1][1], runs[0][1][2]
                print(f"{f'{label}, {tasks} layers':34}{local:>17.2f}s{cluster:>17.2f}s{cluster / local:>8.2f}"
                      f"   overhead per task {1e3 * (2 * cluster - local) / tasks:.0f} ms   [{where}]", flush=True)
    if a.only_sweep:
        return
    print(f"{'':34}{'local (2 threads)':>18}{'dask (2 workers)':>18}{'ratio':>8}")
    print(f"{f'{a.tiny} tiny tensors, whole audit':34}{t_tiny_l:>17.2f}s{t_tiny_c:>17.2f}s{t_tiny_c / t_tiny_l:>8.2f}")
    print(f"{'  per task':34}{1e3 * t_tiny_l / a.tiny:>16.2f}ms{1e3 * t_tiny_c / a.tiny:>16.2f}ms")
    print(f"  cluster overhead per task: {1e3 * (t_tiny_c - t_tiny_l) / a.tiny:.2f} ms")
    print(f"{f'{a.count} x {a.mid}, whole audit':34}{t_mid_l:>17.2f}s{t_mid_c:>17.2f}s{t_mid_c / t_mid_l:>8.2f}")
    print("per-matrix parts, one core (float64 Gram | eigensolver):")
    for s in a.shapes.split(","):
        k, m = map(int, s.split("x"))
        tg, te = part_times(k, m)
        print(f"  {k} x {m}: gram {tg:.2f} s ({2 * m * k * k / 2 / tg / 1e9:.1f} GFLOP/s for m k^2), "
              f"eigh {te:.2f} s (k^3 / t = {k ** 3 / te / 1e9:.2f} G/s), total {tg + te:.2f} s")


if __name__ == "__main__":
    main()
