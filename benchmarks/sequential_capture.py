"""The sequential fit's runs, side by side in one run. ``--compare dense`` (the default): every stage's dense input
rows read in one run of each block per batch (what statistics/sequential.py does), against a dense run of the block
per stage, stopped after the stage's layers (what it did before). ``--compare stop``: each stage's fitted runs end as
the stage's last layer is reached, its other Linears computing zeros (what it does), against runs that end once the
stage's layers have all run (what it did before). ``--compare memory``: a stage's C and G summed in place, one pair
for the layers reading one input, and W* solved by a Cholesky factor made in place (what it does), against a new sum
per layer each batch with both products alive and an LU solve of (G + G^T) / 2 + mu I formed through an identity
(what it did before); a wide ``--intermediate`` shows it (8192: each of the down projection's n x n arrays is
512 MiB). ``--compare threads``: a stage of fewer layers than cores truncated on its share of the BLAS threads (what
it does: a Llama block's o_proj and down_proj alone on every core), against one BLAS thread a layer always (what it
did before). These two comparisons' sides have factors equal to rounding, not bit for bit: each layer's A B is
compared. ``--compare refine``: while a block refines, its planned layers' closed-form factors wait on disk and
their fitted weights are not held (what it does), against both held beside the training, with a second float64
copy of the factors (what it did before); printed: each side's peak during the refinements alone (the high-water
mark reset as each block's begins), with the whole fit's wall. (The best epoch's copy, float64 on the host before,
is not part of it: a random-init block keeps no epoch.)

    PYTHONPATH=. python benchmarks/sequential_capture.py [--hidden 1024 --intermediate 2816 --heads 16 --kv 4]
                                                         [--depth 4] [--rows 48 --tokens 128] [--refine 0]
                                                         [--compare dense|stop|memory|threads|refine]

A random-init Llama of that shape (vocabulary 8,000; cost only), ``rows`` windows of ``tokens`` random ids (a
quarter held out, batches of 16), every Linear of its blocks planned at half its break-even rank; the fit on the
threads torch has. Each side runs in its own process (its high-water mark RSS reset once the model and calibration
are loaded); printed: each side's wall and peak above the RSS then, and the ratios. The two sides' factors must be
equal, bit for bit (checked through a digest). ``--refine 0`` leaves out the block refinement, which both sides run
alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _util import timed_fit  # noqa: E402


def child(a: argparse.Namespace, once: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from auditor.calibration import load_calibration
    from auditor.calibration.statistics import sequential as seq
    from auditor.structure.layers import ParamTable, collect_layers
    from auditor.surgery import checked_plan

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                   num_hidden_layers=a.depth, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv, max_position_embeddings=max(2048, a.tokens))
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 8000, (a.rows, a.tokens), generator=torch.Generator().manual_seed(1))
    cal = load_calibration({"input_ids": ids}, model, holdout=0.25, batch_size=16)
    table = ParamTable.of(model)
    ranks = {name: max(1, int(l.shape[0] * l.shape[1] / (l.shape[0] + l.shape[1]) / 2))
             for name, l in collect_layers(model, table).items() if ".layers." in name}
    plan = checked_plan(model, ranks)
    if not once and a.compare == "dense":  # as before: each stage runs the dense block again, stopped after its layers
        seq._dense_rows = lambda *args, **kwargs: None  # type: ignore[assignment]
    if not once and a.compare == "stop":  # as before: each stage's runs end once its layers have run
        seq._stop_after = _stop_after_layers
    if not once and a.compare == "memory":  # as before: a new sum per layer each batch, LU through an identity
        seq._Sums.add = _add_per_layer
        seq.fitted_map = _fitted_map_lu
    if not once and a.compare == "threads":  # as before: one BLAS thread a layer, however few the stage's layers
        from auditor.calibration.statistics import whiten

        real = whiten.on_every_core
        whiten.on_every_core = lambda fn, items, jobs=None, share=False: real(fn, items, jobs)
    if not once and a.compare == "refine":  # as before: the closed forms and the fitted weights held
        seq._Fitter.refine = _refine_held
    peaks = _refine_peaks(seq) if a.compare == "refine" else []
    products = f"/tmp/sequential_capture_{os.getpid()}.npz" if a.compare in ("memory", "threads") else None
    got = timed_fit(model, plan, cal, a.refine, products)
    if a.compare == "refine":
        got["peak"] = max(peaks, default=0)
    print(json.dumps({**got, "products": products}))


def _refine_peaks(seq):
    """Each block refinement's peak RSS above the RSS as it began (the high-water mark reset then), recorded."""
    from _util import proc_status

    peaks = []
    real = seq._Fitter.refine

    def refine(self, *args, **kwargs):
        Path("/proc/self/clear_refs").write_text("5")
        base = proc_status("VmRSS")
        try:
            return real(self, *args, **kwargs)
        finally:
            peaks.append(proc_status("VmHWM") - base)
    seq._Fitter.refine = refine
    return peaks


