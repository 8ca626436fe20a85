"""Where the whitened decompositions run: here, on the audit's device, or on its Dask cluster (``--scheduler``,
docs/cluster.md).

A :class:`Decompositions` is what a session's statistics pass (tier 1's spectra, block by block), tier 3, the plan
check and ``factorize`` ask to make decompositions. Here it is :func:`~auditor.calibration.statistics.whiten.
whitened_spectra` on the host's LAPACK; with an accelerator (``--device cuda``) the same function with each layer
decomposed there (:mod:`.ondevice`); on a cluster, one Dask task per distinct layer input
(:class:`~auditor.calibration.statistics.remote.ClusterDecompositions`). ``where`` says which cluster tier 1's ran on,
once they did (empty: here).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...results import Layer
    from .stats import InputStatistics
    from .whiten import Truncator, WhitenedSpectrum


@dataclass
class Decompositions:
    """Where one model's decompositions run (module docstring): ``scheduler`` (an address or a ``distributed.Client``;
    None: here) with its ``path_map``; ``device``: tier 1's made there with torch (None: NumPy on the host)."""

    model: "nn.Module"
    scheduler: Any = None
    path_map: Sequence[tuple[str, str]] = ()
    where: str = ""  # the Dask cluster tier 1's decompositions ran on; empty: here
    device: "torch.device | None" = None  # an accelerator the audit runs on (--device cuda); None: the host's LAPACK

    @property
    def on_cluster(self) -> bool:
        """The audit gave a Dask scheduler (``--scheduler``): tier 1's and tier 3's decompositions run there."""
        return self.scheduler is not None

    def _cluster(self) -> Any:
        from .remote import ClusterDecompositions

        return ClusterDecompositions(self.scheduler, self.path_map, self.model)

    @contextlib.contextmanager
    def spectra(self) -> "Iterator[Callable[..., dict[str, WhitenedSpectrum]]]":
        """What computes tier 1's whitened spectra, called as ``whitened_spectra(layers, weights, stats, align,
        target, progress=..., keep=...)``: on the cluster one task per distinct layer input (its client open while
        the block runs; ``keep`` ignored there: the decompositions stay on the workers, and tier 3 asks for them
        with :meth:`truncators`), else :func:`~auditor.calibration.statistics.whiten.whitened_spectra` here."""
        if not self.on_cluster:
            from .whiten import whitened_spectra

            if self.device is None:
                yield whitened_spectra
                return
            from .ondevice import on

            yield functools.partial(whitened_spectra, decomposer=on(self.device))
            return
        with self._cluster() as cluster:  # one block, or one layer outside them, at a time
            def spectra(*args: Any, keep: Any = None, **kwargs: Any) -> "dict[str, WhitenedSpectrum]":
                return cluster.spectra(*args, **kwargs)  # none kept here: tier 3's made there as before

            yield spectra
            self.where = cluster.where  # asked while the client is open

    def weighted(self) -> "Callable[..., Any] | None":
        """What makes the gradient pass's loss-aware truncations: on the audit's device (``ondevice.weighted``), or
        None for NumPy's here (a cluster's audit makes them here too)."""
        if self.device is None:
            return None
        from .ondevice import weighted

        return weighted(self.device)

    def truncators(self, layers: "list[Layer]", stats: "InputStatistics", store: "MutableMapping[str, Truncator]",
                   progress: "Callable[[int, int], None] | None" = None) -> None:
        """On the cluster: the decompositions tier 3, the verification's candidates and ``factorize`` cut factors
        from (each of ``layers``' :class:`~auditor.calibration.statistics.whiten.Truncator` under ``stats``) made
        there, one task per distinct input, put into ``store`` one block at a time."""
        assert self.on_cluster, "not on a cluster"
        table = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        with self._cluster() as cluster:
            cluster.truncators(layers, table, stats, store, progress)


__all__ = ["Decompositions"]
