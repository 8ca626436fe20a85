"""Singular values against numpy's float64 SVD, exact ranks for energy, skips, scaling, memory refusal, the cache."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import auditor
from auditor.spectra import compute_spectra, ref_for
from auditor.sources.tensorref import TensorRef


def stored_matrix(model, layer):
    """The float64 matrix of a Linear or an ungrouped Conv2d weight, reshaped here by hand (out, in*kh*kw)."""
    w = dict(model.named_parameters())[layer.param].detach().double().numpy()
    return w.reshape(w.shape[0], -1)


def rank_for(sigma, target):
    """Smallest r whose leading r squared values hold at least ``target`` of the total, by a plain loop."""
    s2 = [float(x) ** 2 for x in sigma]
    total, acc = sum(s2), 0.0
    for r, v in enumerate(s2, start=1):
        acc += v
        if acc >= target * total:
            return r
    return len(s2)


@pytest.mark.parametrize("which", ["digits_mlp", "digits_cnn"])
def test_sample_model_spectra_match_float64_svd(which, request):
    model, inputs = request.getfixturevalue(which)
    a = auditor.audit(model, inputs, cache=False)
    assert len(a.spectra) == len(a.layers) == 4
    for layer in a.layers:
        assert layer.groups == 1
        sp = a.spectra[layer.name]
        ref = np.linalg.svd(stored_matrix(model, layer), compute_uv=False)
        got = np.asarray(sp.sigma[0])
        assert got.shape == ref.shape
        assert np.max(np.abs(got - ref)) <= 1e-6 * ref[0], layer.name
        for t in (0.90, 0.95, 0.99):
            assert sp.rank_for(t) == rank_for(ref, t), (layer.name, t)
        assert sp.stable_rank == pytest.approx((ref**2).sum() / ref[0] ** 2, rel=1e-9)
        assert sp.frob2 == pytest.approx((stored_matrix(model, layer) ** 2).sum(), rel=1e-9)


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
    layer = auditor.audit(nn.Sequential(lin), spectra=False).layers[0]
    got, stats = compute_spectra([(layer.name, ref_for(layer, lin.weight))], targets=(10 / 14,))
    assert got[layer.name].method == "svd-f64" and stats.exact_fallbacks == 1


@pytest.mark.parametrize("fill,reason", [(float("nan"), "non-finite"), (float("inf"), "non-finite"), (0.0, "all-zero")])
def test_bad_weights_are_skipped_with_a_reason(fill, reason):
    lin = nn.Linear(8, 8)
    lin.weight.data.fill_(fill)
    a = auditor.audit(nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 8)), cache=False)
    assert a.spectra["0"].sigma is None and reason in a.spectra["0"].skipped
    assert a.suggestions["0"].verdict == "skipped"
    assert a.spectra["2"].sigma is not None
    assert [f.code for f in a.findings if f.code == "LR010"] == ["LR010"]


def ref_of(t, kind="linear", groups=1):
    m, n = t.shape[0] // groups, math.prod(t.shape[1:])
    return TensorRef.of_tensor(t, "w", kind, m, n, groups)


@pytest.mark.parametrize("make,reason", [
    (lambda: torch.empty(4, 4, device="meta"), "meta device"),
    (lambda: torch.zeros(4, 4, dtype=torch.int8), "quantized (int8)"),
    (lambda: torch.quantize_per_tensor(torch.ones(4, 4), 0.1, 0, torch.qint8), "quantized (qint8)"),
    (lambda: torch.ones(4, 4).to(torch.float8_e4m3fn), "float8_e4m3fn weights"),
    (lambda: torch.eye(4).to_sparse(), "sparse_coo tensor"),
    (lambda: torch.zeros(0, 4), "zero-sized"),
    (lambda: torch.ones(4, 4, dtype=torch.complex64), "not a floating-point tensor (complex64)"),
], ids=["meta", "int8", "qint8", "float8", "sparse", "zero-dim", "complex"])
def test_weights_without_a_spectrum_get_a_reason_not_a_traceback(make, reason):
    t = make()
    spectra, stats = compute_spectra([("w", ref_of(t))], targets=(0.9,))
    assert spectra["w"].sigma is None and reason in spectra["w"].skipped
    assert stats.skipped == 1 and stats.computed == 0


def test_a_model_with_no_factorizable_layer_audits_cleanly():
    from auditor.spectra import SpectraStats

    a = auditor.audit(nn.Sequential(nn.LayerNorm(8)), cache=False)
    assert a.layers == [] and a.spectra == {} and a.spectra_stats["computed"] == 0
    assert compute_spectra([], targets=(0.9,)) == ({}, SpectraStats())


@pytest.mark.parametrize("c", [1e200, 1e-200, 2.0**1000, 2.0**-1000])
def test_extreme_float64_scales_give_scaled_exact_spectra_and_valid_json(c):
    u, _ = torch.linalg.qr(torch.randn(9, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(7)))
    v, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8)))
    s = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    w = (u[:, :5] * s) @ v.T * c
    spectra, stats = compute_spectra([("w", ref_of(w))], targets=(0.9, 0.95, 0.99))
    sp = spectra["w"]
    assert sp.skipped == "" and stats.computed == 1
    assert np.allclose(np.asarray(sp.sigma[0]) / c, s.numpy(), rtol=1e-12, atol=0)
    total = 39.25  # 25 + 9 + 4 + 1 + 0.25
    assert sp.energy == pytest.approx([25 / total, 34 / total, 38 / total, 39 / total, 1.0], rel=1e-12)
    assert sp.stable_rank == pytest.approx(total / 25, rel=1e-12)
    assert all(math.isfinite(e) for e in sp.energy) and math.isfinite(sp.effective_rank)
    json.dumps(sp.to_dict(), allow_nan=False)  # no NaN or Infinity anywhere
    if total * c * c > 1.7e308:
        assert sp.frob2 is None  # ||W||_F^2 exceeds float64: left out, not Infinity
    elif total * c * c > 1e-300:
        assert sp.frob2 == pytest.approx(total * c * c, rel=1e-12)


def test_a_short_side_beyond_lapack_indexing_or_memory_is_refused_before_anything_is_built(monkeypatch):
    from auditor.spectra import backend

    huge = torch.zeros(1).expand(46341, 46341)  # 4 bytes stored, 8 GiB as a float32 matrix
    spectra, _ = compute_spectra([("w", ref_of(huge))], targets=(0.9,))
    assert spectra["w"].skipped.startswith("short side 46,341 too large for an exact spectrum here: the float64 "
                                           "Gram needs 16.0 GiB")
    monkeypatch.setattr(backend, "available_memory", lambda: 3 << 30)
    wide = torch.ones(1).expand(30000, 30000)
    spectra, _ = compute_spectra([("w", ref_of(wide))], targets=(0.9,))
    assert spectra["w"].skipped == ("short side 30,000 too large for an exact spectrum here: the float64 Gram needs "
                                    "6.7 GiB, 3.0 GiB available")


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
    from auditor.planning.plan import emit_toml

    model, inputs = digits_mlp
    a = auditor.audit(model, inputs, cache=False)
    path = tmp_path / "plan.toml"
    path.write_text(emit_toml(a))
    b = auditor.audit(model, inputs, cache=False, plan=path)
    assert {i.layer: i.rank for i in b.review.items} == {i.layer: i.rank for i in a.review.items}
    assert [f.code for f in b.findings if f.code == "LR005"] == ["LR005"]  # the emitted plan asks for a budget


@pytest.mark.parametrize("gil_free", [True, False], ids=["cython-pointers", "scipy-wrappers"])
@pytest.mark.parametrize("tile", [8192, 3], ids=["one-syrk", "tiles"])
@pytest.mark.parametrize("shape", [(37, 5), (5, 37), (16, 16), (40, 11)])
def test_gram_blocks_and_tiles_match_numpy_products(monkeypatch, gil_free, tile, shape):
    from auditor.spectra import _lapack
    from auditor.spectra import backend

    if gil_free and not _lapack.available():
        pytest.skip("this SciPy publishes no Cython BLAS/LAPACK pointers")
    monkeypatch.setattr(_lapack, "available", lambda: gil_free)
    monkeypatch.setattr(backend, "CHUNK_ELEMENTS", 35)  # blocks of a few rows (or columns), a short last block
    monkeypatch.setattr(backend, "SYRK_TILE", tile)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    w64 = w.double().numpy()
    ref = w64.T @ w64 if shape[0] >= shape[1] else w64 @ w64.T
    g = backend.gram64(w, 0.25)
    assert np.allclose(np.triu(g), np.triu(ref) / 16, rtol=0, atol=1e-13 * np.abs(ref).max())
    lam = np.linalg.eigvalsh(ref / 16)
    got = backend.eig_svdvals(g)
    assert np.allclose(got, np.sqrt(np.clip(lam[::-1], 0, None)), rtol=0, atol=1e-12 * got[0])


def test_parallel_run_caps_blas_threads_in_the_workers_and_matches_one_at_a_time():
    import os

    from threadpoolctl import threadpool_info

    from auditor.spectra import _lapack
    from auditor.spectra import LapackBackend, ThreadExecutor

    def blas_threads():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    seen = []

    class Recording(LapackBackend):
        def svdvals(self, mats, targets):
            seen.append(blas_threads())
            return super().svdvals(mats, targets)

    g = torch.Generator().manual_seed(0)
    shapes = [(96, 48), (32, 96), (200, 32)]
    items = [(f"w{i}", ref_of(torch.randn(m, n, generator=g))) for i, (m, n) in enumerate(shapes)]
    before = blas_threads()
    two, _ = compute_spectra(items, targets=(0.9,), backend=Recording(), executor=ThreadExecutor(2))
    cap = max(1, (os.cpu_count() or 1) // 2) if _lapack.available() else None
    assert len(seen) == 3
    for threads in seen:
        assert all(n == (cap or before[path]) for path, n in threads.items())
    assert blas_threads() == before
    one, _ = compute_spectra(items, targets=(0.9,), executor=ThreadExecutor(1))
    for i, (name, ref_obj) in enumerate(items):
        ref = np.linalg.svd(ref_obj.data.double().numpy(), compute_uv=False)
        assert np.allclose(two[name].sigma[0], one[name].sigma[0], rtol=0, atol=1e-12 * ref[0])
        assert np.max(np.abs(np.asarray(one[name].sigma[0]) - ref)) <= 1e-6 * ref[0]


def test_progress_is_reported_through_the_callback():
    calls = []
    items = [(f"w{i}", ref_of(torch.randn(8, 6, generator=torch.Generator().manual_seed(i)))) for i in range(3)]
    items.append(("meta", ref_of(torch.empty(4, 4, device="meta"))))
    compute_spectra(items, targets=(0.9,), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_eigensolver_failure_falls_back_to_float64_svd(monkeypatch):
    from auditor.spectra import backend

    def fail(g):
        raise np.linalg.LinAlgError("dsyevd failed to converge (info=3)")

    monkeypatch.setattr(backend, "eig_svdvals", fail)
    lin = nn.Linear(12, 20, bias=False)
    layer = auditor.audit(nn.Sequential(lin), spectra=False).layers[0]
    got, stats = compute_spectra([(layer.name, ref_for(layer, lin.weight))], targets=(0.90, 0.95, 0.99))
    sp = got[layer.name]
    ref = np.linalg.svd(lin.weight.detach().double().numpy(), compute_uv=False)
    assert sp.method == "svd-f64" and stats.exact_fallbacks == 1
    assert np.max(np.abs(np.asarray(sp.sigma[0]) - ref)) <= 1e-12 * ref[0]


@pytest.mark.parametrize("shape,groups", [((30, 12), 1), ((12, 30), 1), ((8, 2, 3, 3), 2)])
def test_torch_backend_on_cpu_matches_float64_svd(shape, groups):
    from auditor.spectra import TorchBackend

    t = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    kind = "conv" if t.dim() == 4 else "linear"
    ref_obj = TensorRef.of_tensor(t, "w", kind, shape[0] // groups, math.prod(shape[1:]), groups)
    got, _ = compute_spectra([("w", ref_obj)], targets=(0.9,), backend=TorchBackend("cpu"))
    mats = t.double().reshape(groups, shape[0] // groups, -1).numpy()  # out channels split into groups, by hand
    for gi in range(groups):
        ref = np.linalg.svd(mats[gi], compute_uv=False)
        assert np.max(np.abs(np.asarray(got["w"].sigma[gi]) - ref)) <= 1e-10 * ref[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gram_of_low_precision_weights_with_a_wide_range_is_exact(dtype):
    from auditor.spectra import backend

    w = torch.randn(50, 20, generator=torch.Generator().manual_seed(6)) * 1e-3
    w[0, 0] = 1000.0  # scaled by 2^-10: the small entries must not be rounded in the half-precision format
    w = w.to(dtype)
    c = backend.scale_for(float(w.abs().max()))
    assert c == 2.0**-10
    w64 = w.double().numpy() * c
    g, ref = np.triu(backend.gram64(w, c)), np.triu(w64.T @ w64)
    assert (np.abs(g - ref) <= 1e-12 * np.abs(ref) + 1e-16 * ref.max()).all()  # relative, even for tiny entries