def _refine_held(self, blk, prefix, stage_layers, inputs, targets, masks):  # sequential._Fitter.refine before 12-08
    from auditor import kinds
    from auditor.calibration.statistics import sequential as seq

    planned = []
    for layer in stage_layers:
        path, attr = kinds.for_kind(layer.kind).module_path(layer)
        if layer.name in self.out and not isinstance(self.out[layer.name], seq.Refined) and path.startswith(prefix):
            planned.append((layer, f"{path[len(prefix):]}.{attr}", self.out[layer.name].factors(
                self.plan[layer.name][1])))
    with seq._weights(self.model, self.layers, self.fitted):
        done = seq.refine_block(blk, planned, seq.Batches(inputs, targets, masks), seq.hidden_state, self.epochs,
                                device=self.device)
    for name, refined in done.items():
        self.out[name] = refined
        self.fitted[name] = refined.weight(self.plan[name][1])


def _fitted_map_lu(f, cross, gram, ridge):  # statistics/sequential.py's fitted_map before 2026-12-07's change
    import numpy as np

    n = gram.shape[0]
    scale = float(np.mean(np.diagonal(gram))) if n else 0.0
    lam = ridge * scale if scale > 0 else ridge
    eye = np.eye(n)
    g = (gram + gram.T) / 2 + lam * eye
    rhs = (cross.T + lam * eye) @ f.T
    return np.linalg.solve(g, rhs).T, lam


def _add_per_layer(self, pairs):  # statistics/sequential.py's _Sums.add before 2026-12-07's change
    from auditor.calibration.statistics import sequential as seq

    done = {}

    def product(a, b):
        if (id(a), id(b)) not in done:
            done[(id(a), id(b))] = seq._product(a, b)
        return done[(id(a), id(b))]

    for name, (x, xh) in pairs.items():
        c, g = product(x, xh), product(xh, xh)
        self.cross[name] = self.cross[name] + c if name in self.cross else c
        self.gram[name] = self.gram[name] + g if name in self.gram else g
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]


def _stop_after_layers(model, stage, stop):  # the runner statistics/sequential.py had before 2026-12-07's change
    import contextlib

    from auditor import kinds
    from auditor.calibration.statistics import sequential as seq

    mods = {id(m): m for m in (model.get_submodule(kinds.for_kind(l.kind).module_path(l)[0]) for l in stage)}
    ran: set[int] = set()

    def after(mod, _a, _o):
        ran.add(id(mod))
        if len(ran) == len(mods):
            raise seq._StageRead

    @contextlib.contextmanager
    def runner():
        handles = [m.register_forward_hook(after) for m in mods.values()] if stop else []

        def call(fn):
            ran.clear()
            try:
                fn()
            except seq._StageRead:
                pass
        try:
            yield call
        finally:
            for h in handles:
                h.remove()
    return runner()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--refine", type=int, default=0)
    ap.add_argument("--compare", choices=("dense", "stop", "memory", "threads", "refine"), default="dense")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare == "refine" and args.refine < 1:
        ap.error("--compare refine compares the block refinement: give --refine 1 or more")
    if args.child is not None:
        return child(args, bool(args.child))
    got = []
    for once in (1, 0):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(once)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        got.append(json.loads(out))
    new, old = got
    if args.compare in ("memory", "threads"):
        import numpy as np

        a, b = np.load(new["products"]), np.load(old["products"])
        worst = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b.files)
        assert set(a.files) == set(b.files) and worst < 1e-4, f"the factors differ beyond rounding: {worst:.2g}"
        print(f"each layer's A B equal to {worst:.1g} of its largest entry")
        os.remove(new["products"]), os.remove(old["products"])
    else:
        assert new["digest"] == old["digest"], "the factors differ between the two sides"
    print(f"hidden {args.hidden}, depth {args.depth}, {args.rows} x {args.tokens} positions, refine {args.refine}")
    print(f"{'':<34}{'wall':>9}{'peak RSS':>12}")
    now, before = {"dense": ("one dense run a block (now)", "a dense run a stage (before)"),
                   "stop": ("stage runs end at its last layer", "stage runs end after its layers"),
                   "memory": ("sums and solve in place", "a sum a layer, LU via an identity"),
                   "threads": ("a lone layer on every core", "one BLAS thread a layer"),
                   "refine": ("closed forms on disk while refining", "closed forms held (peak: refining)")}[args.compare]
    print(f"{now:<34}{new['wall']:>8.1f}s{new['peak'] / 2**20:>8,.0f} MiB")
    print(f"{before:<34}{old['wall']:>8.1f}s{old['peak'] / 2**20:>8,.0f} MiB")
    print(f"{'now / before':<34}{new['wall'] / old['wall']:>8.2f}x{new['peak'] / max(1, old['peak']):>11.2f}x"
          + ("" if args.compare in ("memory", "threads") else "  (equal factors checked)"))


if __name__ == "__main__":
    main()
