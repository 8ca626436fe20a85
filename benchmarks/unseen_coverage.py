"""How often the verification interval reaches the value on a file the tool never read: rows against documents.

    python benchmarks/unseen_coverage.py               # 24 files, 8 windows each
    python benchmarks/unseen_coverage.py --files 12 --windows 6

The char transformer's suggested plan (the calibrated audit of ``sample_models/chargpt.py:chargpt`` with its bundled
calibration and held-out files, the statistics cache allowed) is applied with ``auditor.factorize`` and measured
window by window (the verification's own per-row sums) on standard-library subpackage sources (``*/*.py``, which
neither the model nor its calibration files read): ``--windows`` contiguous windows of 128 characters from each of
``--files`` files. Then each file in turn is held out: the interval the verification would report from the other
files' windows, three ways (the same code, :func:`auditor.calibration.measure.verify.unseen_interval` and the row
bootstrap, at 90%): over rows (the interval before issue 38), over whole documents (each file one document: a cluster
bootstrap), and over blocks of windows (the block bootstrap, with no document ids: the windows in file order). Printed:
how often each interval holds the held-out file's value (low <= value <= high) and how often its upper end reaches
it (value <= high, the end the suggested plan is judged on), and the intervals' median width.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sample_models"))

import auditor  # noqa: E402
from auditor.calibration import Metric, load_calibration  # noqa: E402
from auditor.calibration.data.inputs import Batch  # noqa: E402
from auditor.calibration.measure.resample import percentile_interval, row_draws  # noqa: E402
from auditor.calibration.measure.verify import RESAMPLES, SEED, Documents, Verifier, unseen_interval  # noqa: E402

LENGTH = 128


def stdlib_windows(files: int, per_file: int) -> tuple[torch.Tensor, np.ndarray, list[str]]:
    """(windows x LENGTH character ids, each window's file, the files' names): the first ``per_file`` whole windows
    of each of the first ``files`` subpackage sources long enough to give them."""
    import chargpt as cg

    rows, docs, names = [], [], []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*/*.py")):
        if "site-packages" in f.parts or "test" in f.parts[-2] or "idle" in f.parts[-2]:
            continue
        ids = cg.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) < per_file * LENGTH:
            continue
        rows.append(ids[:per_file * LENGTH].reshape(per_file, LENGTH))
        docs += [len(names)] * per_file
        names.append(f"{f.parent.name}/{f.name}")
        if len(names) == files:
            break
    return torch.cat(rows), np.array(docs), names


def intervals(value_of, n: int, docs: np.ndarray, value: float) -> dict[str, tuple[float, float, str]]:
    """The three intervals from the rows ``0..n-1`` (``value_of(idx)``: the metric on those rows)."""
    rows = percentile_interval(np.array([value_of(d) for d in row_draws(n, RESAMPLES, SEED)]), 0.9, value)
    by_docs = unseen_interval(value_of, n, value, 0.9, Documents(docs, "files", "windows"))
    blocks = unseen_interval(value_of, n, value, 0.9, Documents(None, "files", "windows"))
    return {"rows": (*rows, "rows"), "documents": (by_docs.low, by_docs.high, by_docs.label),
            "blocks": (blocks.low, blocks.high, blocks.label)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import chargpt as cg

    model = cg.model()
    opts = dict(calibration=str(ROOT / "sample_models/chargpt_calib.safetensors"),
                holdout=str(ROOT / "sample_models/chargpt_holdout.safetensors"))
    a = auditor.audit_source("sample_models/chargpt.py:chargpt",
                             options=auditor.AuditOptions(**opts, progress=False))
    b = a.calibration.budget
    fit = load_calibration(opts["calibration"], model, opts["holdout"])
    new = auditor.factorize(model, dict(b.plan), calibration=fit)
    ids, docs, names = stdlib_windows(args.files, args.windows)
    ver = Verifier(model, [Batch(kwargs={"idx": ids[i:i + 64]}) for i in range(0, len(ids), 64)], Metric())
    sums = ver._sums(new)
    print(f"plan: {100 * b.removed_fraction:.1f}% removed; {len(names)} stdlib files x {args.windows} windows of "
          f"{LENGTH} characters; on all of them {ver._value(sums):.5g}")
    hits = {k: [0, 0] for k in ("rows", "documents", "blocks")}
    widths: dict[str, list[float]] = {k: [] for k in hits}
    labels: dict[str, str] = {}
    for f, name in enumerate(names):
        out_rows = np.flatnonzero(docs == f)
        rest = np.flatnonzero(docs != f)
        held = ver._value(sums, out_rows)
        value = ver._value(sums, rest)
        got = intervals(lambda d: ver._value(sums, rest[d]), len(rest), docs[rest], value)
        line = []
        for k, (lo, hi, label) in got.items():
            hits[k][0] += lo <= held <= hi
            hits[k][1] += held <= hi
            widths[k].append(hi - lo)
            labels[k] = label
            line.append(f"{k} [{lo:.5f}, {hi:.5f}]")
        print(f"  {name:28s} held out {held:.5f}; from the other files {value:.5f}: " + ", ".join(line))
    for k, (inside, below) in hits.items():
        print(f"{k:10s} ({labels[k]}): holds the held-out file's value {inside}/{len(names)}, its upper end reaches "
              f"it {below}/{len(names)}; median width {np.median(widths[k]):.5f}")


if __name__ == "__main__":
    main()
