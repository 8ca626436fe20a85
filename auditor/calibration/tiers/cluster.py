"""Tier 2 on a Dask cluster: one task per layer, the model and the calibration sent to every worker once.

A :class:`SweepPlugin` (a ``distributed.WorkerPlugin``) is registered once per audit. It carries, as one pickled
payload: how to get the model, the calibration batches, the tier-1 input statistics (so the whitened initialisation
is the one a local run uses), the layers, the tier-1 whitened spectra (where each bisection starts), the metric, the
tolerance and the alignment. On a worker's first task the plugin builds one :class:`~auditor.calibration.tiers.sweep.Sweeper`
and keeps it; every task then calls ``sweeper.floor(layer)`` and returns the :class:`~auditor.calibration.tiers.sweep.Floor`
(plain data). A last small task turns the floors into :class:`~auditor.calibration.tiers.sweep.Floors` with
``Sweeper.result`` on a worker that holds a sweeper, so this process never builds one.

How the model gets to a worker:

- **By source** (an ``audit_source`` / command-line run, ``AuditOptions.origin``): the source spec and the load
  options, their file paths made absolute and mapped with ``--path-map``; each worker loads the model itself and
  checks that its weights hash to this process's (a factory with random initialisation would not). Nothing but a few
  hundred bytes of spec crosses the network for the model.
- **By value** (a model given to ``audit()`` from Python, or a source whose files map to a URL): the module pickled
  once with cloudpickle, the modules of its classes that are the user's own code (not installed packages) pickled
  with it, so workers need not have the user's files.

The user metric goes by value the same way (a ``file.py:fn`` metric's module is registered by value). Faults,
cancellation, the worker's address in errors and the unreachable scheduler are :class:`DaskExecutor`'s. A worker
runs one sweep task at a time (its sweeper changes one weight in place while it measures).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from distributed.diagnostics.plugin import WorkerPlugin

from ...errors import AuditError
from ...spectra.dask_executor import DaskExecutor, executor_for, is_url, map_path

if TYPE_CHECKING:
    from distributed import Worker
    from torch import nn

    from ...options import ClusterOptions, LoadOptions
    from ...results import Layer
    from ..data.inputs import Calibration
    from ..measure.metric import Metric
    from ..session import CalibrationSession
    from ..statistics.stats import InputStatistics
    from .sweep import Floor, Floors
    from ..statistics.whiten import WhitenedSpectrum

PLUGIN_PREFIX = "lowrank-sweep-"


@dataclass(frozen=True)
class SweepPayload:
    """Everything a worker needs to build its Sweeper, sent once (pickled by the client with cloudpickle)."""

    source: tuple[str, "LoadOptions"] | None  # load the model from this (worker-side paths) ...
    model: "nn.Module | None"  # ... or this module (None when loaded by source)
    weights_hash: str  # of this process's model, checked after a load by source
    layers: list["Layer"]
    calibration: "Calibration"
    stats: "InputStatistics"
    spectra: dict[str, "WhitenedSpectrum"]
    metric: "Metric"
    align: int


@dataclass(frozen=True)
class SweepTask:
    """One layer to sweep, on the plugin named ``plugin``."""

    layer: str
    plugin: str
    search: str = "bisect"


@dataclass(frozen=True)
class ResultTask:
    """Turn the floors into Floors (``Sweeper.result``) on a worker."""

    plugin: str
    floors: dict[str, "Floor"]
    search: str
    seconds: float
    layer: str = "result"


class SweepPlugin(WorkerPlugin):
    """Holds the payload on every worker (replacement workers included: the scheduler applies plugins registered by
    the client to every worker that joins) and builds one Sweeper on the worker's first task."""

    def __init__(self, name: str, payload: bytes) -> None:
        self.name = name
        self.payload = payload
        self._sweeper: "Sweeper | None" = None
        self._lock: threading.Lock | None = None
        self.address = ""

    def __getstate__(self) -> dict[str, object]:
        return {"name": self.name, "payload": self.payload}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["name"], state["payload"])  # type: ignore[misc]

    def setup(self, worker: "Worker") -> None:
        """Keep the payload; the Sweeper is built in the first task's thread (loading a model there never blocks the
        worker's event loop and heartbeats)."""
        self.address = str(worker.address)
        self._lock = threading.Lock()

    def teardown(self, worker: "Worker") -> None:
        self._sweeper = None

    def sweeper(self) -> "Sweeper":
        """The worker's Sweeper, built once from the payload (call with the lock held)."""
        if self._sweeper is None:
            import cloudpickle

            from ..data.hashing import weights_hash
            from .sweep import Sweeper

            p: SweepPayload = cloudpickle.loads(self.payload)
            model = p.model if p.model is not None else _load_by_source(p.source)  # type: ignore[arg-type]
            spec = p.source[0] if p.source is not None else ""
            if p.model is None and weights_hash(model) != p.weights_hash:
                raise AuditError(f"the model built from {spec} on this worker differs from the client's "
                                 "(its factory is not deterministic: random initialisation, or other files there)",
                                 "Give the factory fixed weights (--weights FILE), or pass the model itself to "
                                 "auditor.audit() so it is sent by value")
            model.eval()
            self._sweeper = Sweeper(model, p.layers, p.calibration, align=p.align, metric=p.metric, stats=p.stats,
                                    spectra=p.spectra)
            self.payload = b""  # the sweeper holds what it needs (a replacement worker gets the scheduler's copy)
        return self._sweeper

    def run(self, fn: Callable[["Sweeper"], object]) -> object:
        """``fn(sweeper)`` with the worker's lock held and one BLAS thread (as the local stage runs)."""
        from threadpoolctl import threadpool_limits

        assert self._lock is not None, "the plugin was not set up on this worker"
        with self._lock, threadpool_limits(limits=1, user_api="blas"):
            return fn(self.sweeper())


