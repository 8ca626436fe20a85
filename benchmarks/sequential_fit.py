"""The sequential fit against the independent one, at the same ranks (docs/calibration.md, "The sequential fit").

For each sample model and each share of the parameters removed (10/20/30%), one plan: every factorizable layer of
the repeated blocks (the char transformer) or every layer but the 10-way head (the digits models) kept at one share
of its break-even rank, the share found by bisection (SVD-LLM's uniform allocation). That plan factorized with the
independent whitened fit, with the sequential fit (its block refinement on, then off: the closed form), and with the
sequential fit refitting the layers the plan keeps dense (``refit_dense``: the output head), all on the same fit
rows, and measured on rows none of them read:
the char transformer's held-out perplexity (chargpt_holdout.safetensors), the digits models' relative output error
and top-1 accuracy on the digits after the first 1,000.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/sequential_fit.py [chargpt] [mlp] [cnn]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_models"))

from auditor.calibration.apply import factorize  # noqa: E402
from auditor.calibration.data.inputs import Batch, Calibration  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from auditor.surgery import count_params  # noqa: E402

SHARES = (0.10, 0.20, 0.30)


def uniform_plan(model: torch.nn.Module, names: list[str], target: float) -> dict[str, int]:
    """Every layer of ``names`` at one kept share of its break-even rank, removing about ``target`` of the model."""
    layers = {l.name: l for l in collect_layers(model, ParamTable.of(model)).values() if l.name in names}
    total = count_params(model)

    def plan_at(s: float) -> dict[str, int]:
        return {n: max(1, math.floor(s * l.m * l.n / (l.m + l.n))) for n, l in layers.items()}

    def removed(s: float) -> float:
        return sum(l.m * l.n - r * (l.m + l.n) for l, r in zip(layers.values(), plan_at(s).values())) / total

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if removed(mid) > target else (lo, mid)
    return plan_at(lo)


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        loss = sum(float(torch.nn.functional.cross_entropy(model(ids[i:i + 32])[:, :-1].reshape(-1, 98),
                                                           ids[i:i + 32, 1:].reshape(-1), reduction="sum"))
                   for i in range(0, len(ids), 32))
    return math.exp(loss / (len(ids) * (ids.shape[1] - 1)))


def chargpt_rows() -> tuple[torch.nn.Module, Calibration, object]:
    import chargpt

    model = chargpt.model()
    fit = chargpt.load_ids(chargpt.CALIB).long()
    cal = Calibration([Batch((fit[i:i + 16],), {}) for i in range(0, len(fit), 16)], [])
    held = chargpt.load_ids(chargpt.HOLDOUT).long()
    return model, cal, lambda m: perplexity(m, held)


def digits_rows(which: str) -> tuple[torch.nn.Module, Calibration, object]:
    import digits
    from sklearn.datasets import load_digits

    model = getattr(digits, which)()[0]
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    if which == "cnn":
        x = x.reshape(-1, 1, 8, 8)
    y = torch.tensor(d.target)
    cal = Calibration([Batch((x[i:i + 100],), {}) for i in range(0, 1000, 100)], [])
    with torch.no_grad():
        dense = model(x[1000:])

    def score(m: torch.nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            out = m(x[1000:])
        return (float(torch.linalg.norm(out - dense) / torch.linalg.norm(dense)),
                float((out.argmax(1) == y[1000:]).float().mean()))
    return model, cal, score


def run(name: str) -> None:
    model, cal, score = chargpt_rows() if name == "chargpt" else digits_rows(name)
    names = [l.name for l in collect_layers(model, ParamTable.of(model)).values()
             if (l.name.startswith("blocks.") if name == "chargpt" else l.name != "head")]
    print(f"{name}: dense {score(model)}", flush=True)
    for share in SHARES:
        plan = uniform_plan(model, names, share)
        row = []
        for fit in ("independent", "sequential", "sequential, closed form", "sequential, refit dense"):
            t = time.perf_counter()
            new = factorize(model, plan, cal, fit=fit)  # apply.Fit's values: closed form = --no-refine
            took = time.perf_counter() - t
            row.append((fit, score(new), took))
        removed = 1 - count_params(new) / count_params(model)
        print(f"{name} {100 * removed:.1f}% removed: " + "; ".join(f"{f} {s} ({t:.1f} s)" for f, s, t in row),
              flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for which in sys.argv[1:] or ("mlp", "cnn", "chargpt"):
        run(which)
