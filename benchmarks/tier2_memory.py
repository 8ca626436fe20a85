"""Tier 2 on small Llama-shaped models: peak resident memory of the measured floors, prefix cache unbounded vs bounded.

    python benchmarks/tier2_memory.py                     # depth 2, 4 and 8; modes unbounded, bounded
    git archive COMMIT auditor | tar -x -C /tmp/before     # a checkout of the package before the bounded cache
    python benchmarks/tier2_memory.py --before /tmp/before  # ... and mode "before" run on it

The models are ``transformers.LlamaForCausalLM`` built from a config here with random weights (cost only, never
quality): hidden 256, intermediate 688, vocabulary 2048, 4 query / 2 key-value heads, fed 8 calibration windows and
``--windows`` held-out windows (default 24) of 256 random token ids in batches of 4. Tier 2 measures the floor of the
last block's down_proj (bisection over multiples of 32, the default perplexity metric): every earlier block's output
is a prefix-cache candidate, so the unbounded cache grows with the depth.

Modes, each in a fresh subprocess (its peak RSS is the child's ``ru_maxrss``; "sweep +" is that peak less the RSS
peak before the sweep started: the sweep's own memory, without the interpreter's and the libraries' noise):
- ``before`` (with ``--before DIR``): the package in DIR (imported instead of this one) with its defaults: there
  the sweeper worked on a deep copy of the model and stored every candidate module's output of every held-out batch;
- ``copy``: a deep copy of the model kept alive beside the sweep (what a working copy costs), prefix cache unbounded;
- ``unbounded``: in place, the prefix cache unbounded (``prefix_cache_bytes=2**40``);
- ``bounded``: in place, the prefix cache at ``--budget-mib`` (default 4 MiB).
The floors of every mode are printed; they must be equal (the budget changes the time, never the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(hidden=256, inter=688, vocab=2048, heads=4, kv=2, tokens=256, fit=8)
BATCH = 4


def child(depth: int, mode: str, windows: int, budget_mib: float) -> dict:
    import copy
    import resource

    import torch
    import transformers

    from auditor.calibration.data.inputs import Batch, Calibration
    from auditor.calibration.statistics.stats import by_name
    from auditor.calibration.tiers.sweep import measure_floors
    from auditor.structure.layers import ParamTable, collect_layers

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    c = BASE
    cfg = transformers.LlamaConfig(hidden_size=c["hidden"], intermediate_size=c["inter"], num_hidden_layers=depth,
                                   num_attention_heads=c["heads"], num_key_value_heads=c["kv"],
                                   vocab_size=c["vocab"], max_position_embeddings=c["tokens"], use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c["vocab"], (c["fit"] + windows, c["tokens"]), generator=g)
    batches = [Batch(kwargs={"input_ids": ids[i:i + BATCH]}) for i in range(0, len(ids), BATCH)]
    fit = c["fit"] // BATCH
    cal = Calibration(batches[:fit], batches[fit:], "benchmark", digest=f"tier2-bench-{depth}-{windows}")
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    last = depth - 1
    swept = [layers[f"model.layers.{last}.mlp.down_proj"]]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held = copy.deepcopy(model) if mode == "copy" else None
    budget = 2**40 if mode in ("copy", "unbounded") else int(budget_mib * 2**20)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    if mode == "before":  # the old package: no budget keyword, its own copy of the model
        floors = measure_floors(model, swept, cal, align=32)
    else:
        floors = measure_floors(model, swept, cal, align=32, prefix_cache_bytes=budget)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del held
    return {"depth": depth, "mode": mode, "weights_mib": weights / 2**20, "peak_mib": peak / 1024,
            "before_mib": base / 1024, "seconds": seconds, "evaluations": floors.evaluations,
            "floors": {k: f.floor for k, f in floors.floors.items()},
            "points": {k: f.points for k, f in floors.floors.items()},
            "held_out_tokens": windows * c["tokens"]}


def run(depth: int, mode: str, windows: int, budget_mib: float, cap_gb: float, timeout: float,
        before: str = "") -> dict:
    from _util import run_capped

    root = before if mode == "before" else str(ROOT)
    return run_capped("tier2_memory", f"child({depth!r},{mode!r},{windows!r},{budget_mib!r})", cap_gb, timeout, root,
                      {"depth": depth, "mode": mode})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="2,4,8", help="decoder blocks (default 2,4,8)")
    ap.add_argument("--modes", default="unbounded,bounded",
                    help="which of before,copy,unbounded,bounded to run (default unbounded,bounded; with --before: "
                         "before,unbounded,bounded)")
    ap.add_argument("--before", metavar="DIR", default="", help="a folder holding an older auditor package")
    ap.add_argument("--windows", type=int, default=24, help="held-out windows of 256 tokens (default 24)")
    ap.add_argument("--budget-mib", type=float, default=4.0, help="the bounded prefix cache's budget (default 4)")
    ap.add_argument("--cap-gb", type=float, default=8.0, help="address-space cap of each subprocess (default 8)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration (default 300)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    modes = a.modes.split(",")
    if a.before and "before" not in modes:
        modes.insert(0, "before")
    if "before" in modes and not (Path(a.before) / "auditor").is_dir():
        ap.error("mode before needs --before DIR, a folder holding an auditor package")
    rows = []
    for d in depths:
        for mode in modes:
            r = run(d, mode, a.windows, a.budget_mib, a.cap_gb, a.timeout, a.before)
            rows.append(r)
            if "error" in r:
                print(f"depth {d} {mode:9s} {r['error']}", flush=True)
                continue
            print(f"depth {d} {mode:9s} weights {r['weights_mib']:6.1f} MiB  peak RSS {r['peak_mib']:7.1f} MiB "
                  f"(sweep +{r['peak_mib'] - r['before_mib']:5.1f})  "
                  f"tier 2 {r['seconds']:6.1f} s  {r['evaluations']} evaluations  floors {r['floors']}", flush=True)
        same = [r for r in rows if r.get("depth") == d and "points" in r]
        if len(same) > 1:
            print(f"depth {d}: every mode measured the same points: "
                  f"{all(r['points'] == same[0]['points'] for r in same)}", flush=True)
    for mode in modes:
        got = [r for r in rows if r.get("mode") == mode and "error" not in r]
        if len(got) > 1:
            lo, hi = got[0], got[-1]
            grow, wgrow = hi["peak_mib"] - lo["peak_mib"], hi["weights_mib"] - lo["weights_mib"]
            sweep = (hi["peak_mib"] - hi["before_mib"]) - (lo["peak_mib"] - lo["before_mib"])
            print(f"{mode:9s} depth {lo['depth']} -> {hi['depth']}: peak RSS +{grow:,.1f} MiB, the sweep's own growth "
                  f"+{sweep:,.1f} MiB, for +{wgrow:,.1f} MiB of weights")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
