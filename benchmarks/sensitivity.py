"""Gradient sensitivity (the default) against the truncation probes (``--probe``), side by side in one run.

    python benchmarks/sensitivity.py                  # the char transformer and the sample Llama
    python benchmarks/sensitivity.py --only chargpt   # one of them
    python benchmarks/sensitivity.py --default-only   # the default audit only (no probes)

For each sample model the calibrated audit (``AuditOptions(calibration=...)``, no cache) runs three times, one after
the other in this process: the default (output-gradient sensitivity, one backward pass), ``--no-probe`` (tier 3 over
tier-1 curves) and ``--probe`` (the per-layer truncation probes). Printed per run: the audit's wall time against its
tier-1 wall (the same audit's wall less every calibration stage after tier 1), where the time went, the plans
measured and the search rows they read, the suggested plan's removal, its search-rows metric and its verification
interval; then the ratios side by side (default against tier 1, --no-probe and --probe; the default plan's share
removed against the probes' plan, which it must match within 2 points); then how well each
sensitivity predicts the all-at-once metric over every plan tier 3 measured (Spearman rank correlation, and the
median and largest relative error of the predicted value against the measured one); then the suggested plan applied
with ``auditor.factorize`` and measured on text the tool never read: windows of the standard library's subpackage
sources (``*/*.py``; both samples were trained, calibrated and held out on top-level files only): the char
transformer on 96 windows of 128 characters, the Llama on 48 windows of its positions (128 tokens), printed beside
the verification interval the audit reported.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import auditor  # noqa: E402
from auditor.calibration import Evaluator, Metric  # noqa: E402
from auditor.calibration.data.inputs import Batch, Calibration  # noqa: E402


def unseen_text(limit: int = 400_000) -> str:
    """Standard-library subpackage sources, sorted, up to ``limit`` characters: text neither sample model nor its
    calibration files hold (they read top-level ``*.py`` files only)."""
    out, n = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*/*.py")):
        if "site-packages" in f.parts or "test" in f.parts[-2]:
            continue
        t = f.read_text(encoding="utf-8", errors="replace")
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return "".join(out)


def windows(ids: torch.Tensor, n: int, length: int) -> torch.Tensor:
    starts = torch.linspace(0, len(ids) - length, n).long()
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def chargpt_case():
    sys.path.insert(0, str(ROOT / "sample_models"))
    import chargpt as cg

    model = cg.model()
    ids = cg.encode(unseen_text())
    unseen = Calibration([], [Batch(kwargs={"idx": windows(ids, 96, 128)})], source="unseen")
    opts = dict(calibration=str(ROOT / "sample_models/chargpt_calib.safetensors"),
                holdout=str(ROOT / "sample_models/chargpt_holdout.safetensors"))
    return "char transformer", "sample_models/chargpt.py:chargpt", opts, model, unseen, Metric()


def llama_case():
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    d = ROOT / "sample_models/llama"
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = torch.tensor(tok.encode(unseen_text()).ids)
    length = model.config.max_position_embeddings  # windows of the model's positions, as the tool cuts them
    unseen = Calibration([], [Batch(kwargs={"input_ids": windows(ids, 48, length)[i:i + 16]}) for i in (0, 16, 32)],
                         source="unseen")
    opts = dict(calibration=str(d / "calib.txt"), holdout=str(d / "holdout.txt"), tokenizer=str(d))
    return "sample Llama", str(d), opts, model, unseen, Metric(kind="perplexity")


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return math.nan
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else math.nan


def audit(spec: str, opts: dict, tolerance: float | None, **mode) -> tuple:
    """(the audit, its wall time) of ``spec`` with calibration, no cache, in the given mode (``probe=True``: the
    truncation probes; ``probe_sensitivity=False``: --no-probe, tier 3 over tier-1 curves)."""
    options = auditor.AuditOptions(**{k: v for k, v in opts.items() if k != "tokenizer"}, cache=False,
                                   progress=False, **mode, **({"tolerance": tolerance} if tolerance is not None else {}))
    t = time.perf_counter()
    a = auditor.audit_source(spec, options=options)
    return a, time.perf_counter() - t


def tier1_wall(a, wall: float) -> float:
    """The audit's wall time less every calibration stage after tier 1 (the sensitivity, the rounding floor, tier 3,
    the verification): what the same audit costs when it stops at tier 1 (tracing, data-free spectra, the
    calibration statistics and whitened spectra)."""
    sec = a.calibration.seconds
    return wall - sum(v for k, v in sec.items() if k != "tier1")


def report(label: str, a, wall: float) -> None:
    c = a.calibration
    b = c.budget
    sec = c.seconds
    t1 = tier1_wall(a, wall)
    full = max(q.rows for q in b.tries) if b.tries else 0
    print(f"  {label}: audit {wall:.1f} s = {wall / t1:.2f}x its tier-1 wall ({t1:.1f} s; calibrate's tier 1 "
          f"{sec['tier1']:.1f} s); " + ", ".join(f"{k} {v:.1f} s" for k, v in sec.items()) +
          f"; {c.evaluations} evaluations ({len(b.tries)} plans in tier 3, "
          f"{sum(p.rows == full for p in b.tries)} of them on every search row, rows read "
          f"{sum(p.rows for p in b.tries):,})")
    v = b.verification
    ver = v.words(c.tolerance, c.metric) if v is not None else "not verified"
    print(f"    suggested plan: {100 * b.removed_fraction:.1f}% removed ({len(b.plan)} layers), search rows "
          f"{b.metric:.4g}; verification: {ver}")
    linear = b.source == "gradient" and c.metric != "relative output error"
    pred = [p.predicted_cost if linear else math.sqrt(max(p.predicted_cost, 0.0)) for p in b.tries if p.plan]
    meas = [p.metric for p in b.tries if p.plan]
    errs = sorted(abs(p - m) / m for p, m in zip(pred, meas) if m > 0)
    med = errs[len(errs) // 2] if errs else math.nan
    print(f"    prediction over the {len(meas)} plans measured: Spearman {spearman(pred, meas):.3f}, relative error "
          f"median {100 * med:.0f}%, largest {100 * max(errs, default=math.nan):.0f}%")


def on_unseen(a, opts: dict, model, unseen, metric) -> None:
    """The suggested plan applied with ``auditor.factorize`` (whitened by the audit's own fit rows) and measured on
    text the tool never read, beside the verification interval the audit reported."""
    from auditor.calibration import load_calibration

    c = a.calibration
    b = c.budget
    fit = load_calibration(opts["calibration"], model, opts["holdout"], tokenizer=opts.get("tokenizer"))
    new = auditor.factorize(model, dict(b.plan), calibration=fit, fit="loss-aware")  # what the audit measured
    m = Evaluator(model, unseen, Metric(kind=metric.kind, tolerance=c.tolerance)).measure(new)
    rows = sum(x.rows for x in unseen.holdout)
    v = b.verification
    interval = (f"{v.value:.4g}, {100 * v.confidence:g}% interval {v.low:.4g} to {v.high:.4g} on {v.rows} rows"
                if v is not None and v.low is not None else "none")
    inside = v is not None and v.low is not None and v.low <= m.value <= v.high
    print(f"    on unseen text ({rows} windows): {c.metric} {m.value:.4g} -> "
          f"{'holds' if m.ok else 'MISSES'} the tolerance {c.tolerance:g}; verification {interval} "
          f"({'inside' if inside else 'outside'} it)")


def run_case(case, default_only: bool, tolerance: float | None) -> None:
    name, spec, opts, model, unseen, metric = case()
    print(f"{name}:")
    a, wall = audit(spec, opts, tolerance)
    report("gradients (default)", a, wall)
    on_unseen(a, opts, model, unseen, metric)
    if default_only:
        return
    n, n_wall = audit(spec, opts, tolerance, probe_sensitivity=False)
    report("tier-1 curves (--no-probe)", n, n_wall)
    p, p_wall = audit(spec, opts, tolerance, probe=True)
    report("probes (--probe)", p, p_wall)
    share, probed = a.calibration.budget.removed_fraction, p.calibration.budget.removed_fraction
    print(f"  side by side: default {wall:.1f} s = {wall / tier1_wall(a, wall):.2f}x its tier-1 wall, "
          f"{wall / n_wall:.2f}x the --no-probe audit, {wall / p_wall:.2f}x the --probe audit; default plan "
          f"{100 * share:.1f}% removed vs --probe {100 * probed:.1f}% ({100 * (share - probed):+.1f} points; "
          f"{'within' if share >= probed - 0.02 else 'BEYOND'} the 2 points allowed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("chargpt", "llama"))
    ap.add_argument("--tolerance", type=float)
    ap.add_argument("--default-only", action="store_true", help="the default (gradient) audit only, no probes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine shared with other jobs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [chargpt_case, llama_case]
    if args.only:
        cases = [chargpt_case] if args.only == "chargpt" else [llama_case]
    for case in cases:
        run_case(case, args.default_only, args.tolerance)
        print()


if __name__ == "__main__":
    main()
