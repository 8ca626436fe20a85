"""Singular values of every unique factorizable weight: fast, exact enough, cached, in parallel.

Only the values are needed, never U or V. The fast path takes the eigenvalues of the float64 Gram matrix of the short
side (W^T W or W W^T): sigma_i = sqrt(lambda_i). Its absolute error in lambda is about k * eps64 * sigma_max^2, so
sigma is off by at most sqrt(k * eps64) * sigma_max (4.7e-7 relative at k = 1024) and far less for all but
near-zero values. A guard falls back to a float64 SVD (LAPACK gesdd) where that bound could exceed the tolerance, or
where a cumulative energy lands so close to an energy target that the rank for it could flip.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from . import _lapack
from .layers import matrix_view
from .results import Layer, Spectrum

ENGINE_VERSION = "3"
EPS64 = float(np.finfo(np.float64).eps)
TOLERANCE = 1e-6  # singular values agree with a float64 SVD to this, relative to sigma_max
TARGET_MARGIN = 1e-9  # an energy this close to a target sends the layer to the float64 SVD


def default_cache_dir() -> Path:
    env = os.environ.get("LOWRANK_AUDITOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowrank-auditor" / "spectra"


CHUNK_ELEMENTS = 1 << 20  # rows (or columns) are upcast to float64 this many elements at a time


def gram64(a: torch.Tensor) -> np.ndarray:
    """The float64 Gram matrix of the short side (W^T W or W W^T) as a Fortran-ordered array whose upper triangle
    holds it (BLAS dsyrk: half the flops of a general product), accumulated over blocks of the long side. Each block
    is upcast into one reused float64 buffer, so memory stays near the stored tensor plus k x k, and no fresh pages
    are faulted in per block. Without the GIL (see ``_lapack``) where SciPy allows it."""
    m, n = a.shape
    tall = m >= n
    k, long = (n, m) if tall else (m, n)
    step = max(1, min(long, CHUNK_ELEMENTS // max(k, 1)))
    src = a.numpy() if a.dtype != torch.bfloat16 else a.float().numpy()
    flat = np.empty(step * k, dtype=np.float64)
    g = np.zeros((k, k), dtype=np.float64, order="F")
    gil_free = _lapack.available()
    if not gil_free:
        from scipy.linalg.blas import dsyrk  # SciPy's wrapper: the same routine, holding the GIL
    for start in range(0, long, step):
        rows = min(step, long - start)
        blk = flat[: rows * k].reshape((rows, k) if tall else (k, rows))  # C-ordered and contiguous
        np.copyto(blk, src[start : start + rows] if tall else src[:, start : start + rows])
        beta = 0.0 if start == 0 else 1.0
        if gil_free:
            _lapack.syrk(g, blk, k_rows=tall, beta=beta)
        else:  # blk.T is a Fortran-ordered view, not a copy
            g = dsyrk(1.0, blk.T, beta=beta, c=g, trans=0 if tall else 1, lower=0, overwrite_c=1)
    return g


def eig_svdvals(g: np.ndarray) -> np.ndarray:
    """Singular values (descending) from the eigenvalues of a Gram matrix given by its upper triangle (the array
    is overwritten)."""
    if _lapack.available() and g.flags.f_contiguous:
        lam = _lapack.eigvalsh_upper(g)
    else:
        from scipy.linalg import eigh

        lam = eigh(g, lower=False, eigvals_only=True, driver="evd", check_finite=False, overwrite_a=True)
    return np.sqrt(np.clip(lam[::-1], 0.0, None))


def gram_svdvals(a: torch.Tensor) -> np.ndarray:
    """Singular values (descending) of a matrix from the eigenvalues of its float64 short-side Gram matrix."""
    return eig_svdvals(gram64(a))


def svd_svdvals(a: torch.Tensor) -> np.ndarray:
    """The reference path: LAPACK's float64 SVD, values only."""
    return np.linalg.svd(a.to(torch.float64).numpy(), compute_uv=False)


def gram_error(k: int, lam_max: float) -> float:
    """Expected size of the eigenvalue error of the float64 Gram path: the products are exact (float32 inputs),
    the sums and the eigensolver add about eps64 * sqrt(k) * lambda_max; ten times that is the bound used."""
    return 10.0 * math.sqrt(k) * EPS64 * lam_max


