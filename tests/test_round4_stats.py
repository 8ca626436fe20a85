"""Issue 32, part A: calibration statistics, their cache and the calibration boundary (stream.py's check of what
runs between blocks, the statistics cache's key, ids and labels, non-finite activations, degenerate models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.statistics.stream import find_blocks, stream_statistics
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


# -- the statistics cache's key ----------------------------------------------------------------------------------

SRC = '''
import torch
from torch import nn

SCALE = {scale}


def helper(h):
    return h {helper}


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        self.alpha = {alpha}

    def forward(self, x):
        return self.out(helper(self.fc(x)) {op} * SCALE * self.alpha)
'''
BASE = {"scale": "1.0", "helper": "+ 0", "alpha": "2.0", "op": ""}
EDITS = {"scale": ["1.5", "0.5", "-1.0"], "helper": ["* 1", "- 0", ".relu()", ".flip(-1)"],
         "alpha": ["2.5", "3.0", "1"], "op": [".relu()", ".tanh()", "+ 1", ".flip(-1)"]}


def _model(seed: int, **edits):
    ns: dict = {}
    exec(compile(SRC.format(**{**BASE, **edits}), "<factory>", "exec"), ns)  # noqa: S102 - the test's own source
    torch.manual_seed(seed)
    return ns["M"]().eval()


def _key(model, cal, compute=None, device=None, layers=None):
    from auditor.calibration.session import statistics_key

    layers = layers if layers is not None else collect_layers(model, ParamTable.of(model))
    return statistics_key(model, cal, layers, compute, device)


def _rows(seed: int, n: int = 16) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(seed))


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

INGREDIENTS = ["weights", "code", "rows", "row-order", "holdout", "batching", "dtype", "compute-dtype",
               "tokenizer", "window", "layers", "buffer", "attribute"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(INGREDIENTS), st.integers(0, 2**16), st.data())
def test_each_key_ingredient_changed_misses_the_cache(ingredient, seed, data):
    from auditor.calibration.data.inputs import Calibration

    model = _model(seed % 7)
    x = _rows(seed)
    cal = load_calibration({"x": x}, model, holdout=0.25, batch_size=4)
    base = _key(model, cal)
    assert _key(_model(seed % 7), load_calibration({"x": x.clone()}, model, holdout=0.25, batch_size=4)) == base
    if ingredient == "weights":
        other = _model(seed % 7)
        i, j = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 5))
        with torch.no_grad():
            other.fc.weight[i, j] = torch.nextafter(other.fc.weight[i, j], torch.tensor(10.0))
        assert _key(other, cal) != base
    elif ingredient in ("code", "attribute"):
        field = data.draw(st.sampled_from(list(EDITS) if ingredient == "code" else ["alpha"]))
        other = _model(seed % 7, **{field: data.draw(st.sampled_from(EDITS[field]))})
        other.load_state_dict(model.state_dict())
        assert _key(other, cal) != base
    elif ingredient == "rows":
        y = x.clone()
        y[data.draw(st.integers(0, 11)), data.draw(st.integers(0, 5))] += 1.0  # a fit row (the first 12 of 16)
        assert _key(model, load_calibration({"x": y}, model, holdout=0.25, batch_size=4)) != base
    elif ingredient == "row-order":
        perm = data.draw(st.permutations(range(12)))
        if list(perm) == list(range(12)):
            perm = [1, 0, *range(2, 12)]
        y = torch.cat([x[list(perm)], x[12:]])
        assert _key(model, load_calibration({"x": y}, model, holdout=0.25, batch_size=4)) != base
    elif ingredient == "holdout":
        share = data.draw(st.sampled_from([0.0, 0.1, 0.5, 0.75]))
        assert _key(model, load_calibration({"x": x}, model, holdout=share, batch_size=4)) != base
    elif ingredient == "batching":
        assert _key(model, load_calibration({"x": x}, model, holdout=0.25,
                                            batch_size=data.draw(st.sampled_from([1, 3, 5, 16])))) != base
    elif ingredient == "dtype":
        other = _model(seed % 7).to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float16])))
        assert _key(other, cal) != base
    elif ingredient == "compute-dtype":
        assert _key(model, cal, compute=data.draw(st.sampled_from(["float32", "float64"]))) != base
    elif ingredient == "tokenizer":  # the same ids from another tokenizer: only the calibration's digest differs
        other = Calibration(cal.fit, cal.holdout, cal.source, data.draw(st.text(min_size=1)) + cal.digest)
        assert _key(model, other) != base
    elif ingredient == "window":  # another window length: the same text cut into rows of another width
        flat = x.reshape(-1)
        w = data.draw(st.sampled_from([3, 4, 8]))
        other = load_calibration({"x": flat[: (flat.numel() // w) * w].reshape(-1, w)}, None, holdout=0.25,
                                 batch_size=4)
        assert _key(model, other) != base
    elif ingredient == "layers":
        layers = list(collect_layers(model, ParamTable.of(model)).values())
        assert _key(model, cal, layers=layers[:1]) != base
    elif ingredient == "buffer":
        other = _model(seed % 7)
        other.register_buffer("temperature", torch.tensor(float(data.draw(st.integers(1, 9)))))
        assert _key(other, cal) != base


def test_the_key_is_the_same_in_another_process(tmp_path):
    """A cache is shared between runs: the key of the same model and data must not depend on the process (object
    addresses, set order, hash seeds)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "k.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_round4_stats import _model, _key, _rows\n"
        "from auditor.calibration import load_calibration\n"
        "m = _model(3)\n"
        "print(_key(m, load_calibration({'x': _rows(5)}, m, holdout=0.25, batch_size=4)))\n")
    root = str(Path(__file__).resolve().parents[1])
    keys = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": str(s)}).stdout
            for s in (1, 2)}
    assert len(keys) == 1 and len(keys.pop().strip()) == 64


