"""Work items and the orchestration: hash, look up the cache, compute the misses on an executor, derive spectra.

Everything that crosses to a worker is plain data: a :class:`SpectrumTask` (layer name, :class:`TensorRef`, energy
targets, backend) goes out, a :class:`SpectrumResult` (layer name, singular values, method, content key, seconds)
comes back. The cache, progress and statistics stay with the caller.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .. import kinds
from ..results import Spectrum
from ..sources.tensorref import TensorRef
from .backend import EPS64, LapackBackend, SkipSpectrum, SpectralBackend, cache_id
from .cache import SpectrumCache
from .executor import Executor, ThreadExecutor

ENGINE_VERSION = "4"
HASH_THREADS_FROM = 4 << 20  # bytes: a tensor larger than this is hashed on all cores
QUANTIZED = {"int8", "uint8", "qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


@dataclass(frozen=True)
class SpectrumTask:
    """One unit of work: the spectrum of one weight. Picklable when its ref is a file reference."""

    layer: str
    ref: TensorRef
    targets: tuple[float, ...]
    backend: SpectralBackend = field(default_factory=LapackBackend)
    key: str = ""  # content key when the caller hashed it (the worker passes it back)


@dataclass(frozen=True)
class SpectrumResult:
    """What a worker returns: plain data."""

    layer: str
    sigma: np.ndarray | None  # groups x min(m, n), float64, descending; None when skipped
    method: str = ""  # "gram-eigh" | "svd-f64" | "cache"
    key: str = ""
    skipped: str = ""
    seconds: float = 0.0


@dataclass
class SpectraStats:
    computed: int = 0
    cached: int = 0
    exact_fallbacks: int = 0
    skipped: int = 0

    def add(self, r: SpectrumResult) -> None:
        if r.sigma is None:
            self.skipped += 1
        elif r.method == "cache":
            self.cached += 1
        else:
            self.computed += 1
            self.exact_fallbacks += r.method == "svd-f64"


def skip_reason(t: torch.Tensor | TensorRef) -> str:
    """Why a tensor has no spectrum (empty when it has one), from its metadata alone."""
    ref = t if isinstance(t, TensorRef) else TensorRef.of_tensor(t, "", "", 0, 0)
    if ref.device == "meta":
        return "on the meta device: structure only, no values"
    if ref.layout != "strided":
        return f"a {ref.layout} tensor: densify it (to_dense()) before a spectral audit"
    dt = ref.dtype
    if dt in QUANTIZED or (ref.data is not None and ref.data.is_quantized):
        return f"quantized ({dt}): dequantize before a spectral audit"
    if dt.startswith(("float8_", "float4_", "float6_")):
        return f"{dt} weights: upcast to bfloat16 or float32 before a spectral audit"
    torch_dt = getattr(torch, dt, None)
    if not isinstance(torch_dt, torch.dtype) or not torch_dt.is_floating_point:
        return f"not a floating-point tensor ({dt})"
    if any(s == 0 for s in ref.shape) or (ref.m == 0 or ref.n == 0) and ref.kind:
        return f"zero-sized tensor (shape {tuple(ref.shape)})"
    return ""


def content_key(ref: TensorRef) -> str:
    """Cache key: BLAKE3 (a cryptographic hash, SIMD and multithreaded: 1.8 times sha256 on one core here, 3.6
    times on two) over the engine version, the matrix view, the dtype and the raw bytes, read in place."""
    from blake3 import blake3

    raw = ref.raw_bytes()
    h = blake3(max_threads=blake3.AUTO if len(raw) > HASH_THREADS_FROM else 1)
    h.update(f"{ENGINE_VERSION}|{ref.kind}|{ref.m}x{ref.n}x{ref.groups}|torch.{ref.dtype}|".encode())
    h.update(raw)  # the GIL is released while it hashes
    return h.hexdigest()


def hash_task(task: SpectrumTask) -> str:
    """Work function: the content key of a task's tensor."""
    return content_key(task.ref)


def _view(ref: TensorRef, t: torch.Tensor) -> torch.Tensor:
    """The tensor as its kind reads it: (groups, m, n)."""
    return kinds.for_kind(ref.kind).matrices(t, ref.groups, ref.m, ref.n)


def compute_task(task: SpectrumTask) -> SpectrumResult:
    """Work function: the singular values of one task's tensor, read by the worker itself."""
    t0 = time.perf_counter()
    ref = task.ref
    refusal = task.backend.refuse(ref.m, ref.n, ref.groups)
    if refusal:
        return SpectrumResult(task.layer, None, key=task.key, skipped=refusal)
    try:
        with torch.no_grad():
            mats = _view(ref, ref.load())
            sigma, method = task.backend.svdvals(mats, task.targets)
    except SkipSpectrum as exc:
        return SpectrumResult(task.layer, None, key=task.key, skipped=str(exc))
    return SpectrumResult(task.layer, sigma, method, task.key, seconds=time.perf_counter() - t0)


