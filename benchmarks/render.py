"""Render times for a 100-layer model: HTML (goal < 2 s) and PDF (goal < 15 s), measured side by side.

    python benchmarks/render.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import best  # noqa: E402

import auditor  # noqa: E402


def hundred_layers() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(100):
        layers += [nn.Linear(128 if i % 2 == 0 else 256, 256 if i % 2 == 0 else 128), nn.ReLU()]
    return nn.Sequential(*layers)


def main() -> None:
    model = hundred_layers()
    t0 = time.perf_counter()
    a = auditor.audit(model, torch.randn(4, 128), cache=False)
    t_audit = time.perf_counter() - t0
    t_html = best(a.to_html, repeat=3)
    from auditor.render.pdf import render_pdf

    t_pdf = best(lambda: render_pdf(a), repeat=2)
    pages = None
    try:
        import io

        import pypdf

        pages = len(pypdf.PdfReader(io.BytesIO(render_pdf(a))).pages)
    except ImportError:
        pass
    t_md = best(a.to_markdown, repeat=3)
    t_json = best(a.to_json, repeat=3)
    print(f"{len(a.layers)} layers: audit {t_audit:.2f}s")
    print(f"HTML {t_html:.2f}s (goal < 2 s) | PDF {t_pdf:.2f}s, {pages} pages (goal < 15 s) | "
          f"Markdown {t_md * 1000:.0f} ms | JSON {t_json * 1000:.0f} ms | PDF/HTML {t_pdf / t_html:.1f}x")


if __name__ == "__main__":
    main()