# -- non-finite activations ----------------------------------------------------------------------------------------

class _LogNet(nn.Module):
    """log(|fc(x)|) is -inf where fc(x) is 0: the batch whose row is all zeros gives -inf activations."""

    def __init__(self, blocks: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.blocks = nn.ModuleList(_Blk() for _ in range(3 if blocks else 1))

    def forward(self, x):
        h = torch.log(self.inp(x).abs())
        for b in self.blocks:
            h = b(h)
        return h


@pytest.mark.parametrize("blocks", [True, False], ids=["streamed", "one-pass"])
def test_non_finite_activations_name_the_layer_and_the_batch(blocks):
    from auditor.errors import AuditError

    torch.manual_seed(0)
    m = _LogNet(blocks).eval()
    layers = collect_layers(m, ParamTable.of(m))
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    x[9] = 0.0  # batch 2 of 4 rows
    cal = load_calibration({"x": x}, m, holdout=0.25, batch_size=4)
    with pytest.raises(AuditError) as info:
        stream_statistics(m, layers, cal)
    line = str(info.value)
    assert "\n" not in line and "NaN or infinite values on calibration batch 2" in line
    assert "input of layer blocks.0.fc" in line


# -- cache files that are not files, entries that change under a run -----------------------------------------------

def _spilled(tmp_path):
    from auditor.calibration.statistics.stats import InputStatistics

    torch.manual_seed(0)
    m = _Net(None).eval()
    layers = collect_layers(m, ParamTable.of(m))
    st = input_statistics(m, layers, load_calibration({"x": _rows(1)}, m, holdout=0.25))
    entry = tmp_path / "entry"
    st.spill(entry, key="k")
    return InputStatistics, entry


@pytest.mark.parametrize("victim", ["g0.npy", "meta.json"])
def test_a_fifo_in_a_cache_entry_is_refused_at_once(tmp_path, victim):
    """A FIFO put where a Gram file or the metadata was: opened without blocking and refused (no hang)."""
    import os

    from auditor.calibration.statistics.stats import StatisticsMismatch

    InputStatistics, entry = _spilled(tmp_path)
    (entry / victim).unlink()
    os.mkfifo(entry / victim)
    with pytest.raises(StatisticsMismatch, match="not a regular file"):
        InputStatistics.open(entry, key="k")


@pytest.mark.parametrize("change", ["removed", "rewritten", "fifo", "truncated-copy"])
def test_an_entry_changed_under_a_reader_is_one_line(tmp_path, change):
    """Statistics opened from an entry that another run then removes or rewrites: reading a Gram afterwards raises
    an AuditError with one line (exit 2), never an internal error."""
    import os
    import shutil

    from auditor.errors import AuditError

    InputStatistics, entry = _spilled(tmp_path)
    st = InputStatistics.open(entry, key="k")
    name = next(iter(st.layers))
    if change == "removed":
        shutil.rmtree(entry)
    elif change == "rewritten":
        for f in entry.glob("g*.npy"):
            np.save(f, np.eye(6))
    elif change == "fifo":
        for f in entry.glob("g*.npy"):
            f.unlink()
            os.mkfifo(f)
    else:
        for f in entry.glob("g*.npy"):
            f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(AuditError) as info:
        st.layers[name]
    assert "\n" not in str(info.value) and "changed while this audit was reading them" in str(info.value)


def test_a_model_whose_code_cannot_be_hashed_is_not_cached(tmp_path, monkeypatch):
    """What cannot be keyed is never trusted: the statistics are computed (and not cached), no error."""
    from auditor.calibration.data import hashing
    from auditor.calibration.session import _statistics
    from auditor.options import AuditOptions

    def boom(model):
        raise RuntimeError("unhashable")

    monkeypatch.setattr(hashing, "code_hash", boom)
    monkeypatch.setattr("auditor.calibration.session.code_hash", boom)
    torch.manual_seed(0)
    m = _Net(None).eval()
    layers = list(collect_layers(m, ParamTable.of(m)).values())
    cal = load_calibration({"x": _rows(1)}, m, holdout=0.25)
    opts = AuditOptions(cache_dir=tmp_path / "cache", progress=False)
    for _ in range(2):
        stats, cached = _statistics(m, layers, cal, opts)
        assert not cached and set(stats.layers) == {l.name for l in layers}
    assert not (tmp_path / "cache" / "calibration").exists() or not any((tmp_path / "cache" / "calibration").iterdir())
