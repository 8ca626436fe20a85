"""A 7B-size Llama config audited for structure on the meta device: wall time and peak memory (goal: < 10 s, < 2 GB).

    python benchmarks/structure_7b.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import peak_rss_mb  # noqa: E402


def main() -> None:
    t0 = time.perf_counter()
    before = peak_rss_mb()
    import torch
    import transformers

    import auditor

    t_import = time.perf_counter() - t0
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, vocab_size=32000, use_cache=False)
    t1 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    a = auditor.audit(model)
    t_audit = time.perf_counter() - t2
    t3 = time.perf_counter()
    html = a.to_html()
    t_html = time.perf_counter() - t3
    print(f"Llama 7B on meta: {a.total_params:,} parameters in {len(a.layers)} factorizable layers; "
          f"{a.layers_holding(0.8)} hold 80%")
    print(f"imports {t_import:.2f}s, build on meta {t_build:.2f}s, audit {t_audit:.2f}s, HTML {t_html:.2f}s "
          f"({len(html) / 1e6:.1f} MB); audit+build {t_build + t_audit:.2f}s (goal < 10 s)")
    ids = {"input_ids": torch.zeros(1, 128, dtype=torch.long, device="meta")}
    t4 = time.perf_counter()
    b = auditor.audit(model, ids)
    t_macs = time.perf_counter() - t4
    print(f"with input_ids[1, 128] on meta: {b.trace_method} in {t_macs:.2f}s, {b.total_macs:,} MACs per forward "
          f"(weight ops)")
    print(f"peak RSS {peak_rss_mb():.0f} MB (goal < 2048 MB; {before:.0f} MB before imports); "
          f"a float32 copy of the weights would be {a.total_params * 4 / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