def memory_need(task: SpectrumTask) -> int:
    """Bytes a task holds while it runs: its tensor (read or mapped) and the backend's working memory."""
    return task.ref.nbytes + task.backend.memory_need(task.ref.m, task.ref.n, task.ref.groups)


def finish(ref: TensorRef, layer: str, r: SpectrumResult) -> Spectrum:
    """A Spectrum with its derived numbers, computed from sigma / sigma_max so that no value under- or overflows:
    the energies, stable and effective ranks are scale-free; ``frob2`` is left None only if it exceeds float64."""
    if r.sigma is None:
        return Spectrum(layer=layer, sigma=None, skipped=r.skipped)
    sigma = r.sigma
    smax = float(sigma.max()) if sigma.size else 0.0
    if smax == 0.0:  # cannot come from a backend (all-zero is skipped); a defensive zero spectrum
        k = sigma.shape[1]
        return Spectrum(layer=layer, sigma=sigma.tolist(), method=r.method, energy=[1.0] * k)
    rel = sigma / smax
    s2 = rel**2
    total = float(s2.sum())
    cum = np.cumsum(s2.sum(axis=0)) / total  # every group cut at the same rank r
    cum = np.minimum(cum, 1.0)
    cum[-1] = 1.0
    flat = rel.ravel()
    p = flat / flat.sum()
    p = p[p > 0]
    eff = float(math.exp(-(p * np.log(p)).sum()))
    dt = getattr(torch, ref.dtype, None)
    eps = float(torch.finfo(dt).eps) if isinstance(dt, torch.dtype) and dt.is_floating_point else EPS64
    num_rank = int((rel > max(ref.m, ref.n) * eps).sum(axis=1).max())
    frob2 = total * smax * smax
    return Spectrum(
        layer=layer,
        sigma=sigma.tolist(),
        method=r.method,
        frob2=frob2 if math.isfinite(frob2) else None,  # type: ignore[arg-type]
        stable_rank=total,
        effective_rank=eff,
        numerical_rank=num_rank,
        energy=cum.tolist(),
    )


Progress = Callable[[int, int], None]


def _cache_misses(tasks: list[tuple[int, "SpectrumTask"]], executor: Executor, cache: SpectrumCache,
                  settle: Callable[[int, "SpectrumResult"], None]) -> list[tuple[int, "SpectrumTask"]]:
    """Every task's tensor hashed (on the executor), the cache's hits settled here; returns the misses, keyed."""
    todo = [t for _, t in tasks]
    keyed: list[tuple[int, SpectrumTask]] = [(0, todo[0])] * len(todo)
    for j, key in executor.run(hash_task, todo, [t.ref.nbytes for t in todo]):
        i, t = tasks[j]
        keyed[j] = (i, replace(t, key=key))
    misses: list[tuple[int, SpectrumTask]] = []
    for i, t in keyed:
        hit = cache.get(t.key, t.ref.groups, min(t.ref.m, t.ref.n))
        if hit is not None:
            settle(i, SpectrumResult(t.layer, hit, "cache", t.key))
        else:
            misses.append((i, t))
    return misses


def compute_spectra(
    items: Sequence[tuple[str, TensorRef]] | Iterable[tuple[str, TensorRef]],
    *,
    targets: Iterable[float],
    backend: SpectralBackend | None = None,
    executor: Executor | None = None,
    cache: SpectrumCache | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Spectrum], SpectraStats]:
    """Spectra for (layer name, tensor reference) pairs, in the order given (give the largest first: they are
    submitted in that order). With a cache, every tensor is hashed first (on the executor), hits are read back on
    this side, and only the misses are computed; their values are written to the cache here. ``progress(done,
    total)`` is called after each layer is settled."""
    pairs = list(items)
    backend = backend or LapackBackend()
    executor = executor or ThreadExecutor()
    if cache is not None:
        cache = cache.for_backend(cache_id(backend))  # each backend's values apart: never another's
    tg = tuple(targets)
    total = len(pairs)
    results: dict[int, SpectrumResult] = {}
    done = 0

    def settle(i: int, r: SpectrumResult) -> None:
        nonlocal done
        results[i] = r
        done += 1
        if progress is not None:
            progress(done, total)

    tasks: list[tuple[int, SpectrumTask]] = []
    for i, (layer, ref) in enumerate(pairs):
        reason = skip_reason(ref) or backend.refuse(ref.m, ref.n, ref.groups)  # again on the worker: its memory
        if reason:
            settle(i, SpectrumResult(layer, None, skipped=reason))
        else:
            tasks.append((i, SpectrumTask(layer, ref, tg, backend)))
    if cache is not None and tasks:
        tasks = _cache_misses(tasks, executor, cache, settle)
    work = [t for _, t in tasks]
    for j, r in executor.run(compute_task, work, [memory_need(t) for t in work]):
        if cache is not None and r.sigma is not None:
            cache.put(r.key, r.sigma)
        settle(tasks[j][0], r)
    stats = SpectraStats()
    spectra: dict[str, Spectrum] = {}
    for i, (layer, ref) in enumerate(pairs):
        stats.add(results[i])
        spectra[layer] = finish(ref, layer, results[i])
    return spectra, stats
