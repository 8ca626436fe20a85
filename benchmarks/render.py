"""Render times for 100, 1,000 and 10,000 layers: HTML (goal < 2 s for 1,000) and PDF (goal < 20 s for 1,000;
bounded beyond: the PDF caps its tables and lists, and cuts names longer than 96 characters), with the PDF's peak
resident memory; and a PDF with one 10,000-character layer name (its time must not grow with the name's length).

The models are stacks of repeated blocks (``blocks.N.up`` / ``blocks.N.down``, 128 <-> 256) plus distinct layers, so
the grouped table, the group pages and a page per layer are all exercised; spectra are computed once per model
(not timed). Both the HTML's and the PDF's layer pages are inline SVG drawn by the templates (the PDF carries the top
pages only).

    python benchmarks/render.py            # 100 and 1,000 layers, all formats, and the long name
    python benchmarks/render.py 10000      # the PDF alone for the sizes given
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import PeakSampler, best  # noqa: E402

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

    t_pdf, mb, pages = pdf_time(a)
    t_md = best(a.to_markdown, repeat=3)
    t_json = best(a.to_json, repeat=3)
    t_text = best(a.to_text, repeat=3)
    print(f"{len(a.layers)} layers ({len(a.groups())} groups): audit {t_audit:.2f}s | HTML {t_html:.2f}s "
          f"({size / 1e6:.1f} MB; goal < 2 s) | PDF {t_pdf:.2f}s, {pages} pages, +{mb:.0f} MB peak RSS (goal < 20 s) | Markdown "
          f"{t_md * 1000:.0f} ms ({len(a.to_markdown()):,} chars) | text {t_text * 1000:.0f} ms | "
          f"JSON {t_json * 1000:.0f} ms", flush=True)


def pdf_time(a: "auditor.Audit") -> tuple[float, float, int | None]:
    """Seconds for one PDF, the resident memory it added at its peak (MB), and its page count."""
    from auditor.render.pdf import render_pdf

    with PeakSampler() as peak:
        t0 = time.perf_counter()
        pdf = render_pdf(a)
        t = time.perf_counter() - t0
    pages = None
    try:
        import pypdf

        pages = len(pypdf.PdfReader(io.BytesIO(pdf)).pages)
    except ImportError:
        pass
    return t, peak.increase, pages


def pdf_only(n: int) -> None:
    a = auditor.audit(Blocks(n), torch.randn(4, 128), cache=False, progress=False)
    t, mb, pages = pdf_time(a)
    print(f"{len(a.layers)} layers: PDF {t:.2f}s, {pages} pages, +{mb:.0f} MB peak RSS", flush=True)


def long_name(chars: int = 10_000) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("x" * chars, nn.Linear(64, 96))
    model.add_module("out", nn.Linear(96, 8))
    a = auditor.audit(model, torch.randn(2, 64), cache=False, progress=False)
    t, mb, pages = pdf_time(a)
    print(f"one {chars:,}-character name: PDF {t:.2f}s, {pages} pages, +{mb:.0f} MB peak RSS", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        for n in map(int, sys.argv[1:]):
            pdf_only(n)
        return
    for n in (100, 1000):
        one(n)
    long_name()


if __name__ == "__main__":
    main()
