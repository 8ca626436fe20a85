"""Peak memory of the log-probabilities: a large-vocabulary language model's gradient pass and perplexity
measurement with log-probabilities taken a chunk of positions at a time (auditor/calibration/metrics/chunks.py)
against the whole batch at once (the chunk made unbounded: what the tool did before), side by side in one run.

    PYTHONPATH=. python benchmarks/logprob_memory.py [--vocab 49152] [--rows 8] [--positions 512]

Each measurement runs in its own process, its high-water mark RSS reset once the model and its calibration are
loaded (Linux's /proc/self/clear_refs); printed: the batch's logits in MiB, each side's peak RSS above the RSS then,
its wall, and the ratio. The
gradient moments and the perplexity must be equal on both sides (checked, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> int:
    """The RSS now, with the high-water mark reset to it (Linux: 5 to /proc/self/clear_refs), so the peak read
    after is this measurement's, not the load's."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch
    import transformers

    from auditor.calibration import load_calibration
    from auditor.calibration.measure.metric import Metric
    from auditor.calibration.metrics import chunks
    from auditor.calibration.metrics.perplexity import KIND
    from auditor.calibration.statistics.stats import by_name
    from auditor.calibration.tiers.fisher import output_gradients
    from auditor.structure.layers import ParamTable, collect_layers

    torch.set_num_threads(1)
    if args.whole:
        chunks.CHUNK_VALUES = 1 << 62  # one chunk: the whole batch's log-probabilities at once
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.positions)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, args.vocab, (2 * args.rows, args.positions), generator=torch.Generator().manual_seed(1))
    cal = load_calibration({"input_ids": ids}, model, holdout=0.5, batch_size=args.rows)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    base = _reset_peak()
    t0 = time.perf_counter()
    if args.what == "gradients":
        g = output_gradients(model, layers, cal, Metric(kind="perplexity"))
        digest = float(sum(float(np.asarray(g.second[k]).sum()) for k in sorted(g.second)))
    else:
        with torch.no_grad():
            b = cal.holdout[0]
            sc = KIND.scored_positions(model(**b.kwargs).logits, b)
            digest = float(sc.picked().double().sum())
    wall = time.perf_counter() - t0
    peak = _status("VmHWM")
    print(json.dumps({"base": base, "peak": peak, "wall": wall, "digest": digest}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--what", default=None)
    ap.add_argument("--whole", action="store_true")
    args = ap.parse_args()
    if args.what:
        return child(args)
    logits = args.rows * args.positions * args.vocab * 4
    print(f"vocabulary {args.vocab:,}, batches of {args.rows} x {args.positions} positions: a batch's float32 logits "
          f"{logits / 2**20:,.0f} MiB")
    print(f"{'':<34}{'chunked: peak above base':>26}{'whole batch':>14}{'ratio':>8}{'wall':>16}")
    for what in ("gradients", "perplexity"):
        got = {}
        for whole in (False, True):
            cmd = [sys.executable, __file__, "--what", what, "--vocab", str(args.vocab), "--rows", str(args.rows),
                   "--positions", str(args.positions)] + (["--whole"] if whole else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            got[whole] = json.loads(out)
        c, w = got[False], got[True]
        assert c["digest"] == w["digest"], (what, c["digest"], w["digest"])
        dc, dw = c["peak"] - c["base"], w["peak"] - w["base"]
        label = "gradient pass (2 fit batches)" if what == "gradients" else "perplexity of one held-out batch"
        print(f"{label:<34}{dc / 2**20:>22,.0f} MiB{dw / 2**20:>10,.0f} MiB{dw / max(dc, 1):>7.2f}x"
              f"{c['wall']:>7.1f}s /{w['wall']:>5.1f}s")
    print("(peak: the high-water mark RSS above the RSS with the model and calibration loaded; equal results checked)")


if __name__ == "__main__":
    main()
