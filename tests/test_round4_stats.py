"""Issue 32, part A: calibration statistics, their cache and the calibration boundary (stream.py's check of what
runs between blocks, the statistics cache's key, ids and labels, non-finite activations, degenerate models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.stream import find_blocks, stream_statistics
from auditor.structure.layers import ParamTable, collect_layers


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


BETWEEN = {
    "relu": torch.relu,
    "scale": lambda h: 0.5 * h,
    "flip": lambda h: h.flip(-1),
    "permute": lambda h: h[..., [1, 0, 2, 3, 4, 5]],
    "in-place": lambda h: h.mul_(2),
    "residual": lambda h: h + 1e-3,
    "round-trip-half": lambda h: h.half().float(),
}


class _Net(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Blk() for _ in range(3))
        self.op = op

    def forward(self, x):
        for b in self.blocks:
            x = self.op(b(x)) if self.op is not None else b(x)
        return x


def _grams(st):
    return {k: np.asarray(v.gram) for k, v in st.layers.items()}


@pytest.mark.parametrize("op", list(BETWEEN), ids=list(BETWEEN))
def test_code_between_blocks_gives_the_one_pass_statistics(op):
    """An operation between two blocks is not skipped: the check sees a block's output changed before the next
    block reads it, and the statistics are the one pass's exactly (no block callbacks)."""
    torch.manual_seed(4)
    m = _Net(BETWEEN[op]).eval()
    layers = collect_layers(m, ParamTable.of(m))
    assert find_blocks(m, layers) is not None
    cal = load_calibration({"x": torch.randn(16, 6)}, m, holdout=0.25)
    calls: list[int] = []
    st = stream_statistics(m, layers, cal, on_block=lambda i, s: calls.append(i))
    ref = input_statistics(m, layers, cal)
    assert calls == [-1]
    a, b = _grams(st), _grams(ref)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_nothing_between_blocks_is_still_streamed():
    torch.manual_seed(4)
    m = _Net(None).eval()
    layers = collect_layers(m, ParamTable.of(m))
    cal = load_calibration({"x": torch.randn(16, 6)}, m, holdout=0.25)
    calls: list[int] = []
    st = stream_statistics(m, layers, cal, on_block=lambda i, s: calls.append(i))
    ref = _grams(input_statistics(m, layers, cal))
    assert calls == [0, 1, 2]
    got = _grams(st)
    assert got.keys() == ref.keys() and all(np.allclose(got[k], ref[k], rtol=1e-12, atol=0) for k in ref)
