"""Tier 1 of a Llama-2-7B-shaped model on a GPU: peak GPU memory and time (one prepared script).

    python benchmarks/gpu_llama7b.py                      # 7B shape, fp16, 128 windows x 2048 tokens, --device cuda
    python benchmarks/gpu_llama7b.py --offload            # weights on the CPU, each block on the GPU while it runs
    python benchmarks/gpu_llama7b.py --tiny               # a small config on the CPU: checks the script itself

``transformers.LlamaForCausalLM`` from a config (hidden 4096, 32 layers, 32 heads, 32 key-value heads, intermediate
11008, vocabulary 32000), random weights in float16 (cost only, never quality), built on the meta device and
materialized on the device (or, with --offload, on the CPU). Tier 1 = ``stream_statistics`` (block by block, each
batch's X^T X in float32 added into a float64 sum on the device) with every block's whitened spectra computed in the
callback and its Grams dropped: on the device, as the audit makes them there (statistics/ondevice.py, float64), or
with ``--host-spectra`` on the CPU's NumPy as before. The first block's spectra are made both ways once
(``--check-block``, -1 for none): their times side by side and the largest difference of their error curves, which
must be float64 rounding, and their ranks, which must be equal. Prints the time of statistics and spectra, peak GPU
memory (``torch.cuda.max_memory_allocated``) and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small config on the CPU (hidden 256, 2 layers, 8 x 128)")
    ap.add_argument("--offload", action="store_true", help="keep weights on the CPU, one block on the GPU at a time")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    ap.add_argument("--windows", type=int, default=None, help="default 128 (8 with --tiny)")
    ap.add_argument("--tokens", type=int, default=None, help="default 2048 (128 with --tiny)")
    ap.add_argument("--batch", type=int, default=8, help="windows per batch (default 8)")
    ap.add_argument("--host-spectra", action="store_true", help="the spectra on the CPU's NumPy (as before)")
    ap.add_argument("--check-block", type=int, default=0, help="this block's spectra made both ways (-1: none)")
    a = ap.parse_args()

    import torch
    import transformers

    from auditor.calibration.data.inputs import Batch
    from auditor.calibration.statistics.ondevice import on
    from auditor.calibration.statistics.stream import resolve_device, stream_statistics
    from auditor.calibration.statistics.whiten import whitened_spectra
    from auditor.errors import AuditError
    from auditor.structure.layers import ParamTable, collect_layers

    try:
        dev = resolve_device(a.device or ("cpu" if a.tiny else "cuda"))
    except AuditError as e:
        sys.exit(f"error: {e}")
    if a.tiny:
        shape = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=8, vocab_size=1000)
        windows, tokens, dtype = a.windows or 8, a.tokens or 128, torch.float32
    else:
        shape = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000)
        windows, tokens, dtype = a.windows or 128, a.tokens or 2048, torch.float16
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=max(tokens, 2048))
    home = torch.device("cpu") if a.offload else dev
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device=home).to(dtype).eval()
    g = torch.Generator(device=home).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for name, buf in model.named_buffers():  # rotary inverse frequencies were left empty by to_empty
            if name.endswith("inv_freq"):
                dim = buf.numel() * 2
                base = float(getattr(cfg, "rope_theta", None) or 10000.0)
                buf.copy_(1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=buf.device) / dim))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:,.1f} M parameters in {dtype}, on {home}; built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    layers = collect_layers(model, ParamTable.of(model))
    table = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    ids = torch.randint(0, cfg.vocab_size, (windows, tokens), generator=torch.Generator().manual_seed(1))
    batches = [Batch(kwargs={"input_ids": ids[i:i + a.batch]}) for i in range(0, windows, a.batch)]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    spectra = 0
    t_spec = 0.0
    where = None if a.host_spectra or dev.type == "cpu" and not a.tiny else on(dev)

    def on_block(i, st):
        nonlocal spectra, t_spec
        t = time.perf_counter()
        got = whitened_spectra(layers, table, st, decomposer=where)
        t_spec += time.perf_counter() - t
        spectra += len(got)
        if i == a.check_block and where is not None:
            t_here = time.perf_counter()
            here = whitened_spectra(layers, table, st)
            t_here = time.perf_counter() - t_here
            diff = max((max(abs(x - y) for x, y in zip(got[k].error, here[k].error)) for k in here), default=0.0)
            same = all(got[k].ranks_for == here[k].ranks_for for k in here)
            print(f"  block {i}'s spectra: {time.perf_counter() - t - t_here:.1f} s on {dev}, {t_here:.1f} s on the "
                  f"CPU; error curves equal to {diff:.1e}, ranks {'equal' if same else 'DIFFERENT'}", flush=True)
        print(f"  block {i}: {len(st.layers)} layers, {time.perf_counter() - t1:.1f} s so far", flush=True)

    t1 = time.perf_counter()
    stream_statistics(model, layers, batches, device=dev, offload=a.offload, keep=False, on_block=on_block)
    total = time.perf_counter() - t1
    print(f"tier 1: {windows} x {tokens} tokens, {spectra} whitened spectra of {len(layers)} layers in {total:.1f} s "
          f"(statistics {total - t_spec:.1f} s, spectra {t_spec:.1f} s on {'the CPU' if where is None else dev})")
    if dev.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
