"""Spectral backends: singular values of a stack of matrices, exact to float64 SVD within ``TOLERANCE``.

The default, :class:`LapackBackend`, takes the eigenvalues of the float64 Gram matrix of the short side (W^T W or
W W^T): sigma_i = sqrt(lambda_i). Its absolute error in lambda is about k * eps64 * sigma_max^2, so sigma is off by at
most sqrt(k * eps64) * sigma_max (4.7e-7 relative at k = 1024) and far less for all but near-zero values. A guard
falls back to a float64 SVD (LAPACK gesdd) where that bound could exceed the tolerance, or where a cumulative energy
lands so close to an energy target that the rank for it could flip.

Every backend first scales W by a power of two c (exact in binary floating point) so that max |cW| lies in
[0.5, 1): sigma(cW) = c sigma(W), so weights near 1e200 cannot overflow the Gram and weights near 1e-200 cannot
underflow it. Values come back unscaled; callers derive energies from sigma / sigma_max.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from . import _lapack

EPS64 = float(np.finfo(np.float64).eps)
TOLERANCE = 1e-6  # singular values agree with a float64 SVD to this, relative to sigma_max
TARGET_MARGIN = 1e-9  # an energy this close to a target sends the layer to the float64 SVD
CHUNK_ELEMENTS = 1 << 20  # rows (or columns) are upcast to float64 this many elements at a time
SYRK_TILE = 8192  # Gram matrices wider than this are built in tiles (see _lapack.syrk)
MAX_SHORT_SIDE = 46340  # LAPACK's 32-bit indices: k * k must stay below 2**31
GIB = float(1 << 30)


class SkipSpectrum(Exception):
    """Raised by a backend for a matrix it cannot give a spectrum of, with the reason shown in the report."""


@runtime_checkable
class SpectralBackend(Protocol):
    """Computes singular values. Implementations must be picklable (they travel with work items)."""

    name: str

    def memory_need(self, m: int, n: int, groups: int) -> int:
        """Bytes of working memory beyond the stored tensor for one matrix stack of this shape."""
        ...

    def refuse(self, m: int, n: int, groups: int) -> str:
        """A reason this shape cannot be done here (empty when it can), decided before any memory is taken."""
        ...

    def svdvals(self, mats: torch.Tensor, targets: Sequence[float]) -> tuple[np.ndarray, str]:
        """(groups x min(m, n) float64 array of descending singular values, method) for a (groups, m, n) stack of
        floating-point matrices on any device. Raises :class:`SkipSpectrum` for non-finite or all-zero input."""
        ...


_MEMORY_SEEN: list[tuple[float, int | None]] = []  # (monotonic time, bytes): one read serves 0.2 s of small tasks


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, lowered to the cgroup's limit where one is set."""
    now = time.monotonic()
    if _MEMORY_SEEN and now - _MEMORY_SEEN[-1][0] < 0.2:
        return _MEMORY_SEEN[-1][1]
    avail = _read_available()
    _MEMORY_SEEN[:] = [(now, avail)]
    return avail


