"""Singular values of every unique factorizable weight: exact to float64 SVD, cached, in parallel, anywhere.

The parts, each replaceable:

- :class:`SpectralBackend` (``backend.py``): computes singular values of a matrix stack. Default
  :class:`LapackBackend` (CPU float64 Gram + dsyevd, guarded, float64 SVD fallback); :class:`TorchBackend` runs the
  same on a torch device. :func:`backend_for` gives the one ``AuditOptions.spectra_backend`` names.
- :class:`SpectrumCache` (``cache.py``): values by content key and backend on disk, validated on read.
- :class:`Executor` (``executor.py``): runs picklable work items, yields results as they complete, cancels.
  Default :class:`ThreadExecutor`; :class:`ProcessExecutor` runs them in spawned processes.
- Work items (``work.py``): :class:`SpectrumTask` (layer name + :class:`auditor.sources.tensorref.TensorRef` + targets +
  backend) -> :class:`SpectrumResult`; :func:`compute_spectra` ties them together.

:class:`Engine` is the older entry point, kept as a thin adapter over :func:`compute_spectra`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..results import Layer, Spectrum
from ..sources.tensorref import TensorRef
from .backend import (CHUNK_ELEMENTS, EPS64, TARGET_MARGIN, TOLERANCE, LapackBackend, SkipSpectrum, SpectralBackend,
                      TorchBackend, available_memory, backend_for, cache_id, eig_svdvals, gram64, needs_exact,
                      needs_exact_energy, svd_svdvals)
from .cache import SpectrumCache, default_cache_dir, entry_key
from .executor import Executor, FuturesExecutor, ProcessExecutor, ThreadExecutor
from .work import (ENGINE_VERSION, SpectraStats, SpectrumResult, SpectrumTask, compute_spectra, compute_task,
                   content_key, finish, hash_task, memory_need, skip_reason)

__all__ = [
    "CHUNK_ELEMENTS", "ENGINE_VERSION", "EPS64", "TARGET_MARGIN", "TOLERANCE", "Engine", "Executor",
    "FuturesExecutor", "LapackBackend", "ProcessExecutor", "SkipSpectrum", "SpectraStats", "SpectralBackend",
    "SpectrumCache", "SpectrumResult", "SpectrumTask", "TensorRef", "ThreadExecutor", "TorchBackend",
    "available_memory", "backend_for", "cache_id", "compute_spectra", "compute_task", "content_key", "default_cache_dir", "eig_svdvals", "entry_key",
    "finish", "gram64", "hash_task", "memory_need", "needs_exact", "needs_exact_energy", "ref_for", "skip_reason",
    "svd_svdvals",
]


def ref_for(layer: Layer, source: TensorRef | torch.Tensor | Callable[[], torch.Tensor]) -> TensorRef:
    """A TensorRef with ``layer``'s matrix view, from a ref, a tensor, or a loader returning either."""
    if not isinstance(source, (TensorRef, torch.Tensor)):
        source = source()
    if isinstance(source, torch.Tensor):
        return TensorRef.of_tensor(source, layer.param, str(layer.kind), layer.m, layer.n, layer.groups)
    return source.with_view(str(layer.kind), layer.m, layer.n, layer.groups)


def _bar(done: int, total: int) -> None:
    bar = "#" * int(30 * done / total)
    print(f"\rspectra [{bar:<30}] {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


class Engine:
    """``Engine(targets, cache_dir=, use_cache=, workers=, progress=)`` + ``.run([(layer, loader)])`` + ``.stats``:
    the pre-protocol entry point, over :func:`compute_spectra` with a thread executor and the LAPACK backend."""

    def __init__(
        self,
        targets: Iterable[float] = (0.90, 0.95, 0.99),
        cache_dir: Path | None = None,
        use_cache: bool = True,
        workers: int | None = None,
        progress: bool | None = None,
        backend: SpectralBackend | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.targets = tuple(targets)
        self.cache = SpectrumCache(cache_dir) if use_cache else None
        self.cache_dir = self.cache.directory if self.cache else (cache_dir or default_cache_dir())
        self.use_cache = use_cache
        self.executor = executor or ThreadExecutor(workers)
        self.workers = getattr(self.executor, "workers", workers or 1)
        self.backend = backend or LapackBackend()
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.stats = SpectraStats()

    def run(self, items: list[tuple[Layer, TensorRef | Callable[[], torch.Tensor]]]) -> dict[str, Spectrum]:
        """Spectra for (layer, tensor reference or loader) pairs, largest first so the pool stays busy; the
        result is in that order too."""
        order = sorted(items, key=lambda it: -it[0].params)
        pairs = [(layer, ref_for(layer, src)) for layer, src in order]
        out, stats = compute_spectra([(layer.name, ref) for layer, ref in pairs], targets=self.targets,
                                     backend=self.backend, executor=self.executor, cache=self.cache,
                                     progress=_bar if self.progress and pairs else None)
        for f in ("computed", "cached", "exact_fallbacks", "skipped"):
            setattr(self.stats, f, getattr(self.stats, f) + getattr(stats, f))
        return out

    def one(self, layer: Layer, t: torch.Tensor | TensorRef) -> Spectrum:
        """The spectrum of one weight."""
        return self.run([(layer, t)])[layer.name]
