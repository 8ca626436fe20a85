"""Tier 1 on Llama-shaped models: peak resident memory and wall time, block by block against one pass.

    python benchmarks/llm_calibration.py                 # width 1024 at depth 2, 4 and 8: streaming vs one pass
    python benchmarks/llm_calibration.py --tinyllama     # ... and the TinyLlama-shaped 1.1B config in bf16
    python benchmarks/llm_calibration.py --only tinyllama --cap-gb 24 --timeout 600

The models are ``transformers.LlamaForCausalLM`` built from configs here with random weights (no model hub): this
measures cost only, never quality. Width 1024, 16 query / 4 key-value heads, intermediate 2816, vocabulary 32000,
fed 24 windows of 128 random token ids (batches of 4); the 1.1B config (hidden 2048, 22 layers, 32 heads, 4 key-value
heads, intermediate 5632, vocabulary 32000) in bfloat16, fed 64 windows of 256 tokens (batches of 4), read with
``compute_dtype="float32"`` (``--compute-dtype float32``): this CPU multiplies bf16 at 0.36 GFLOPS against 102 in
float32, so each block is upcast while it runs and the weights stay bf16 in memory.

Tier 1 is the input statistics and every layer's whitened spectrum:
- streaming: the audit's own path, ``CalibrationSession.statistics(spectra=...)`` without a cache: the statistics
  stream block by block, each block's whitened spectra are computed as its statistics complete, and its Grams are
  spilled to a temporary directory (one ``.npy`` per distinct Gram), so one block's Grams are in memory at a time;
- one pass: ``input_statistics`` (every Gram alive), then ``whitened_spectra``.
Each configuration runs in a fresh subprocess under an address-space cap (``resource.setrlimit(RLIMIT_AS)``); its
peak RSS is the child's ``ru_maxrss``. The summary line: the growth of peak RSS from depth 2 to depth 8 over the
growth of the weights' bytes (goal: at most 1.3x for streaming).

The whole audit (``--modes audit``, the default): ``auditor.audit`` with the calibration given as the batches of 4
windows (``cache=False``: nothing read from or written to the statistics cache), the default calibrated audit as a
user runs it: statistics and tier 1, gradient sensitivity, tier 3's plan search, the verification and the plan
check. Its peak RSS is printed beside the weights' bytes, with each stage's own peak (sampled every 5 ms in a
thread; a stage is a progress phase), and the summary line gives the growth ratio from depth 2 to depth 8 (goal:
at most 1.3x the weights' growth, issue 28).

    python benchmarks/llm_calibration.py --modes audit --depths 2,4,8    # the whole audit (a few minutes a depth)
    python benchmarks/llm_calibration.py --modes stream,onepass           # tier 1 alone, both ways
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "d2": dict(hidden=1024, layers=2, heads=16, kv=4, inter=2816, vocab=32000, windows=24, tokens=128, dtype="float32"),
    "d4": dict(hidden=1024, layers=4, heads=16, kv=4, inter=2816, vocab=32000, windows=24, tokens=128, dtype="float32"),
    "d8": dict(hidden=1024, layers=8, heads=16, kv=4, inter=2816, vocab=32000, windows=24, tokens=128, dtype="float32"),
    "tinyllama": dict(hidden=2048, layers=22, heads=32, kv=4, inter=5632, vocab=32000, windows=64, tokens=256,
                      dtype="bfloat16", compute="float32"),
}
BATCH = 4


def build(c: dict):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=c["hidden"], intermediate_size=c["inter"],
                                   num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                   num_key_value_heads=c["kv"], vocab_size=c["vocab"],
                                   max_position_embeddings=max(2048, c["tokens"]))
    torch.manual_seed(0)
    dtype = getattr(torch, c["dtype"])
    torch.set_default_dtype(dtype)
    try:
        model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c["vocab"], (c["windows"], c["tokens"]), generator=g)
    return model, ids


def child(name: str, mode: str, over: dict | None = None) -> dict:
    import resource

    import torch

    from auditor.calibration.data.inputs import Batch
    from auditor.calibration.statistics.stats import input_statistics
    from auditor.calibration.statistics.stream import stream_statistics
    from auditor.calibration.statistics.whiten import whitened_spectra
    from auditor.structure.layers import ParamTable, collect_layers

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    c = {**CONFIGS[name], **(over or {})}
    model, ids = build(c)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = collect_layers(model, ParamTable.of(model))
    table = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    batches = [Batch(kwargs={"input_ids": ids[i:i + BATCH]}) for i in range(0, len(ids), BATCH)]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    done = 0
    stages: dict[str, float] = {}
    if mode == "audit":  # the whole default calibrated audit, as a user runs it
        done, stages = _audit(model, ids, batches)
    elif mode == "stream":  # the audit's path: the session streams, whitens per block and spills the Grams
        from auditor.calibration.data.inputs import Calibration
        from auditor.calibration.session import CalibrationSession
        from auditor.options import AuditOptions

        cal = Calibration(batches, [], "benchmark", digest=f"bench-{name}")
        session = CalibrationSession(model, cal, layers=layers,
                                     options=AuditOptions(cache=False, compute_dtype=c.get("compute")))
        session.statistics(spectra=(8, 0.01))
        done = len(session.spectra(8, 0.01))
    else:
        stats = input_statistics(model, layers, batches)
        done = len(whitened_spectra(layers, table, stats))
        grams = [inp.gram for inp in stats.layers.values()]
        distinct = {id(g): g.nbytes for g in grams}
        shared = (sum(distinct.values()) / 2**20, sum(g.nbytes for g in grams) / 2**20)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"name": name, "mode": mode, "vocab": c["vocab"], "windows": c["windows"], "weights_mib": weights / 2**20, "peak_mib": peak / 1024,
            "before_mib": base / 1024, "seconds": seconds, "spectra": done, "layers": len(layers), "stages": stages,
            **({"grams_mib": shared} if mode == "onepass" else {})}


def _audit(model, ids, batches) -> tuple[int, dict[str, float]]:
    """``auditor.audit`` with the calibration as its batches: (layers in the suggested plan, each stage's peak RSS
    in MiB). A stage is a progress phase; the RSS is sampled every 5 ms in a thread."""
    import contextlib
    import threading

    import auditor
    from auditor import progress as prog

    stage = ["before"]
    peaks: dict[str, float] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with open("/proc/self/statm") as fh:
                rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            peaks[stage[0]] = max(peaks.get(stage[0], 0.0), rss)
            time.sleep(0.005)

    phase = prog.Progress.phase

    @contextlib.contextmanager
    def named(self, name, *a, **k):  # the stage sampled while the phase runs, "between" after it
        stage[0] = name
        try:
            with phase(self, name, *a, **k) as p:
                yield p
        finally:
            stage[0] = "between"

    prog.Progress.phase = named
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        a = auditor.audit(model, {"input_ids": ids[:1]}, calibration=[b.kwargs for b in batches], cache=False)
    finally:
        stop.set()
        th.join()
        prog.Progress.phase = phase
    budget = a.calibration.budget if a.calibration is not None else None
    return (len(budget.plan) if budget is not None else 0), peaks


def run(name: str, mode: str, cap_gb: float, timeout: float, over: dict | None = None) -> dict:
    from _util import run_capped

    return run_capped("llm_calibration", f"child({name!r},{mode!r},{over!r})", cap_gb, timeout, str(ROOT),
                      {"name": name, "mode": mode})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tinyllama", action="store_true", help="also the 1.1B bf16 config (streaming only)")
    ap.add_argument("--only", choices=["depths", "tinyllama"], help="one part")
    ap.add_argument("--cap-gb", type=float, default=24.0, help="address-space cap of each subprocess (default 24)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per configuration (default 1500: the whole "
                    "audit at depth 8 took 528 s on the loaded 2-core VM)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--depths", default="2,4,8", help="depths of the width-1024 configs (default 2,4,8)")
    ap.add_argument("--vocab", type=int, help="vocabulary of the width-1024 configs (default 32000)")
    ap.add_argument("--windows", type=int, help="calibration windows of the width-1024 configs (default 24)")
    ap.add_argument("--tiny-windows", type=int, help="calibration windows of the 1.1B config (default 64)")
    ap.add_argument("--modes", default="audit", help="which of audit,stream,onepass to run (default audit: the whole "
                    "default calibrated audit)")
    a = ap.parse_args()
    over = {k: v for k, v in (("vocab", a.vocab), ("windows", a.windows)) if v is not None}
    tiny = {"windows": a.tiny_windows} if a.tiny_windows else {}
    if over:
        print(f"width-1024 configs with {over} instead of the defaults "
              f"(vocab {CONFIGS['d2']['vocab']}, windows {CONFIGS['d2']['windows']})", flush=True)
    if tiny:
        print(f"1.1B config with {tiny['windows']} windows of 256 tokens instead of 64", flush=True)
    rows = []
    if a.only != "tinyllama":
        for name in (f"d{d.strip()}" for d in a.depths.split(",")):
            for mode in a.modes.split(","):
                r = run(name, mode, a.cap_gb, a.timeout, over)
                rows.append(r)
                _print(r)
        for mode in ("audit", "stream", "onepass"):
            lo = next((r for r in rows if r["name"] == "d2" and r["mode"] == mode), None)
            hi = next((r for r in rows if r["name"] == "d8" and r["mode"] == mode), None)
            if lo is None or hi is None or "error" in lo or "error" in hi:
                continue
            grow = hi["peak_mib"] - lo["peak_mib"]
            wgrow = hi["weights_mib"] - lo["weights_mib"]
            print(f"{mode:8s} depth 2 -> 8: peak RSS +{grow:,.0f} MiB for +{wgrow:,.0f} MiB of weights: "
                  f"{grow / wgrow:.2f}x" + ("  (goal <= 1.3x)" if mode in ("stream", "audit") else ""))
    if a.tinyllama or a.only == "tinyllama":
        rows.append(run("tinyllama", "stream", a.cap_gb, a.timeout, tiny))
        _print(rows[-1])
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def _print(r: dict) -> None:
    if "error" in r:
        print(f"{r['name']:9s} {r['mode']:8s} {r['error']}", flush=True)
        return
    if r["mode"] == "audit":
        print(f"{r['name']:9s} {r['mode']:8s} weights {r['weights_mib']:8,.0f} MiB  "
              f"peak RSS {r['peak_mib']:8,.0f} MiB  audit {r['seconds']:7.1f} s  ({r['spectra']} of {r['layers']} layers in the plan)", flush=True)
        print("          " + "  ".join(f"{k} {v:,.0f}" for k, v in r["stages"].items()), flush=True)
        return
    print(f"{r['name']:9s} {r['mode']:8s} weights {r['weights_mib']:8,.0f} MiB  peak RSS {r['peak_mib']:8,.0f} MiB  "
          f"tier 1 {r['seconds']:7.1f} s  ({r['spectra']} spectra of {r['layers']} layers)"
          + (f"  Grams {r['grams_mib'][0]:,.0f} MiB (one per layer: {r['grams_mib'][1]:,.0f})" if "grams_mib" in r
             else ""), flush=True)


if __name__ == "__main__":
    main()