def _read_available() -> int | None:
    avail: int | None = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read().strip())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of a CPU tensor (None for bfloat16, which NumPy lacks). NumPy does the per-block copies and
    maxima single-threaded, so no second thread pool (torch's OpenMP) spins beside the BLAS workers."""
    return t.numpy() if t.dtype != torch.bfloat16 else None


def health(mats: torch.Tensor) -> float:
    """max |w| over the stack, read in blocks (no full-size temporary). Raises SkipSpectrum for NaN/Inf entries or an
    all-zero weight."""
    if mats.device.type != "cpu":
        mats = mats.to("cpu")
    flat = mats.reshape(mats.shape[0] * mats.shape[1], -1) if mats.numel() else mats.reshape(0, 1)
    arr = _numpy(flat)
    step = max(1, CHUNK_ELEMENTS // max(flat.shape[1], 1))
    amax = 0.0
    for start in range(0, flat.shape[0], step):
        if arr is not None:
            blk = arr[start : start + step]
            v = max(float(blk.max()), -float(blk.min()))  # NaN propagates through max/min, not through max()
        else:
            v = float(flat[start : start + step].abs().amax())
        if not math.isfinite(v):
            amax = v
            break
        amax = max(amax, v)
    if not math.isfinite(amax):
        bad = sum(int((~torch.isfinite(flat[s : s + step])).sum()) for s in range(0, flat.shape[0], step))
        raise SkipSpectrum(f"non-finite values ({bad:,} NaN/Inf entries)")
    if amax == 0.0:
        raise SkipSpectrum("all-zero weight")
    return amax


def scale_for(amax: float) -> float:
    """The power of two c with c * amax in [0.5, 1)."""
    return math.ldexp(1.0, -math.frexp(amax)[1])


def gram64(a: torch.Tensor, scale: float = 1.0) -> np.ndarray:
    """The float64 Gram matrix of the short side of ``scale * a`` (W^T W or W W^T) as a Fortran-ordered array whose
    upper triangle holds it (BLAS dsyrk: half the flops of a general product), accumulated over blocks of the long
    side. Each block is converted (any float dtype, bfloat16 included) and scaled into one reused float64 buffer, so
    memory stays near the stored tensor plus k x k. Without the GIL (see ``_lapack``) where SciPy allows it."""
    if a.device.type != "cpu":
        a = a.to("cpu")
    m, n = a.shape
    tall = m >= n
    k, long = (n, m) if tall else (m, n)
    step = max(1, min(long, CHUNK_ELEMENTS // max(k, 1)))
    src = _numpy(a)
    flat = np.empty(step * k, dtype=np.float64)
    g = np.zeros((k, k), dtype=np.float64, order="F")
    gil_free = _lapack.available()
    if not gil_free:
        from scipy.linalg.blas import dsyrk  # SciPy's wrapper: the same routine, holding the GIL
    for start in range(0, long, step):
        rows = min(step, long - start)
        blk = flat[: rows * k].reshape((rows, k) if tall else (k, rows))  # C-ordered and contiguous
        if src is not None:
            np.multiply(src[start : start + rows] if tall else src[:, start : start + rows], scale, out=blk,
                        dtype=np.float64)  # upcast, then scale by a power of two: exact
        else:  # bfloat16: torch converts the block
            bt = torch.from_numpy(blk)
            bt.copy_(a[start : start + rows] if tall else a[:, start : start + rows])
            bt.mul_(scale)  # a power of two: exact
        beta = 0.0 if start == 0 else 1.0
        if gil_free:
            _lapack.syrk(g, blk, k_rows=tall, beta=beta, tile=SYRK_TILE)
        elif k <= SYRK_TILE:  # blk.T is a Fortran-ordered view, not a copy
            g = dsyrk(1.0, blk.T, beta=beta, c=g, trans=0 if tall else 1, lower=0, overwrite_c=1)
        else:  # no wide dsyrk from this OpenBLAS: the whole product in NumPy's BLAS
            x = blk if tall else blk.T
            g += x.T @ x
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


def svd_svdvals(a: torch.Tensor, scale: float = 1.0) -> np.ndarray:
    """The reference path: LAPACK's float64 SVD of ``scale * a``, values only."""
    x = a.detach().to(device="cpu", dtype=torch.float64)
    if scale != 1.0:
        x = x * scale
    return np.linalg.svd(x.numpy(), compute_uv=False)


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


def _too_large(k: int, need: int) -> str:
    return (f"short side {k:,} too large for an exact spectrum here: the float64 Gram needs {need / GIB:.1f} GiB"
            + (f", and LAPACK's 32-bit indices stop at {MAX_SHORT_SIDE:,}" if k > MAX_SHORT_SIDE else ""))


@dataclass(frozen=True)
class LapackBackend:
    """CPU, float64: blocked Gram (dsyrk) + dsyevd, guarded, with a float64 SVD fallback. The default."""

    name: str = "lapack-gram"

    @property
    def cache_id(self) -> str:
        """What the spectrum cache keys this backend's entries by (see :func:`auditor.spectra.cache.entry_key`)."""
        return self.name

    def memory_need(self, m: int, n: int, groups: int) -> int:
        k = min(m, n)
        return 8 * (k * k + min(CHUNK_ELEMENTS, max(m, n) * k) + groups * k)

    def svd_memory_need(self, m: int, n: int) -> int:
        """The float64 copy, gesdd's own copy, and its values-only workspace."""
        k = min(m, n)
        return 8 * (2 * m * n + 7 * k + max(m, n))

    def refuse(self, m: int, n: int, groups: int) -> str:
        k = min(m, n)
        need = self.memory_need(m, n, groups)
        if k > MAX_SHORT_SIDE:
            return _too_large(k, need)
        avail = available_memory()
        if avail is not None and need > avail:
            return _too_large(k, need) + f", {avail / GIB:.1f} GiB available"
        return ""

    def svdvals(self, mats: torch.Tensor, targets: Sequence[float]) -> tuple[np.ndarray, str]:
        groups, m, n = mats.shape
        k = min(m, n)
        amax = health(mats)
        c = scale_for(amax)
        sig = np.empty((groups, k))
        method = "gram-eigh"
        exact = [False] * groups
        for gi in range(groups):
            g = gram64(mats[gi], c)
            try:
                sig[gi] = eig_svdvals(g)
                exact[gi] = needs_exact(sig[gi], k, targets if groups == 1 else ())
            except np.linalg.LinAlgError:  # the eigensolver did not converge: the SVD decides
                exact[gi] = True
            del g
        if groups > 1 and needs_exact_energy(sig, targets):
            exact = [True] * groups
        if any(exact):
            avail = available_memory()
            need = self.svd_memory_need(m, n)
            if avail is not None and need > avail:
                raise SkipSpectrum(f"the float64 SVD this matrix needs takes {need / GIB:.1f} GiB, "
                                   f"{avail / GIB:.1f} GiB available")
            for gi in range(groups):
                if exact[gi]:
                    sig[gi] = svd_svdvals(mats[gi], c)
            method = "svd-f64"
        return unscale(sig, c), method


def unscale(sig: np.ndarray, c: float) -> np.ndarray:
    out = sig / c  # a power of two: exact unless it overflows
    if not np.isfinite(out).all():
        raise SkipSpectrum(f"singular values overflow float64 (largest {float(sig.max())!r} x 2^{-math.frexp(c)[1] + 1})")
    return out


@dataclass(frozen=True)
class TorchBackend:
    """Float64 on a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``): the same scaling, Gram + eigvalsh path,
    guard and SVD fallback, with torch's linear algebra. One float64 copy of one matrix and its Gram live on the
    device at a time."""

    device: str = "cuda"
    name: str = "torch"

    @property
    def cache_id(self) -> str:
        """``torch-cpu`` or ``torch-cuda`` (any CUDA index): the cache keeps each device type's entries apart."""
        return f"{self.name}-{torch.device(self.device).type}"

    def memory_need(self, m: int, n: int, groups: int) -> int:
        return 8 * (m * n + min(m, n) ** 2)  # host side is untouched; this is device memory

    def refuse(self, m: int, n: int, groups: int) -> str:
        if self.device.startswith("cuda"):
            if here and not torch.cuda.is_available():
                return f"device {self.device} is not available"
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            need = self.memory_need(m, n, groups)
            if need > free:
                return (f"short side {min(m, n):,} too large for an exact spectrum on {self.device}: needs "
                        f"{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
        return ""

    def svdvals(self, mats: torch.Tensor, targets: Sequence[float]) -> tuple[np.ndarray, str]:
        groups, m, n = mats.shape
        k = min(m, n)
        dev = torch.device(self.device)
        amax = health(mats)
        c = scale_for(amax)
        sig = np.empty((groups, k))
        exact = [False] * groups
        for gi in range(groups):
            a = mats[gi].to(device=dev, dtype=torch.float64) * c
            g = a.mT @ a if m >= n else a @ a.mT
            try:
                lam = torch.linalg.eigvalsh(g).flip(0).clamp_min(0).sqrt()
                sig[gi] = lam.cpu().numpy()
                exact[gi] = needs_exact(sig[gi], k, targets if groups == 1 else ())
            except torch.linalg.LinAlgError:
                exact[gi] = True
        if groups > 1 and needs_exact_energy(sig, targets):
            exact = [True] * groups
        method = "gram-eigh"
        if any(exact):
            for gi in range(groups):
                if exact[gi]:
                    a = mats[gi].to(device=dev, dtype=torch.float64) * c
                    sig[gi] = torch.linalg.svdvals(a).cpu().numpy()
            method = "svd-f64"
        return unscale(sig, c), method


def backend_for(choice: str, here: bool = True) -> SpectralBackend:
    """The backend an :class:`auditor.options.SpectraBackend` names: ``lapack`` (the default), ``torch-cpu``,
    ``torch-cuda``. An AuditError for any other name, and, when it is to run ``here`` (not on a cluster's
    workers), for ``torch-cuda`` where torch sees no CUDA device (every layer would be skipped)."""
    from ..errors import AuditError
    from ..options import SpectraBackend

    try:
        which = SpectraBackend(choice)
    except ValueError:
        raise AuditError(f"unknown spectra backend {choice!r}",
                         f"Choose from {', '.join(b.value for b in SpectraBackend)}") from None
    if which == SpectraBackend.TORCH_CUDA:
        if here and not torch.cuda.is_available():
            raise AuditError("spectra backend torch-cuda needs a CUDA device, and torch sees none "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})",
                             "Use --spectra-backend lapack (the default) or torch-cpu")
        return TorchBackend("cuda")
    if which == SpectraBackend.TORCH_CPU:
        return TorchBackend("cpu")
    return LapackBackend()


def cache_id(backend: SpectralBackend) -> str:
    """The name the spectrum cache keys a backend's entries by: its ``cache_id`` where it has one, else its
    ``name``."""
    return str(getattr(backend, "cache_id", None) or backend.name)
