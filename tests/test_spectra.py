"""Singular values against numpy's float64 SVD, exact ranks for energy, skips, and the content-hash cache."""

import numpy as np
import pytest
import torch
from torch import nn

import auditor
from auditor.layers import matrix_view
from auditor.spectra import Engine


def reference(layer, tensor):
    mats = matrix_view(layer, tensor.detach().to(torch.float64)).numpy()
    return np.stack([np.linalg.svd(m, compute_uv=False) for m in mats])


@pytest.mark.parametrize("which", ["digits_mlp", "digits_cnn"])
def test_sample_model_spectra_match_float64_svd(which, request):
    model, inputs = request.getfixturevalue(which)
    a = auditor.audit(model, inputs, cache=False)
    params = dict(model.named_parameters())
    assert len(a.spectra) == len(a.layers) == 4
    for layer in a.layers:
        sp = a.spectra[layer.name]
        ref = reference(layer, params[layer.param])
        got = np.asarray(sp.sigma)
        assert got.shape == ref.shape
        assert np.max(np.abs(got - ref)) <= 1e-6 * ref.max(), layer.name
        # every rank-for-energy equals the float64 reference exactly
        s2 = (ref**2).sum(axis=0)
        cum = np.cumsum(s2) / s2.sum()
        for t in (0.90, 0.95, 0.99):
            expected = int(np.searchsorted(cum, t, side="left")) + 1
            assert sp.rank_for(t) == expected, (layer.name, t)
        assert sp.stable_rank == pytest.approx((ref**2).sum() / ref.max() ** 2, rel=1e-9)


def test_derived_numbers_on_a_known_spectrum():
    # W = U diag(4, 2, 1, 0) V^T exactly: energies 16/21, 20/21, 1, 1
    u, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    v, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    w = u[:, :4] @ torch.diag(torch.tensor([4.0, 2.0, 1.0, 0.0], dtype=torch.float64)) @ v.T
    lin = nn.Linear(4, 6, bias=False)
    lin.weight.data = w.float()
    a = auditor.audit(nn.Sequential(lin), cache=False, settings=auditor.Settings(min_share=0, min_break_even=0))
    sp = a.spectra["0"]
    assert np.allclose(sp.sigma[0], [4, 2, 1, 0], atol=1e-6)
    assert sp.energy_at(1) == pytest.approx(16 / 21, abs=1e-7)
    assert sp.energy_at(2) == pytest.approx(20 / 21, abs=1e-7)
    assert sp.rank_for(0.95) == 2 and sp.rank_for(0.99) == 3
    assert sp.numerical_rank == 3
    assert sp.stable_rank == pytest.approx(21 / 16, rel=1e-6)


def test_tall_and_wide_take_the_short_side():
    g = torch.Generator().manual_seed(0)
    for shape in [(300, 40), (40, 300)]:
        lin = nn.Linear(shape[1], shape[0])
        lin.weight.data = torch.randn(*shape, generator=g)
        a = auditor.audit(nn.Sequential(lin), cache=False)
        ref = np.linalg.svd(lin.weight.detach().double().numpy(), compute_uv=False)
        assert np.max(np.abs(np.asarray(a.spectra["0"].sigma[0]) - ref)) <= 1e-6 * ref[0]
        assert len(a.spectra["0"].sigma[0]) == 40


def test_knife_edge_energy_falls_back_to_float64_svd():
    # sigma = (3, 1, 1, 1, 1, 1) -> E(1) = 9/14, E(2) = 10/14 ... a target of exactly 10/14 sits on a boundary
    u, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    v, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    s = torch.tensor([3.0, 1, 1, 1, 1, 1], dtype=torch.float64)
    w = u[:, :6] @ torch.diag(s) @ v.T  # float64, so E(2) = 10/14 to rounding
    lin = nn.Linear(6, 8, bias=False).double()
    lin.weight.data = w
    eng = Engine(targets=(10 / 14,), use_cache=False, progress=False)
    sp = eng.one(auditor.audit(nn.Sequential(lin), spectra=False).layers[0], lin.weight)
    assert sp.method == "svd-f64" and eng.stats.exact_fallbacks == 1


