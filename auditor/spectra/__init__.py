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
"""

from __future__ import annotations

from typing import Callable

import torch

from ..results import Layer
from ..sources.tensorref import TensorRef
from .backend import (CHUNK_ELEMENTS, EPS64, TARGET_MARGIN, TOLERANCE, LapackBackend, SkipSpectrum, SpectralBackend,
                      TorchBackend, available_memory, backend_for, cache_id, eig_svdvals, gram64, needs_exact,
                      needs_exact_energy, svd_svdvals)
from .cache import SpectrumCache, default_cache_dir, entry_key
from .executor import Executor, FuturesExecutor, ProcessExecutor, ThreadExecutor
from .work import (ENGINE_VERSION, SpectraStats, SpectrumResult, SpectrumTask, compute_spectra, compute_task,
                   content_key, finish, hash_task, memory_need, skip_reason)

__all__ = [
    "CHUNK_ELEMENTS", "ENGINE_VERSION", "EPS64", "TARGET_MARGIN", "TOLERANCE", "Executor",
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