def needs_exact(sigma: np.ndarray, k: int, targets: Iterable[float]) -> bool:
    """True when the Gram path could miss the tolerance, or an energy target sits on a knife edge.

    A value sigma_i moves by at most min(sqrt(d), d / (2 sigma_i)) for an eigenvalue error d: only values below
    d / (tol * sigma_max) can be off by more than tol * sigma_max / 2, and only if sqrt(d) is that large at all
    (k above about 13,000)."""
    s2 = sigma.astype(np.float64) ** 2
    total = s2.sum()
    if total <= 0:
        return False
    d = gram_error(k, s2[0])
    if math.sqrt(d) > 0.5 * TOLERANCE * sigma[0] and (sigma < d / (TOLERANCE * sigma[0])).any():
        return True
    return _near_target(s2, targets, max(TARGET_MARGIN, k * d / total))


def _near_target(s2: np.ndarray, targets: Iterable[float], margin: float) -> bool:
    """Does the cumulative energy of these squared values come within ``margin`` of any target?"""
    total = s2.sum()
    if total <= 0:
        return False
    cum = np.cumsum(s2) / total
    return any(np.any(np.abs(cum - t) < margin) for t in targets)


def needs_exact_energy(sig: np.ndarray, targets: Iterable[float]) -> bool:
    """Grouped matrices: is a combined cumulative energy within the margin of a target?"""
    return _near_target((sig**2).sum(axis=0), targets, TARGET_MARGIN)



HASH_THREADS_FROM = 4 << 20  # bytes: a tensor larger than this is hashed on all cores


def _hash(t: torch.Tensor, layer: Layer) -> str:
    """Content key of a weight: BLAKE3 (a cryptographic hash, SIMD and multithreaded: 1.8 times sha256 on one core
    here, 3.6 times on two) over the layout and the raw bytes, read in place."""
    from blake3 import blake3

    c = t.detach().contiguous()
    if c.dtype == torch.bfloat16:
        c = c.view(torch.int16)
    raw = memoryview(c.reshape(-1).numpy()).cast("B")  # no copy
    h = blake3(max_threads=blake3.AUTO if len(raw) > HASH_THREADS_FROM else 1)
    h.update(f"{ENGINE_VERSION}|{layer.kind}|{layer.m}x{layer.n}x{layer.groups}|{t.dtype}|".encode())
    h.update(raw)  # the GIL is released while it hashes
    return h.hexdigest()


