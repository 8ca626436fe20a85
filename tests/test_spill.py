"""Tier 1 with each block's Grams spilled to disk (auditor/calibration/statistics/stats.py ``GramStore``, session.py
``_statistics``): the spectra equal the in-memory ones, one block's Grams are in memory at a time, a temporary spill
directory is removed, and the tall-map route of ``decompose`` equals the SVD of F S."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.statistics import stats as stats_mod
from auditor.calibration.session import CalibrationSession, _statistics
from auditor.calibration.statistics.stats import GramStore
from auditor.calibration.statistics.whiten import whitened_spectra
from auditor.calibration.statistics.whiten import DAMP, decompose
from auditor.layers import ParamTable, collect_layers
from auditor.options import AuditOptions


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 101, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, load_calibration({"input_ids": ids}, model, holdout=0.25)


def _chargpt():
    from chargpt import chargpt

    model = chargpt()[0]
    ids = torch.randint(0, model.cfg.vocab, (6, 32), generator=torch.Generator().manual_seed(2))
    return model, load_calibration({"idx": ids}, model, holdout=0.25)


MODELS = {"llama": _tiny_llama, "chargpt": _chargpt}


def _layers(model):
    return list(collect_layers(model, ParamTable.of(model)).values())


@pytest.mark.parametrize("which", sorted(MODELS))
def test_spilled_tier1_equals_the_in_memory_one(which, tmp_path):
    model, cal = MODELS[which]()
    layers = _layers(model)
    session = CalibrationSession(model, cal, layers=layers, options=AuditOptions(cache=False))
    stats = session.statistics(spectra=(8, 0.01))
    assert isinstance(stats.layers, GramStore)
    got = session.spectra(8, 0.01)
    table = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    want = whitened_spectra(layers, table, input_statistics(model, layers, cal), 8, 0.01)
    assert list(got) == list(want) and len(got) == len(layers)
    for name, w in want.items():
        g = got[name]
        assert (g.ranks_for, g.suggested, g.verdict, g.rows) == (w.ranks_for, w.suggested, w.verdict, w.rows), name
        assert np.allclose(g.error, w.error, rtol=0, atol=1e-9), name
        top = max(max(s) for s in w.sigma)
        assert np.allclose(np.array(g.sigma), np.array(w.sigma), rtol=0, atol=1e-9 * top), name
        assert g.output_norm == pytest.approx(w.output_norm, rel=1e-12)
    # the spilled Grams read back are the one-pass Grams
    ref = input_statistics(model, layers, cal)
    for name, inp in ref.layers.items():
        back = stats.layers[name]
        assert isinstance(back.gram, np.memmap) and not back.gram.flags.writeable
        assert float(np.abs(back.gram - inp.gram).max()) <= 1e-10 * float(np.abs(inp.gram).max()), name


def test_one_blocks_grams_are_in_memory_at_a_time(monkeypatch):
    model, cal = _tiny_llama()
    layers = _layers(model)
    made: list[weakref.ref] = []
    result = stats_mod._Acc.result

    def tracked(self):
        out = result(self)
        if out is not None and not any(r() is out.gram for r in made):
            made.append(weakref.ref(out.gram))
            made.append(weakref.ref(self.sum.gram))  # the torch sum the array views
        return out

    monkeypatch.setattr(stats_mod._Acc, "result", tracked)
    seen: list[tuple[int, int, int]] = []

    def probe(i, st):
        gc.collect()
        alive = [r() for r in made if r() is not None and isinstance(r(), np.ndarray)]
        mine = {id(v.gram) for v in st.layers.values()}
        seen.append((i, len(alive), len(mine)))
        assert {id(a) for a in alive} == mine, f"block {i}: Grams of other blocks are alive"

    stats, cached = _statistics(model, layers, cal, AuditOptions(cache=False), on_block=probe)
    assert not cached and [i for i, _, _ in seen] == [0, 1, -1]
    assert [n for _, n, _ in seen] == [4, 4, 2]  # q/k/v, o, gate/up, down; the embedding's counts, the head
    gc.collect()
    assert all(r() is None for r in made)  # none left in memory: the statistics read from disk
    assert len(stats.layers) == len(layers) and len(list(stats.layers.dir.glob("g*.npy"))) == 10


def test_a_temporary_spill_directory_is_removed():
    model, cal = _tiny_llama()
    stats, _ = _statistics(model, _layers(model), cal, AuditOptions(cache=False))
    d = stats.layers.dir
    assert d.is_dir() and (d / "g0.npy").is_file()
    del stats
    gc.collect()
    assert not d.exists()


def test_the_cache_entry_holds_one_file_per_distinct_gram(tmp_path):
    model, cal = _tiny_llama()
    layers = _layers(model)
    stats, cached = _statistics(model, layers, cal, AuditOptions(cache_dir=tmp_path))
    entry = stats.layers.dir
    assert not cached and entry.parent == tmp_path / "calibration" and (entry / "meta.json").is_file()
    assert not list(entry.parent.glob(".*"))  # no temporary directory left beside it
    again, cached = _statistics(model, layers, cal, AuditOptions(cache_dir=tmp_path))
    assert cached and again.layers.dir == entry
    del stats, again
    gc.collect()
    assert entry.is_dir()  # a cache entry is kept


def _old_tall(f, gram, lam):
    """The former route for out > in: U, sigma from the SVD of F S itself (out x in formed)."""
    s = np.linalg.cholesky(gram + lam * np.eye(gram.shape[0]))
    u, sig, _ = np.linalg.svd(f @ s, full_matrices=False)
    q = np.sum(((u.T @ f) @ gram) * (u.T @ f), axis=1)
    return u, sig ** 2, q


def test_a_tall_map_is_whitened_exactly_without_forming_f_s():
    rng = np.random.default_rng(3)
    f = rng.standard_normal((300, 40)) * np.linspace(3, 0.01, 40)
    x = rng.standard_normal((500, 40)) @ rng.standard_normal((40, 40))
    gram = x.T @ x
    b = decompose(f, gram)
    lam = DAMP * float(np.mean(np.diag(gram)))
    u, s2, q = _old_tall(f, gram, lam)
    assert b.damping == pytest.approx(lam, rel=1e-15)
    assert np.allclose(b.sigma2, s2, rtol=1e-9, atol=1e-12 * s2[0])
    assert np.allclose(b.q, q, rtol=0, atol=1e-10 * q.sum())
    assert b.total == pytest.approx(float(np.sum((f @ x.T) ** 2)), rel=1e-12)
    assert np.allclose(np.abs(np.sum(b.u * u, axis=0)), 1.0, atol=1e-7)  # the same directions (up to sign)
    assert decompose(f, gram, need_u=False).u is None


def test_a_spill_that_cannot_be_written_is_one_line(monkeypatch):
    from auditor.errors import AuditError

    model, cal = _tiny_llama()

    def full(self, layers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(GramStore, "put", full)
    with pytest.raises(AuditError, match="cannot write the input statistics to .*: No space left on device"):
        _statistics(model, _layers(model), cal, AuditOptions(cache=False))


def test_spilled_statistics_pickle_as_their_grams():
    """A cluster's workers get the Grams themselves, not a path on this machine."""
    import pickle

    model, cal = _tiny_llama()
    stats, _ = _statistics(model, _layers(model), cal, AuditOptions(cache=False))
    back = pickle.loads(pickle.dumps(stats))
    assert type(back.layers) is dict and list(back.layers) == list(stats.layers)
    for name, inp in back.layers.items():
        assert type(inp.gram) is np.ndarray and np.array_equal(inp.gram, stats.layers[name].gram), name


def test_the_memory_refusal_counts_one_block_when_streaming():
    from auditor.calibration.session import statistics_memory

    model, _ = _tiny_llama()
    layers = _layers(model)
    block = 8 * (4 * 64 * 64 + 2 * 64 * 64 + 96 * 96)  # q, k, v, o, gate, up (64 wide), down (96 wide)
    outside = 8 * 101 + 8 * 64 * 64  # the embedding's lookup counts, the head
    need, largest = statistics_memory(layers, model)
    assert need == max(block, outside) + 2 * 8 * 96 * 96 and largest.endswith("(96 x 96)")
    every = statistics_memory(layers)[0]  # without the model: every layer's, as one pass keeps them
    assert every == 2 * block + outside + 2 * 8 * 96 * 96
