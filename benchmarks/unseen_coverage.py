"""How often the verification interval reaches the value on a file the tool never read: rows against documents.

    python benchmarks/unseen_coverage.py                # the sample's own held-out files, 8 windows each
    python benchmarks/unseen_coverage.py --subpackages  # subpackage sources nothing of the sample read

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


def stdlib_windows(files: int, per_file: int, own: bool) -> tuple[torch.Tensor, np.ndarray, list[str]]:
    """(windows x LENGTH character ids, each window's file, the files' names): the first ``per_file`` whole windows
    of each of the first ``files`` files long enough to give them. ``own``: the sample's own held-out files (the
    top-level sources ``train_chargpt.py`` held out of training, one in 8, which its held-out windows come from),
    else subpackage sources (``*/*.py``: nothing of the sample read them)."""
    import chargpt as cg

    lib = Path(sysconfig.get_paths()["stdlib"])
    if own:
        paths = [f for i, f in enumerate(sorted(lib.glob("*.py"))) if i % 8 == 0]
    else:
        paths = [f for f in sorted(lib.glob("*/*.py")) if "site-packages" not in f.parts
                 and "test" not in f.parts[-2] and "idle" not in f.parts[-2]]
    rows, docs, names = [], [], []
    for f in paths:
        ids = cg.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) < per_file * LENGTH:
            continue
        rows.append(ids[:per_file * LENGTH].reshape(per_file, LENGTH))
        docs += [len(names)] * per_file
        names.append(f"{f.parent.name}/{f.name}" if not own else f.name)
        if len(names) == files:
            break
    return torch.cat(rows), np.array(docs), names


def intervals(value_of, n: int, docs: np.ndarray, value: float) -> dict[str, tuple[float, float, str]]:
    """The three intervals from the rows ``0..n-1`` (``value_of(idx)``: the metric on those rows)."""
    rows = percentile_interval(np.array([value_of(d) for d in row_draws(n, RESAMPLES, SEED)]), 0.9, value)
    by_docs = unseen_interval(value_of, n, value, 0.9, Documents(docs, "files", "windows"))
    blocks = unseen_interval(value_of, n, value, 0.9, Documents(None, "files", "windows"))
    return {"rows": (*rows, "the row bootstrap, before"), "documents": (by_docs.low, by_docs.high, by_docs.label),
            "blocks": (blocks.low, blocks.high, blocks.label)}


def coverage(value_of, docs: np.ndarray, splits: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, list]:
    """For each (reported files, unseen files): the intervals from the reported files' windows against the value on
    the unseen files' windows: [holds it, upper end reaches it, widths, label] per interval."""
    out: dict[str, list] = {}
    for seen, unseen in splits:
        rest = np.flatnonzero(np.isin(docs, seen))
        target = value_of(np.flatnonzero(np.isin(docs, unseen)))
        got = intervals(lambda d: value_of(rest[d]), len(rest), docs[rest], value_of(rest))
        for k, (lo, hi, label) in got.items():
            row = out.setdefault(k, [0, 0, [], label])
            row[0] += lo <= target <= hi
            row[1] += target <= hi
            row[2].append(hi - lo)
    return out


def say(title: str, got: dict[str, list], total: int) -> None:
    print(title)
    for k, (inside, below, widths, label) in got.items():
        print(f"  {k:10s} ({label}): holds the unseen value {inside}/{total} ({100 * inside / total:.0f}%), its upper "
              f"end reaches it {below}/{total} ({100 * below / total:.0f}%); median width {np.median(widths):.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=48)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--halves", type=int, default=100, help="random halvings of the files (seeded)")
    ap.add_argument("--subpackages", action="store_true", help="subpackage sources instead of the sample's own "
                                                                "held-out files")
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
    ids, docs, names = stdlib_windows(args.files, args.windows, not args.subpackages)
    ver = Verifier(model, [Batch(kwargs={"idx": ids[i:i + 64]}) for i in range(0, len(ids), 64)], Metric())
    sums = ver._sums(new)

    def value_of(idx: np.ndarray) -> float:
        return ver._value(sums, idx)

    k = len(names)
    per_file = [value_of(np.flatnonzero(docs == f)) for f in range(k)]
    print(f"plan: {100 * b.removed_fraction:.1f}% removed; {k} {'subpackage' if args.subpackages else 'own held-out'} "
          f"stdlib files x {args.windows} windows of {LENGTH} characters; on all of them {value_of(slice(None)):.5g}; "
          f"per file {min(per_file):.5f} to {max(per_file):.5f} (median {np.median(per_file):.5f})")
    files = np.arange(k)
    say(f"one file held out at a time ({k}): the interval from the other {k - 1} files against the held-out file",
        coverage(value_of, docs, [(files[files != f], np.array([f])) for f in files]), k)
    rng = np.random.default_rng(SEED)
    halves = [(p[: k // 2], p[k // 2:]) for p in (rng.permutation(k) for _ in range(args.halves))]
    say(f"half the files held out ({args.halves} random halvings): the interval from {k // 2} files against the "
        f"other {k - k // 2}", coverage(value_of, docs, halves), args.halves)


if __name__ == "__main__":
    main()
