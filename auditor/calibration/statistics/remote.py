"""Tier 1's whitened decompositions as Dask tasks (``--scheduler``, docs/cluster.md).

One task per distinct layer input: the Gram once (q, k and v reading one input share one task) and the weights of
the layers that read it, as stored (a float32 weight travels as float32; the worker makes the float64 function
matrix exactly as the local path does). The task runs :func:`~auditor.calibration.statistics.whiten.whitened_spectrum`
on one BLAS thread, as :func:`~auditor.calibration.statistics.whiten.whitened_spectra` does here, so a worker on
the same NumPy and LAPACK returns the same bits. Results are the spectra (plain lists of floats), never a factor.

Decisions:

- **Task inputs, not ``client.scatter``.** The Gram and the weights are the task's own arguments: the scheduler
  keeps them until the task's result is gathered, so when a worker dies mid-task the scheduler runs the task again
  elsewhere (scattered data would die with the worker that held it, and its dependents with it). Each array crosses
  from this process once, whatever the number of layers reading it.
- **Memory here bounded by one block.** The statistics pass hands each block's layers over as the block completes
  and waits for their spectra before the next block's forward (the session's
  :class:`~auditor.calibration.statistics.placement.Decompositions`); statistics read back
  from the cache, and tier 3's decompositions, go one round at a time: consecutive parts (:func:`parts`: a
  repeated block's layers, or one layer outside the blocks, as
  :func:`~auditor.calibration.statistics.whiten.part_bytes` counts) until every worker has a task. Only one
  round's task inputs and results are alive at once, here and on the scheduler: a block's on a cluster of up to 4
  workers (a Llama block is 4 tasks), more blocks on a wider one, never a number that grows with the depth. In the
  statistics pass at most one block's tasks run at once, whatever the number of workers.
- **Failures.** :class:`~auditor.spectra.dask_executor.DaskExecutor`'s: a lost worker's task is rerun by the
  scheduler (``distributed.scheduler.allowed-failures``), a task that keeps failing is one line naming the layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping, Sequence

import numpy as np
import torch

from .stats import LayerInput, replace_gram
from .whiten import WhitenedSpectrum, whitened_spectrum

if TYPE_CHECKING:
    from ...results import Layer
    from .stats import InputStatistics
    from .whiten import Truncator

@dataclass(frozen=True)
class InputTask:
    """The decompositions of every layer reading one input: its Gram (sent once), each layer's weight as stored and
    its statistics' fields (``LayerInput`` without the Gram), the ranks' alignment and the error target."""

    layer: str  # the first layer's name: the executor names the task, and a failure, by it
    gram: np.ndarray
    layers: tuple["Layer", ...]
    weights: tuple[torch.Tensor, ...]
    inputs: tuple[LayerInput, ...]  # gram=None: the task's Gram is theirs
    align: int
    target: float

    @property
    def nbytes(self) -> int:
        """Bytes of arrays the task carries: the Gram and the weights."""
        return int(self.gram.nbytes) + sum(w.numel() * w.element_size() for w in self.weights)


def spectra_task(task: InputTask) -> list[WhitenedSpectrum]:
    """Work function: the whitened spectrum of each of the task's layers, on one BLAS thread (as the local path)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return [whitened_spectrum(layer, w, replace_gram(inp, task.gram), task.align, task.target)
                for layer, w, inp in zip(task.layers, task.weights, task.inputs)]


def truncator_task(task: InputTask) -> list[tuple[str, list[np.ndarray]]]:
    """Work function: each of the task's layers' :class:`~auditor.calibration.statistics.whiten.Truncator`
    decompositions (U per group: what tier 3 and ``factorize`` cut factors from at any rank), on one BLAS thread."""
    from threadpoolctl import threadpool_limits

    from .whiten import Truncator

    with threadpool_limits(limits=1, user_api="blas"):
        return [(layer.name, Truncator(layer, w, replace_gram(inp, task.gram)).u)
                for layer, w, inp in zip(task.layers, task.weights, task.inputs)]


def _own(w: torch.Tensor) -> torch.Tensor:
    """The weight on the CPU in its own storage: a view of a larger tensor would pickle the whole of it."""
    w = w.detach().cpu()
    if w.untyped_storage().nbytes() > w.numel() * w.element_size() or not w.is_contiguous():
        w = w.clone(memory_format=torch.contiguous_format)
    return w


def _gram_key(stats: "InputStatistics", name: str, inp: LayerInput) -> object:
    """What identifies a layer's Gram: its file in a GramStore (one per distinct Gram), else the array itself."""
    meta = getattr(stats.layers, "meta", None)
    return meta[name]["file"] if isinstance(meta, dict) and name in meta else id(inp.gram)


def input_tasks(layers: Sequence["Layer"], weights: dict[str, torch.Tensor], stats: "InputStatistics",
                align: int, target: float) -> list[InputTask]:
    """One :class:`InputTask` per distinct Gram among ``layers`` (those with statistics), in the layers' order."""
    groups: dict[object, list[tuple["Layer", LayerInput]]] = {}
    for layer in layers:
        if layer.name in stats.layers:
            inp = stats.layers[layer.name]
            groups.setdefault(_gram_key(stats, layer.name, inp), []).append((layer, inp))
    tasks = []
    for members in groups.values():
        gram = np.ascontiguousarray(members[0][1].gram)
        fields = tuple(replace_gram(i, None) for _, i in members)  # type: ignore[arg-type]
        tasks.append(InputTask(members[0][0].name, gram, tuple(l for l, _ in members),
                               tuple(_own(weights[l.param]) for l, _ in members), fields, align, target))
    return tasks