def _plugin(name: str) -> SweepPlugin:
    from distributed import get_worker

    plugin = get_worker().plugins.get(name)
    if not isinstance(plugin, SweepPlugin):
        raise AuditError(f"the sweep's worker plugin {name} is not on this worker", "Run the audit again")
    return plugin


def sweep_task(task: SweepTask) -> tuple["Floor", str]:
    """Work function: one layer's measured floor on this worker's Sweeper, and the worker's address."""
    plugin = _plugin(task.plugin)
    return plugin.run(lambda s: s.floor(task.layer, task.search)), plugin.address


def result_task(task: ResultTask) -> "Floors":
    """Work function: ``Sweeper.result`` for the floors measured by the workers."""
    return _plugin(task.plugin).run(lambda s: s.result(task.floors, task.search, task.seconds))


def _load_by_source(source: tuple[str, "LoadOptions"]) -> "nn.Module":
    from torch import nn

    from ...sources import load_source

    spec, load = source
    loaded = load_source(spec, input_shape=[tuple(s) for s in load.input_shape] if load.input_shape else None,
                         input_ids=load.input_ids, weights=load.weights, structure_only=load.structure_only,
                         partial=load.partial, auto_inputs=load.auto_inputs)
    if not isinstance(loaded.model, nn.Module):
        raise AuditError(f"{spec} loads as weights only on this worker, not as a model with code",
                         "Check that every worker sees the same factory file (--path-map)")
    return loaded.model


# ---- what the client sends -------------------------------------------------------------------------------------
def _local_path(text: str) -> Path | None:
    """``text`` as an existing local path (made absolute, symlinks kept), or None."""
    if not text or is_url(text):
        return None
    p = Path(os.path.abspath(text))
    return p if p.exists() else None


def mapped_source(spec: str, load: "LoadOptions", path_map: tuple[tuple[str, str], ...],
                  ) -> tuple[str, "LoadOptions"] | None:
    """The source spec and load options with their file paths absolute and mapped to the workers' prefixes; None
    when a path maps to a URL (load_source reads local files only: the model then goes by value).

    >>> from auditor.options import LoadOptions
    >>> mapped_source("torchvision:resnet18", LoadOptions(), ())[0]
    'torchvision:resnet18'
    """
    target, colon, attr = spec.rpartition(":")
    if colon and target.endswith(".py") and _local_path(target) is not None:
        new_spec = f"{map_path(str(_local_path(target)), path_map)}:{attr}"
        where = new_spec.rpartition(":")[0]
    elif _local_path(spec) is not None:
        new_spec = where = map_path(str(_local_path(spec)), path_map)
    else:
        new_spec, where = spec, ""
    if is_url(where):
        return None
    if load.weights and _local_path(load.weights) is not None:
        w = map_path(str(_local_path(load.weights)), path_map)
        if is_url(w):
            return None
        load = replace(load, weights=w)
    return new_spec, load


def _user_modules(objs: list[object]) -> list[object]:
    """The modules defining these objects' classes (and functions) that are the user's own code: not installed in
    site-packages, not the standard library, not torch or this package. They are pickled by value."""
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    seen: dict[str, object] = {}
    for obj in objs:
        names = {getattr(obj, "__module__", None)} if callable(obj) and not hasattr(obj, "modules") else set()
        if hasattr(obj, "modules"):
            names |= {type(m).__module__ for m in obj.modules()}
        for name in names:
            if not name or name in seen or name.split(".")[0] in ("torch", "auditor", "builtins", "__main__"):
                continue
            mod = sys.modules.get(name)
            file = os.path.realpath(getattr(mod, "__file__", None) or "")
            if mod is None or not file or "site-packages" in file or "dist-packages" in file:
                continue
            if any(file.startswith(s + os.sep) for s in stdlib):
                continue
            seen[name] = mod
    return list(seen.values())


