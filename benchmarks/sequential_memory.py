"""The sequential fit's memory as depth grows: a finished block's factors and fitted weights spilled to
memory-mapped files, and a layer's decomposition dropped once its rank's factors are taken (statistics/sequential.py,
what the audit's verification and ``factorize`` run), against every planned layer's decomposition and fitted weight
kept in the heap (what the tool did before), side by side in one run.

    PYTHONPATH=. python benchmarks/sequential_memory.py [--depths 2 4 8] [--refine 1]

Random-init Llama configs (hidden 512, intermediate 1376, vocabulary 2048, 8/4 heads), 64 windows of 128 random
token ids (cost only); the plan keeps every Linear of the blocks at half its break-even rank. Each measurement runs
in its own process, its high-water mark RSS reset once the model and calibration are loaded (Linux's
/proc/self/clear_refs); printed: the model's weights, each side's peak above the RSS then, the ratio, and how each
grows from the first depth to the last against the weights' growth. The two sides' factors must be equal (checked
through a digest, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _util import timed_fit  # noqa: E402


def child(depth: int, refine: int, spill: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from auditor.calibration import load_calibration
    from auditor.calibration.statistics import sequential as seq
    from auditor.structure.layers import ParamTable, collect_layers
    from auditor.surgery import checked_plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1376, num_hidden_layers=depth,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 2048, (64, 128), generator=torch.Generator().manual_seed(1))
    cal = load_calibration({"input_ids": ids}, model, holdout=0.25, batch_size=8)
    table = ParamTable.of(model)
    ranks = {}
    for name, layer in collect_layers(model, table).items():
        if ".layers." in name:
            m, n = layer.shape[0], layer.shape[1]
            ranks[name] = max(1, int(m * n / (m + n) / 2))
    plan = checked_plan(model, ranks)
    if not spill:  # as before: every planned layer's truncator (its whole decomposition) kept, nothing spilled
        seq._Fitter.spill = lambda self, layers: None  # type: ignore[method-assign]
        seq.Truncator.pinned = lambda self, rank: self  # type: ignore[method-assign]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"weights": weights, **timed_fit(model, plan, cal, refine)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--refine", type=int, default=1)
    ap.add_argument("--child", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    print(f"{'depth':>5}{'weights':>11}{'spilled: peak':>16}{'in the heap':>14}{'ratio':>8}{'wall':>18}")
    rows = []
    for depth in args.depths:
        got = []
        for spill in (1, 0):
            cmd = [sys.executable, __file__, "--child", str(depth), str(args.refine), str(spill)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            got.append(json.loads(out))
        s, k = got
        assert s["digest"] == k["digest"], f"depth {depth}: the spilled fit's factors differ"
        rows.append((depth, s, k))
        print(f"{depth:>5}{s['weights'] / 2**20:>7,.0f} MiB{s['peak'] / 2**20:>12,.0f} MiB{k['peak'] / 2**20:>10,.0f} MiB"
              f"{k['peak'] / max(1, s['peak']):>7.2f}x{s['wall']:>8.1f}s /{k['wall']:>6.1f}s")
    if len(rows) > 1:
        (d0, s0, k0), (d1, s1, k1) = rows[0], rows[-1]
        print(f"from depth {d0} to {d1}: weights x{s1['weights'] / s0['weights']:.2f}, peak spilled "
              f"x{s1['peak'] / max(1, s0['peak']):.2f}, in the heap x{k1['peak'] / max(1, k0['peak']):.2f} "
              "(equal factors checked)")


if __name__ == "__main__":
    main()