def parts(model: "torch.nn.Module | None", layers: Sequence["Layer"]) -> list[list["Layer"]]:
    """``layers`` cut into what is sent at once: each repeated block's layers together, each layer outside the blocks
    alone (:func:`~auditor.calibration.statistics.stream.find_blocks`), in the order of their first layer; all of
    them together without ``model`` or without repeated blocks."""
    from .stream import find_blocks

    found = find_blocks(model, list(layers)) if model is not None and layers else None
    if found is None:
        return [list(layers)] if layers else []
    order = {l.name: i for i, l in enumerate(layers)}
    out = [ls for ls in found.layers if ls] + [[l] for l in found.outside]
    return sorted(out, key=lambda ls: min(order[l.name] for l in ls))


class ClusterDecompositions:
    """Tier 1's decompositions on the Dask cluster ``scheduler`` (an address or a ``distributed.Client``): one
    executor for the whole pass (:meth:`close` it, or use as a context manager). ``tasks`` and ``bytes_sent`` count
    what was submitted; ``where`` says which cluster."""

    def __init__(self, scheduler: Any, path_map: Sequence[tuple[str, str]] = (),
                 model: "torch.nn.Module | None" = None) -> None:
        from ...spectra.dask_executor import executor_for

        self.executor = executor_for(scheduler, path_map)
        self.model = model  # what the layers are cut into parts by (:func:`parts`); None: all at once
        self.tasks = 0
        self.bytes_sent = 0
        self.largest = 0

    @property
    def where(self) -> str:
        return self.executor.where

    def spectra(self, layers: Sequence["Layer"], weights: dict[str, torch.Tensor], stats: "InputStatistics",
                align: int = 8, target: float = 0.01,
                progress: Callable[[int, int], None] | None = None) -> dict[str, WhitenedSpectrum]:
        """What :func:`~auditor.calibration.statistics.whiten.whitened_spectra` returns for these layers, each
        distinct input one task on the cluster, one round (:meth:`_rounds`) submitted and gathered at a time.
        ``progress(done, total)`` counts layers, in the order their tasks finish."""
        names = [l.name for l in layers if l.name in stats.layers]
        got: dict[str, WhitenedSpectrum] = {}
        for batch in self._rounds([l for l in layers if l.name in stats.layers], weights, stats, align, target):
            for spec in self._run(spectra_task, batch):
                got[spec.layer] = spec
                if progress is not None:
                    progress(len(got), len(names))
        return {n: got[n] for n in names}

    def truncators(self, layers: Sequence["Layer"], weights: dict[str, torch.Tensor], stats: "InputStatistics",
                   store: "MutableMapping[str, Truncator]", progress: Callable[[int, int], None] | None = None) -> None:
        """Each of ``layers``' (those with statistics) :class:`~auditor.calibration.statistics.whiten.Truncator`,
        its decomposition made on the cluster, put into ``store`` (a
        :class:`~auditor.calibration.statistics.whiten.TruncatorStore` keeps a budget in memory and spills the
        rest) one round (:meth:`_rounds`) at a time, so this process holds one round's U beyond what the store
        keeps."""
        from .whiten import Truncator

        named = {l.name: l for l in layers if l.name in stats.layers}
        done = 0
        for batch in self._rounds(list(named.values()), weights, stats, 8, 0.01):
            for name, u in self._run(truncator_task, batch):
                store[name] = Truncator.from_parts(named[name], weights[named[name].param], u)
                done += 1
                if progress is not None:
                    progress(done, len(named))

    def _rounds(self, layers: list["Layer"], weights: dict[str, torch.Tensor], stats: "InputStatistics",
                align: int, target: float) -> Iterator[list[InputTask]]:
        """The tasks of ``layers``, one round at a time: consecutive parts (:func:`parts`) until every worker has a
        task (a Llama block's 4 tasks are one round on up to 4 workers; the embedding's and the first block's join
        on 5 or more), so what is in flight grows with the cluster's width, never with the model's depth."""
        batch: list[InputTask] = []
        for part in parts(self.model, layers):
            batch += input_tasks(part, weights, stats, align, target)
            if len(batch) >= self.executor.workers:
                yield batch
                batch = []
        if batch:
            yield batch

    def _run(self, fn: Callable[[InputTask], list[Any]], part: list[InputTask]) -> list[Any]:
        self.tasks += len(part)
        self.bytes_sent += sum(t.nbytes for t in part)
        self.largest = max([self.largest, *(t.nbytes for t in part)])
        out: list[Any] = []
        with warnings.catch_warnings():  # the arrays are the tasks' inputs on purpose (see the module's notes)
            warnings.filterwarnings("ignore", message=".*[Ll]arge graph.*")
            for _i, got in self.executor.run(fn, part, [t.nbytes for t in part]):
                out.extend(got)
        return out

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> "ClusterDecompositions":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