def payload_bytes(payload: SweepPayload) -> bytes:
    """``payload`` pickled with cloudpickle, the user's own modules (model classes, metric) by value."""
    import cloudpickle

    objs: list[object] = [payload.metric.fn] if payload.metric.fn is not None else []
    if payload.model is not None:
        objs.append(payload.model)
    mods = _user_modules(objs)
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps(payload)
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


def measured_part(calibration: "Calibration") -> "Calibration":
    """What a worker's Sweeper measures on: the held-out batches (the fit part only fed tier 1's statistics, which
    are sent as they are), each tensor in its own storage. A batch sliced from one big tensor would otherwise pickle
    the whole of it, once per batch."""
    import torch

    from ..data.inputs import Batch

    def own(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() > x.numel() * x.element_size():
            return x.clone()
        return x

    batches = [Batch(tuple(own(a) for a in b.args), {k: own(v) for k, v in b.kwargs.items()})
               for b in calibration.measure]
    return replace(calibration, fit=[], holdout=batches)


def _remove_plugin(client: object, name: str) -> None:
    try:
        client.unregister_worker_plugin(name)
    except Exception:  # noqa: BLE001 - a lost scheduler or worker: nothing left to free
        pass


def _payload(model: "nn.Module", layers: list["Layer"], calibration: "Calibration", base: SweepPayload,
             options: "ClusterOptions") -> SweepPayload:
    """``base`` with how the workers get the model (by source where the audit has one that maps to local files,
    else by value) and only the held-out part of the calibration."""
    from ..data.hashing import weights_hash

    source = None
    if options.origin is not None:
        source = mapped_source(options.origin[0], options.origin[1], options.path_map)
    return replace(base, source=source, model=None if source is not None else model,
                   weights_hash=weights_hash(model) if source is not None else "",
                   calibration=measured_part(calibration))


def measure_floors_on_cluster(model: "nn.Module", layers: list["Layer"], session: "CalibrationSession", align: int,
                              spectra: dict[str, "WhitenedSpectrum"], options: "ClusterOptions",
                              progress: bool | str | None = None) -> tuple["Floors", str]:
    """Tier 2 with one Dask task per layer on ``options.scheduler`` (an address or a ``distributed.Client``):
    the same :class:`~auditor.calibration.tiers.sweep.Floors` ``measure_floors`` returns with its bisection, and where it
    ran ("dask tcp://HOST:PORT (N workers)"). Progress (tasks done / total) goes to the run's progress bar. (The
    brute-force reference, ``search="all"``, runs locally: :func:`~auditor.calibration.tiers.sweep.measure_floors`.)"""
    import uuid

    from ...progress import Progress

    calibration, metric, stats = session.calibration, session.metric, session.stats
    t0 = time.perf_counter()
    search = "bisect"
    data = payload_bytes(_payload(model, layers, calibration, SweepPayload(
        None, None, "", list(layers), calibration, stats, dict(spectra), metric, align), options))
    name = f"{PLUGIN_PREFIX}{uuid.uuid4().hex[:12]}"
    bar = Progress(enabled=progress)
    with executor_for(options.scheduler, options.path_map) as ex:
        ex.client.register_plugin(SweepPlugin(name, data), name=name)
        try:
            floors, where = _run(ex, name, [l.name for l in layers], search, bar)
            items = [ResultTask(name, floors, search, time.perf_counter() - t0)]
            [(_, result)] = list(ex.run(result_task, items, [0], prefer=sorted(where)))
        finally:
            _remove_plugin(ex.client, name)
        return replace(result, seconds=time.perf_counter() - t0), ex.where


def _run(ex: DaskExecutor, plugin: str, names: list[str], search: str, progress: "Progress",
         ) -> tuple[dict[str, "Floor"], set[str]]:
    tasks = [SweepTask(n, plugin, search) for n in names]
    got: dict[str, "Floor"] = {}
    where: set[str] = set()
    with progress.phase("sweep", total=len(tasks)):
        for i, (floor, addr) in ex.run(sweep_task, tasks, [0] * len(tasks)):
            got[names[i]] = floor
            where.add(addr)
            progress.update(len(got), len(tasks))
    return {n: got[n] for n in names}, where  # in the layers' order, as measure_floors gives them
