"""Model factory files that the command-line tests write: a tiny MLP whose hidden layers have a known low rank.

``tests/test_hardening_*.py`` and ``tests/corpus/make_corpus.py`` audit it through the command line, so it is source
text (a ``path:model`` factory), not a module object.

>>> print(low_rank_mlp((4, 6, 2), rank=1, batch=2))
<BLANKLINE>
import torch
from torch import nn
def model():
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(6, 1, generator=g) @ torch.randn(1, 4, generator=g))
        m[2].weight.copy_(torch.randn(2, 6, generator=g))  # every weight seeded: two runs audit the same model
    return m, (torch.zeros(2, 4),)
<BLANKLINE>
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["low_rank_mlp", "write_low_rank_mlp"]


def low_rank_mlp(widths: Sequence[int] = (48, 64, 48, 4), rank: int = 3, batch: int = 1) -> str:
    """The source of a factory module with ``model()``: ``nn.Linear`` layers ``widths[0] -> ... -> widths[-1]``
    with a ReLU between each two, every weight but the last set to exactly rank ``rank`` (a product of two seeded
    Gaussian factors), the last one dense and seeded too; the example input is ``torch.zeros(batch, widths[0])``."""
    pairs = list(zip(widths[:-1], widths[1:]))
    layers = ", nn.ReLU(), ".join(f"nn.Linear({i}, {o})" for i, o in pairs)
    seeds = [f"        m[{2 * k}].weight.copy_(torch.randn({o}, {rank}, generator=g) @ torch.randn({rank}, {i}, "
             "generator=g))" for k, (i, o) in enumerate(pairs[:-1])]
    i, o = pairs[-1]
    seeds.append(f"        m[{2 * len(pairs) - 2}].weight.copy_(torch.randn({o}, {i}, generator=g))"
                 "  # every weight seeded: two runs audit the same model")
    return ("\nimport torch\nfrom torch import nn\ndef model():\n    g = torch.Generator().manual_seed(0)\n"
            f"    m = nn.Sequential({layers})\n    with torch.no_grad():\n" + "\n".join(seeds)
            + f"\n    return m, (torch.zeros({batch}, {widths[0]}),)\n")


def write_low_rank_mlp(folder: Path, name: str = "m.py", **kw: object) -> str:
    """Write :func:`low_rank_mlp` (``kw`` passed on) as ``folder/name``; returns the ``path:model`` source."""
    path = Path(folder) / name
    path.write_text(low_rank_mlp(**kw))  # type: ignore[arg-type]
    return f"{path}:model"
