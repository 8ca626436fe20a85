"""Render times for 100 and 1,000 layers: HTML (goal < 2 s for 1,000) and PDF (goal < 20 s for 1,000).

The models are stacks of repeated blocks (``blocks.N.up`` / ``blocks.N.down``, 128 <-> 256) plus distinct layers, so
the grouped table, the group pages and a page per layer are all exercised; spectra are computed once per model
(not timed). The HTML's per-layer pages are inline SVG drawn by the template; the PDF draws matplotlib charts for
its top pages only.

    python benchmarks/render.py
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best  # noqa: E402

import auditor  # noqa: E402


class Blocks(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        pairs = n_layers // 2 - 5
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(128, 256), "down": nn.Linear(256, 128)})
                                    for _ in range(pairs))
        self.extra = nn.ModuleDict({f"proj_{c}": nn.Linear(128, 128) for c in "abcdefghij"})

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](torch.relu(b["up"](x)))
        for m in self.extra.values():
            x = m(x)
        return x


def one(n: int) -> None:
    model = Blocks(n)
    t0 = time.perf_counter()
    a = auditor.audit(model, torch.randn(4, 128), cache=False, progress=False)
    t_audit = time.perf_counter() - t0
    t_html = best(a.to_html, repeat=2)
    size = len(a.to_html())
    from auditor.render.pdf import render_pdf

    t_pdf = best(lambda: render_pdf(a), repeat=1)
    pages = None
    try:
        import pypdf

        pages = len(pypdf.PdfReader(io.BytesIO(render_pdf(a))).pages)
    except ImportError:
        pass
    t_md = best(a.to_markdown, repeat=3)
    t_json = best(a.to_json, repeat=3)
    t_text = best(a.to_text, repeat=3)
    print(f"{len(a.layers)} layers ({len(a.groups())} groups): audit {t_audit:.2f}s | HTML {t_html:.2f}s "
          f"({size / 1e6:.1f} MB; goal < 2 s) | PDF {t_pdf:.2f}s, {pages} pages (goal < 20 s) | Markdown "
          f"{t_md * 1000:.0f} ms ({len(a.to_markdown()):,} chars) | text {t_text * 1000:.0f} ms | "
          f"JSON {t_json * 1000:.0f} ms", flush=True)


def main() -> None:
    for n in (100, 1000):
        one(n)


if __name__ == "__main__":
    main()