def skip_reason(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "on the meta device: structure only, no values"
    if t.is_quantized or t.dtype in (torch.int8, torch.uint8, torch.qint8, torch.quint8):
        return f"quantized ({str(t.dtype).replace('torch.', '')}): dequantize before a spectral audit"
    if not t.is_floating_point():
        return f"not a floating-point tensor ({t.dtype})"
    return ""


def _finish(layer: Layer, sigma: np.ndarray, method: str, dtype: torch.dtype) -> Spectrum:
    """Derived numbers from per-group singular values (groups x k)."""
    s2 = sigma**2
    frob2 = float(s2.sum())
    cum = np.cumsum(s2.sum(axis=0)) / frob2  # every group cut at the same rank r
    cum = np.minimum(cum, 1.0)
    cum[-1] = 1.0
    smax = float(sigma.max())
    flat = sigma.ravel()
    p = flat / flat.sum()
    p = p[p > 0]
    eff = float(math.exp(-(p * np.log(p)).sum()))
    eps = float(torch.finfo(dtype).eps) if dtype.is_floating_point else EPS64
    tol = smax * max(layer.m, layer.n) * eps
    num_rank = int((sigma > tol).sum(axis=1).max())
    return Spectrum(
        layer=layer.name,
        sigma=sigma.tolist(),
        method=method,
        frob2=frob2,
        stable_rank=frob2 / (smax**2) if smax > 0 else 0.0,
        effective_rank=eff,
        numerical_rank=num_rank,
        energy=cum.tolist(),
    )


@dataclass
class SpectraStats:
    computed: int = 0
    cached: int = 0
    exact_fallbacks: int = 0
    skipped: int = 0


class Engine:
    def __init__(
        self,
        targets: Iterable[float] = (0.90, 0.95, 0.99),
        cache_dir: Path | None = None,
        use_cache: bool = True,
        workers: int | None = None,
        progress: bool | None = None,
    ) -> None:
        self.targets = tuple(targets)
        self.cache_dir = cache_dir or default_cache_dir()
        self.use_cache = use_cache
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.stats = SpectraStats()
        self._lock = threading.Lock()

    def one(self, layer: Layer, t: torch.Tensor) -> Spectrum:
        reason = skip_reason(t)
        if reason:
            return self._skip(layer, reason)
        t = t.detach()
        key = _hash(t, layer) if self.use_cache else ""
        path = self.cache_dir / key[:2] / f"{key}.f64"  # raw float64, groups x k: no header to parse
        if key:
            if path.exists():
                try:
                    sigma = np.fromfile(path, dtype=np.float64).reshape(layer.groups, min(layer.m, layer.n))
                    with self._lock:
                        self.stats.cached += 1
                    return _finish(layer, sigma, "cache", t.dtype)
                except Exception:  # noqa: BLE001 - a corrupt cache entry is recomputed
                    pass
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()  # upcast per tensor; float64 happens block by block inside gram64
        mats = matrix_view(layer, t)
        k = min(layer.m, layer.n)
        sig = np.empty((layer.groups, k))
        method = "gram-eigh"
        for gi in range(layer.groups):
            # The Gram matrix doubles as the health check: float32 products cannot overflow float64, so it is
            # finite exactly when W is, and its trace (||W||_F^2) is zero exactly when W is all zero.
            g = gram64(mats[gi])
            if not np.isfinite(g).all():
                bad = int((~torch.isfinite(mats)).sum())
                return self._skip(layer, f"non-finite values ({bad:,} NaN/Inf entries)")
            if gi == 0 and np.trace(g) == 0 and not mats.any():
                return self._skip(layer, "all-zero weight")
            try:
                sig[gi] = eig_svdvals(g)
                exact = needs_exact(sig[gi], k, self.targets if layer.groups == 1 else ())
            except np.linalg.LinAlgError:  # the eigensolver did not converge: the SVD decides
                exact = True
            if exact:
                sig[gi] = svd_svdvals(mats[gi])
                method = "svd-f64"
        if layer.groups > 1 and needs_exact_energy(sig, self.targets):
            for gi in range(layer.groups):
                sig[gi] = svd_svdvals(mats[gi])
            method = "svd-f64"
        if method == "svd-f64":
            with self._lock:
                self.stats.exact_fallbacks += 1
        with self._lock:
            self.stats.computed += 1
        if key:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                with open(tmp, "wb") as fh:
                    sig.tofile(fh)
                os.replace(tmp, path)
            except OSError:
                pass  # a read-only cache is not an error
        return _finish(layer, sig, method, t.dtype)

    def _skip(self, layer: Layer, reason: str) -> Spectrum:
        with self._lock:
            self.stats.skipped += 1
        return Spectrum(layer=layer.name, sigma=None, skipped=reason)

    def run(self, items: list[tuple[Layer, Callable[[], torch.Tensor]]]) -> dict[str, Spectrum]:
        """Spectra for (layer, tensor loader) pairs, largest first so the pool stays busy.

        Tensors are loaded only when a worker starts on them, and at most about two of the largest tensors' worth
        of weights are in flight at once, so memory stays near the model's largest weight, not its size."""
        order = sorted(items, key=lambda it: -it[0].params)
        out: dict[str, Spectrum] = {}
        total = len(order)
        sizes = [4 * it[0].params for it in order]
        budget = max(2 * max(sizes, default=0), 256 << 20)
        inflight = [0]
        cond = threading.Condition()

        def work(i: int) -> Spectrum:
            layer, load = order[i]
            need = min(sizes[i], budget)
            with cond:
                cond.wait_for(lambda: inflight[0] == 0 or inflight[0] + need <= budget)
                inflight[0] += need
            try:
                with torch.no_grad():
                    return self.one(layer, load())
            finally:
                with cond:
                    inflight[0] -= need
                    cond.notify_all()

        # Layers run side by side only where the BLAS/LAPACK calls drop the GIL; each worker then gets an equal
        # share of the cores for its BLAS (one thread each on a small machine), which beats one layer at a time on
        # all cores: the eigensolver's matrix-vector half does not scale across threads, separate layers do.
        workers = min(self.workers, total) if _lapack.available() else 1
        cap = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
        done = 0
        with _lapack.blas_threads(cap), ThreadPoolExecutor(max_workers=workers) as pool:
            for (layer, _), spec in zip(order, pool.map(work, range(total))):
                out[layer.name] = spec
                done += 1
                if self.progress:
                    bar = "#" * int(30 * done / total)
                    print(f"\rspectra [{bar:<30}] {done}/{total}", end="", file=sys.stderr, flush=True)
        if self.progress and total:
            print(file=sys.stderr)
        return out
