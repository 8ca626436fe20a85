"""The spectral backend is an audit option (``spectra_backend``, ``--spectra-backend``): LAPACK (the default) and torch
give the same spectra at the accuracy the tool promises, and each keeps its own cache entries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import auditor
from auditor.errors import AuditError
from auditor.options import AuditOptions, SpectraBackend
from auditor.spectra import (LapackBackend, SpectrumCache, TorchBackend, backend_for, compute_spectra, content_key,
                             entry_key)
from auditor.sources.tensorref import TensorRef

EPS64 = float(np.finfo(np.float64).eps)


def eig_tol(k: int) -> float:
    """tests/test_gold.py's tolerance: two computations' sigma_i^2 may differ by this much of sigma_max^2."""
    return 20.0 * math.sqrt(k) * EPS64


def matrices() -> list[tuple[str, TensorRef]]:
    """A tall, a wide, a rank-deficient (rank 5, the rest rounding) and a bfloat16 weight, and a convolution."""
    g = torch.Generator().manual_seed(7)
    low = torch.randn(120, 5, generator=g) @ torch.randn(5, 90, generator=g)
    conv = torch.randn(16, 4, 3, 3, generator=g)
    return [
        ("tall", TensorRef.of_tensor(torch.randn(300, 64, generator=g), "tall", "linear", 300, 64)),
        ("wide", TensorRef.of_tensor(torch.randn(48, 200, generator=g), "wide", "linear", 48, 200)),
        ("low", TensorRef.of_tensor(low, "low", "linear", 120, 90)),
        ("bf16", TensorRef.of_tensor(torch.randn(96, 96, generator=g).to(torch.bfloat16), "bf16", "linear", 96, 96)),
        ("conv", TensorRef.of_tensor(conv, "conv", "conv", 16, 36)),
    ]


def test_lapack_and_torch_give_the_same_spectra_at_the_promised_accuracy():
    items = matrices()
    lapack, _ = compute_spectra(items, targets=(0.9, 0.95, 0.99), backend=LapackBackend())
    torch_cpu, _ = compute_spectra(items, targets=(0.9, 0.95, 0.99), backend=TorchBackend("cpu"))
    for name, ref in items:
        a, b = np.asarray(lapack[name].sigma), np.asarray(torch_cpu[name].sigma)
        assert a.shape == b.shape == (1, min(ref.m, ref.n))
        k, smax = a.shape[1], float(a.max())
        assert np.max(np.abs(a**2 - b**2)) <= eig_tol(k) * smax**2, name
        # and both against numpy's float64 SVD of the stored tensor
        ref_s = np.linalg.svd(ref.load().double().reshape(ref.m, -1).numpy(), compute_uv=False)
        assert np.max(np.abs(b[0] ** 2 - ref_s**2)) <= eig_tol(k) * smax**2, name
        assert lapack[name].energy == pytest.approx(torch_cpu[name].energy, abs=2 * k * eig_tol(k))
    # the rank-5 weight: both see five values and rounding below them
    assert [sum(s > 1e-6 * max(sig.sigma[0]) for s in sig.sigma[0]) for sig in (lapack["low"], torch_cpu["low"])] \
        == [5, 5]


def test_each_backend_keeps_its_own_cache_entries(tmp_path):
    items = matrices()
    cache = SpectrumCache(tmp_path)
    first = {}
    for backend in (LapackBackend(), TorchBackend("cpu")):
        spectra, stats = compute_spectra(items, targets=(0.9,), backend=backend, cache=cache)
        assert (stats.computed, stats.cached) == (len(items), 0), backend  # never the other backend's values
        first[backend.cache_id] = spectra
    files = sorted(p for p in tmp_path.rglob("*.f64"))
    assert len(files) == 2 * len(items)
    for backend in (LapackBackend(), TorchBackend("cpu")):
        again, stats = compute_spectra(items, targets=(0.9,), backend=backend, cache=cache)
        assert (stats.computed, stats.cached) == (0, len(items))
        assert all(again[n].sigma == first[backend.cache_id][n].sigma for n, _ in items)  # its own, bit for bit
    # the default backend's entries keep the plain content key (caches written before stay valid)
    key = content_key(items[0][1])
    assert cache.path(key) == tmp_path / key[:2] / f"{key}.f64" and cache.path(key).is_file()
    torch_path = cache.for_backend("torch-cpu").path(key)
    assert torch_path.is_file() and torch_path != cache.path(key)
    assert len({entry_key(key), entry_key(key, "torch-cpu"), entry_key(key, "torch-cuda")}) == 3


def digits_like() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def test_the_option_selects_the_backend_and_the_audit_agrees(tmp_path):
    a = auditor.audit(digits_like(), cache_dir=tmp_path)
    b = auditor.audit(digits_like(), cache_dir=tmp_path, spectra_backend="torch-cpu")
    assert b.spectra_stats["computed"] == 3 and b.spectra_stats["cached"] == 0  # not lapack's entries
    assert len(list(tmp_path.rglob("*.f64"))) == 6
    for name, sp in a.spectra.items():
        k = len(sp.sigma[0])
        assert np.max(np.abs(np.square(sp.sigma) - np.square(b.spectra[name].sigma))) <= eig_tol(k) * sp.sigma[0][0] ** 2
    assert {n: (s.rank, s.verdict) for n, s in a.suggestions.items()} == \
        {n: (s.rank, s.verdict) for n, s in b.suggestions.items()}
    assert AuditOptions(spectra_backend="torch-cpu").spectra_backend is SpectraBackend.TORCH_CPU
    assert isinstance(backend_for("lapack"), LapackBackend) and backend_for("torch-cpu") == TorchBackend("cpu")


def test_a_bad_backend_is_one_line(cli_inproc):
    with pytest.raises(AuditError, match=r"^unknown spectra backend 'gpu'\. Choose from lapack, torch-cpu, "
                                         r"torch-cuda\.$"):
        AuditOptions(spectra_backend="gpu")
    res = cli_inproc("sample_models/digits.py:mlp", "-q", "--spectra-backend", "gpu")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == ("error: argument --spectra-backend: invalid choice: 'gpu' (choose from 'lapack', "
                          "'torch-cpu', 'torch-cuda'). See lowrank-audit --help.\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: torch-cuda runs")
def test_torch_cuda_without_cuda_is_bad_input_not_an_audit_of_skipped_layers(cli_inproc, tmp_path):
    res = cli_inproc("sample_models/digits.py:mlp", "-q", "--spectra-backend", "torch-cuda", "-o", str(tmp_path),
                     "--format", "json")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert res.stderr.startswith("error: spectra backend torch-cuda needs a CUDA device, and torch sees none")
    assert list(tmp_path.iterdir()) == []  # no half-written report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_cuda_agrees_with_lapack(tmp_path):
    items = matrices()
    lapack, _ = compute_spectra(items, targets=(0.9, 0.95, 0.99), backend=LapackBackend())
    cuda, stats = compute_spectra(items, targets=(0.9, 0.95, 0.99), backend=backend_for("torch-cuda"),
                                  cache=SpectrumCache(tmp_path))
    assert stats.computed == len(items)
    for name, ref in items:
        a, b = np.asarray(lapack[name].sigma), np.asarray(cuda[name].sigma)
        assert np.max(np.abs(a**2 - b**2)) <= eig_tol(a.shape[1]) * float(a.max()) ** 2, name


def test_the_json_report_is_the_same_whichever_backend(cli_inproc, tmp_path):
    out = {}
    for backend in ("lapack", "torch-cpu"):
        res = cli_inproc("sample_models/digits.py:mlp", "-q", "--format", "json", "--spectra-backend", backend,
                         "--cache-dir", str(tmp_path))
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        out[backend] = doc
    a, b = out["lapack"], out["torch-cpu"]
    same = lambda d: ({n: (s["verdict"], s["rank"], s["ranks_for"]) for n, s in d["suggestions"].items()},  # noqa: E731
                      [(f["code"], f["layers"]) for f in d["findings"]], d["verdict"],
                      {n: s["method"] for n, s in d["spectra"].items()})
    assert same(a) == same(b)
    short = {l["name"]: min(l["m"], l["n"]) for l in a["layers"]}
    for n, s in a["suggestions"].items():  # energies: floats, within 2 k eig_tol(k) (test_gold.py's energy bound)
        k = short[n]
        assert s["energy_at_rank"] == pytest.approx(b["suggestions"][n]["energy_at_rank"], abs=2 * k * eig_tol(k))