@pytest.mark.parametrize("fill,reason", [(float("nan"), "non-finite"), (float("inf"), "non-finite"), (0.0, "all-zero")])
def test_bad_weights_are_skipped_with_a_reason(fill, reason):
    lin = nn.Linear(8, 8)
    lin.weight.data.fill_(fill)
    a = auditor.audit(nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 8)), cache=False)
    assert a.spectra["0"].sigma is None and reason in a.spectra["0"].skipped
    assert a.suggestions["0"].verdict == "skipped"
    assert a.spectra["2"].sigma is not None
    assert [f.code for f in a.findings if f.code == "LR010"] == ["LR010"]


def test_meta_and_quantized_weights_are_skipped():
    from auditor.spectra import skip_reason

    assert "meta device" in skip_reason(torch.empty(4, 4, device="meta"))
    assert "quantized" in skip_reason(torch.zeros(4, 4, dtype=torch.int8))


def test_cache_recomputes_only_changed_weights(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    first = auditor.audit(model, cache_dir=tmp_path)
    assert first.spectra_stats["computed"] == 2 and first.spectra_stats["cached"] == 0
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    second = auditor.audit(model, cache_dir=tmp_path)
    assert second.spectra_stats["computed"] == 1 and second.spectra_stats["cached"] == 1
    assert second.spectra["0"].sigma == first.spectra["0"].sigma
    assert np.allclose(np.asarray(second.spectra["2"].sigma), 2 * np.asarray(first.spectra["2"].sigma))
    off = auditor.audit(model, cache=False, cache_dir=tmp_path)
    assert off.spectra_stats["cached"] == 0


def test_suggestion_rounds_to_alignment_below_break_even(digits_mlp):
    model, inputs = digits_mlp
    a = auditor.audit(model, inputs, cache=False)
    fc2 = a.layer("fc2")
    sg = a.suggestions["fc2"]
    need = a.spectra["fc2"].rank_for(0.95)
    assert sg.verdict == "factorize"
    assert sg.rank % 8 == 0 and need <= sg.rank < need + 8 and sg.rank < fc2.break_even
    assert sg.params_after == sg.rank * (512 + 512)
    assert sg.compression == pytest.approx(512 * 512 / (sg.rank * 1024))
    assert a.suggestions["head"].verdict == "skip narrow"


def test_emit_plan_round_trips(tmp_path, digits_mlp):
    from auditor.plan import emit_toml

    model, inputs = digits_mlp
    a = auditor.audit(model, inputs, cache=False)
    path = tmp_path / "plan.toml"
    path.write_text(emit_toml(a))
    b = auditor.audit(model, inputs, cache=False, plan=path)
    assert {i.layer: i.rank for i in b.review.items} == {i.layer: i.rank for i in a.review.items}
    assert [f.code for f in b.findings if f.code == "LR005"] == ["LR005"]  # the emitted plan asks for a budget


@pytest.mark.parametrize("gil_free", [True, False], ids=["cython-pointers", "scipy-wrappers"])
@pytest.mark.parametrize("shape", [(37, 5), (5, 37), (16, 16)])
def test_gram_blocks_and_eigenvalues_match_float64(monkeypatch, gil_free, shape):
    from auditor import _lapack, spectra

    if gil_free and not _lapack.available():
        pytest.skip("this SciPy publishes no Cython BLAS/LAPACK pointers")
    monkeypatch.setattr(_lapack, "available", lambda: gil_free)
    monkeypatch.setattr(spectra, "CHUNK_ELEMENTS", 35)  # blocks of 7 rows (or columns) and a short last block
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    w64 = w.double().numpy()
    ref = w64.T @ w64 if shape[0] >= shape[1] else w64 @ w64.T
    g = spectra.gram64(w)
    assert np.allclose(np.triu(g), np.triu(ref), rtol=0, atol=1e-13 * np.abs(ref).max())
    lam = np.linalg.eigvalsh(ref)
    got = spectra.eig_svdvals(g)
    assert np.allclose(got, np.sqrt(np.clip(lam[::-1], 0, None)), rtol=0, atol=1e-12 * got[0])


def test_parallel_run_caps_blas_threads_and_matches_one_at_a_time():
    import os

    from threadpoolctl import threadpool_info

    from auditor import _lapack

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 200))
    layers = auditor.audit(model, spectra=False).layers
    params = dict(model.named_parameters())
    seen = []

    def blas_threads():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    def loader(name):
        def load():
            seen.append(blas_threads())
            return params[name]

        return load

    items = [(layer, loader(layer.param)) for layer in layers]
    before = blas_threads()
    two = Engine(use_cache=False, progress=False, workers=2).run(items)
    cap = max(1, (os.cpu_count() or 1) // 2) if _lapack.available() else None
    for threads in seen:
        assert all(n == (cap or before[path]) for path, n in threads.items())
    assert seen and blas_threads() == before
    one = Engine(use_cache=False, progress=False, workers=1).run(items)
    for name, sp in one.items():
        assert np.allclose(two[name].sigma, sp.sigma, rtol=0, atol=1e-12 * sp.sigma[0][0])


@pytest.mark.parametrize("threads_from", [1 << 30, 100], ids=["one-thread", "all-cores"])
def test_cache_key_is_blake3_of_layout_and_bytes_and_survives_a_corrupt_entry(tmp_path, monkeypatch, threads_from):
    from blake3 import blake3

    from auditor import spectra

    monkeypatch.setattr(spectra, "HASH_THREADS_FROM", threads_from)
    lin = nn.Linear(20, 30, bias=False)
    layer = auditor.audit(nn.Sequential(lin), spectra=False).layers[0]
    raw = lin.weight.detach().numpy().tobytes()
    expect = blake3(f"{spectra.ENGINE_VERSION}|{layer.kind}|30x20x1|torch.float32|".encode() + raw).hexdigest()
    key = spectra._hash(lin.weight, layer)
    assert key == expect
    with torch.no_grad():
        lin.weight[-1, -1] += 1.0
    assert spectra._hash(lin.weight, layer) != key

    eng = Engine(cache_dir=tmp_path, progress=False)
    first = eng.one(layer, lin.weight)
    entry = next(tmp_path.rglob("*.f64"))
    assert entry.stat().st_size == 20 * 8
    entry.write_bytes(b"\0" * 12)  # truncated: recomputed, not misread
    again = Engine(cache_dir=tmp_path, progress=False)
    assert again.one(layer, lin.weight).sigma == first.sigma and again.stats.computed == 1
    third = Engine(cache_dir=tmp_path, progress=False)
    assert third.one(layer, lin.weight).method == "cache" and third.stats.cached == 1


def test_eigensolver_failure_falls_back_to_float64_svd(monkeypatch):
    from auditor import spectra

    def fail(g):
        raise np.linalg.LinAlgError("dsyevd failed to converge (info=3)")

    monkeypatch.setattr(spectra, "eig_svdvals", fail)
    lin = nn.Linear(12, 20, bias=False)
    layer = auditor.audit(nn.Sequential(lin), spectra=False).layers[0]
    eng = Engine(use_cache=False, progress=False)
    sp = eng.one(layer, lin.weight)
    ref = np.linalg.svd(lin.weight.detach().double().numpy(), compute_uv=False)
    assert sp.method == "svd-f64" and eng.stats.exact_fallbacks == 1
    assert np.max(np.abs(np.asarray(sp.sigma[0]) - ref)) <= 1e-12 * ref[0]
