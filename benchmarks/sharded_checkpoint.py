"""Write a synthetic ~2 GB checkpoint in 3 safetensors shards, audit it weights-only with spectra in a child
process, and print its peak RSS against the goal (3 x the largest tensor + 500 MB). Then a checkpoint of 10,000
small tensors (a mixture-of-experts layout): opening it, reading every tensor, and the whole audit, against reopening
the file and re-parsing its header per tensor (the old reader, timed on 200 tensors and scaled).

    python benchmarks/sharded_checkpoint.py [--keep DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHILD = r"""
import resource, sys, time
import auditor
from auditor.sources import load_source
t = time.perf_counter()
w = load_source(sys.argv[1]).model
a = auditor.audit(w, cache=False, progress=False)
dt = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{a.total_params} {len(a.layers)} {sum(1 for s in a.spectra.values() if s.sigma is not None)} {dt:.2f} {rss:.0f}")
"""


def tensors() -> list[tuple[str, tuple[int, int]]]:
    spec = [(f"blocks.{i}.proj.weight", (65536, 1024)) for i in range(6)]
    spec.append(("embed.weight", (50000, 1024)))
    spec += [(f"blocks.{i // 4}.mlp.{i % 4}.weight", (2048, 1024)) for i in range(24)]
    spec += [(f"blocks.{i}.norm.weight", (1024,)) for i in range(6)]
    return spec


def write(folder: Path, shards: int = 3) -> tuple[int, int]:
    from safetensors.torch import save_file

    spec = tensors()
    g = torch.Generator().manual_seed(0)
    total_bytes = sum(4 * torch.Size(s).numel() for _, s in spec)
    per = total_bytes / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    acc = 0
    for name, shape in spec:
        size = 4 * torch.Size(shape).numel()
        if acc + size > per * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append((name, shape))
        acc += size
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = {}
        for name, shape in group:
            t = torch.randn(*shape, generator=g)
            if len(shape) == 2:  # a decaying spectrum, like trained weights: scale columns
                t *= torch.logspace(0, -2, shape[1])
            data[name] = t
        save_file(data, str(folder / fname))
        del data
        weight_map.update({n: fname for n, _ in group})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    largest = max(4 * torch.Size(s).numel() for _, s in spec)
    return total_bytes, largest


def many_tensors(folder: Path, count: int = 10_000) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    import auditor
    from auditor.sources import WeightsOnly

    g = torch.Generator().manual_seed(1)
    path = folder / "experts.safetensors"
    save_file({f"layers.{i // 64}.experts.{i % 64}.w.weight": torch.randn(16, 8, generator=g) for i in range(count)},
              str(path))
    t = time.perf_counter()
    w = WeightsOnly.open(path)
    layers = w.layers()
    t_open = time.perf_counter() - t
    t = time.perf_counter()
    for name in w.index:
        w.tensor(name)
    t_read = time.perf_counter() - t
    names = list(w.index)[:200]
    t = time.perf_counter()
    for name in names:  # the old reader: open the file and parse its header for every tensor
        with safe_open(str(path), framework="pt") as fh:
            fh.get_tensor(name)
    t_old = (time.perf_counter() - t) * count / len(names)
    t = time.perf_counter()
    a = auditor.audit(w, cache=False, progress=False)
    t_audit = time.perf_counter() - t
    print(f"{count:,} tensors in one file: open + layers {t_open:.2f}s ({len(layers):,} layers), read all "
          f"{t_read:.2f}s; reopening per tensor {t_old:.1f}s (200 timed, scaled) = {t_old / t_read:.0f}x slower; "
          f"whole audit with spectra {t_audit:.1f}s ({len(a.spectra):,} spectra)")


def main() -> None:
    keep = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--keep" else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        total, largest = write(folder)
        print(f"wrote {total / 2**30:.2f} GiB in 3 shards ({time.perf_counter() - t:.1f}s); largest tensor "
              f"{largest / 2**20:.0f} MiB")
        out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, check=True)
        params, layers, spectra, dt, rss = out.stdout.split()
        goal = 3 * largest / 2**20 + 500
        print(f"weights-only audit: {int(params):,} params, {layers} layers, {spectra} spectra in {float(dt):.1f}s")
        print(f"peak RSS {rss} MB vs goal {goal:.0f} MB (3 x largest + 500 MB); checkpoint {total / 2**20:.0f} MB "
              f"-> {'within' if float(rss) < goal else 'OVER'} the goal")
    with tempfile.TemporaryDirectory() as tmp:
        many_tensors(Path(tmp))


if __name__ == "__main__":
    main()
