"""The speed stage of the pipeline (``--measure-speed``, ``--latency-shape``, ``--budget-latency``): the reviewed
plan's layers timed dense and factorized, the time break-even rank per shape, the whole model dense vs factorized,
and the plan chosen by latency. Run only when asked: a default audit neither imports nor times anything here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import AuditError
from .layer_timing import TimeCache, Timer, time_layers
from ..speedresults import FrontierSpeed, LatencyPlan, LayerSpeed, ModelRun, ModelSpeed, SpeedReport

if TYPE_CHECKING:
    from ..options import AuditOptions
    from ..results import AuditResult, Layer


def _device(spec: str | None) -> str:
    if spec in (None, "", "cpu"):
        return "cpu"
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise AuditError(f"--device {spec}: CUDA is not available here", "Pass --device cpu, or run on a machine "
                                                                          "with a GPU")
    return spec


def cache_folder(options: "AuditOptions") -> Path | None:
    if not options.cache:
        return None
    from .._env import cache_root

    return (options.cache_dir or cache_root()) / "speed"


MAX_CANDIDATES = 4  # whole-model runs --budget-latency may add (each a fresh process)


def _saving(layer: "Layer", timed: dict[str, LayerSpeed]) -> float:
    """Seconds per forward a layer's factorized form saves: (dense - factorized) times its calls; 0 untimed."""
    s = timed.get(layer.name)
    return (s.dense.median - s.factorized.median) * max(1, layer.calls) if s is not None else 0.0


def candidates(items: list[tuple["Layer", int]], timed: dict[str, LayerSpeed]) -> list[list[tuple["Layer", int]]]:
    """Plans by decreasing parameter saving: every planned layer, then with the layers that cost time left dense
    one more at a time, the worst time per parameter saved first."""
    costly = sorted((it for it in items if _saving(it[0], timed) < 0),
                    key=lambda it: _saving(it[0], timed) / max(1, it[0].params - it[0].params_at(it[1])))
    out = [list(items)]
    for it in costly:
        out.append([x for x in out[-1] if x is not it])
    return out


def latency_plan(target: float, items: list[tuple["Layer", int]], timed: dict[str, LayerSpeed],
                 run: Any) -> LatencyPlan:
    """``--budget-latency``: the first of :func:`candidates` whose whole-model latency, measured by ``run(plan)``
    (a (dense, factorized) pair of ModelRuns timed side by side), removes ``target`` of the dense latency. At most
    :data:`MAX_CANDIDATES` are run; none meeting it is a plan with no ranks."""
    tried = 0
    dropped: list[str] = []
    predicted = 0.0
    for plan in candidates(items, timed):
        if not plan or tried >= MAX_CANDIDATES:
            break
        dropped = [l.name for l, _ in items if all(l is not x for x, _ in plan)]
        tried += 1
        dense, measured = run({l.name: r for l, r in plan})
        base = dense.timing.median
        predicted = -sum(_saving(l, timed) for l, _ in plan) / base if base > 0 else 0.0
        if measured.timing.median <= base * (1 - target):
            return LatencyPlan(target, {l.name: r for l, r in plan},
                               sum(l.params - l.params_at(r) for l, r in plan), predicted, tuple(dropped), measured,
                               dense)
    return LatencyPlan(target, {}, 0, predicted, tuple(dropped))


def _pair(model: nn.Module, args: tuple, kwargs: dict, plan: dict[str, int], options: "AuditOptions",
          device: str, threads: int) -> tuple[ModelRun, ModelRun, str]:
    """The dense model and the model under ``plan``, end to end: each in a fresh process from the audit's source,
    timed in interleaved blocks; an audited Python object (no source to reload) or a fake clock in this process."""
    from .model import measure_subprocesses, run_model

    if options.cluster.origin is not None and options.speed.clock is None:
        source, load = options.cluster.origin
        dense, fact = measure_subprocesses(source, load, [{}, plan], device, threads)
        return dense, fact, "subprocess"
    from ..surgery import apply_plan

    dense = run_model(model, args, kwargs, device, clock=options.speed.clock)
    fact = run_model(apply_plan(model, plan), args, kwargs, device, clock=options.speed.clock)
    return dense, fact, "in-process"


MAX_FRONTIER = 4  # frontier plans timed end to end (each a process alive at once beside the dense one)


def _spread_pick(n: int, k: int) -> list[int]:
    """``k`` indices spread over ``range(n)``, the first and the last included (all when ``n <= k``).

    >>> _spread_pick(3, 4), _spread_pick(9, 4)
    ([0, 1, 2], [0, 3, 5, 8])
    """
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def time_frontier(model: nn.Module, args: tuple, kwargs: dict, audit: "AuditResult", options: "AuditOptions",
                  device: str, threads: int) -> tuple[list[FrontierSpeed], ModelRun | None]:
    """The calibration frontier's plans (``--budget``; at most :data:`MAX_FRONTIER`, spread over it) end to end,
    side by side with the dense model: in fresh processes from the source, else in this process."""
    from .model import measure_subprocesses, run_model

    cal = audit.calibration
    budget = cal.budget if cal is not None else None
    if budget is None or not budget.frontier:
        return [], None
    chosen = [budget.frontier[i] for i in _spread_pick(len(budget.frontier), MAX_FRONTIER)]
    chosen = [p for p in chosen if p.plan]
    if not chosen:
        return [], None
    if options.cluster.origin is not None and options.speed.clock is None:
        source, load = options.cluster.origin
        dense, *runs = measure_subprocesses(source, load, [{}, *(p.plan for p in chosen)], device, threads)
    else:
        from ..surgery import apply_plan

        dense = run_model(model, args, kwargs, device, clock=options.speed.clock)
        runs = [run_model(apply_plan(model, p.plan), args, kwargs, device, clock=options.speed.clock)
                for p in chosen]
    return [FrontierSpeed(p.removed, p.removed_fraction, p.layers, r) for p, r in zip(chosen, runs)], dense


def measure_speed(model: Any, inputs: Any, audit: "AuditResult", options: "AuditOptions") -> SpeedReport:
    """Time the reviewed plan (the user's or the suggested ranks) on ``options.statistics.device`` (default: the CPU)."""
    from ..structure.trace import ExampleInputs

    if not isinstance(model, nn.Module):
        raise AuditError("--measure-speed needs the model's code; a weights-only checkpoint cannot run",
                         "Audit a factory (file.py:fn) or a Hugging Face directory to measure speed")
    ex = ExampleInputs.of(inputs)
    if ex is None:
        raise AuditError("--measure-speed needs example inputs to time the layers at",
                         "Pass --input-shape or --input-ids (or inputs to audit())")
    device = _device(options.statistics.device)
    threads = torch.get_num_threads()
    items = [(audit.layer(it.layer), it.rank) for it in (audit.review.items if audit.review else [])]
    timer = Timer(device=device, cache=TimeCache(cache_folder(options)), clock=options.speed.clock)
    lead = tuple(options.speed.latency_shape) if options.speed.latency_shape else None
    rows, break_even, notes = time_layers(model, ex, items, timer, audit.settings.align, lead)
    noisy = [s for s in rows for t in (s.dense, s.factorized) if t.iqr > 0.5 * t.median]
    if noisy:
        notes.append(f"{len({s.layer for s in noisy})} timed layer(s) spread by more than half their median "
                     "(interquartile range): the machine is busy, or its threads wait on each other; time on a quiet "
                     "machine, or with fewer threads (OMP_NUM_THREADS=1), before trusting small differences.")
    if timer.hits:
        notes.append(f"{timer.hits} layer time(s) read from the cache ({cache_folder(options)}).")
    dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch.")
    report = SpeedReport(device, dtype, threads, {"torch": torch.__version__}, rows, break_even, notes=notes)
    if not items:
        return replace(report, notes=[*notes, "No planned layer: the whole model is not timed."])
    plan = {l.name: r for l, r in items}
    try:
        dense, fact, where = _pair(model, ex.args, ex.kwargs, plan, options, device, threads)
        report = replace(report, model=ModelSpeed(dense, fact, ex.description, where))
    except (RuntimeError, AuditError) as exc:
        return replace(report, notes=[*report.notes, f"Whole model not timed: {exc}."])
    try:
        frontier, fdense = time_frontier(model, ex.args, ex.kwargs, audit, options, device, threads)
        report = replace(report, frontier=frontier, frontier_dense=fdense)
    except (RuntimeError, AuditError) as exc:
        report = replace(report, notes=[*report.notes, f"Frontier plans not timed: {exc}."])
    if options.speed.budget_latency is not None:
        def run(ranks: dict[str, int]) -> tuple[ModelRun, ModelRun]:
            if ranks == plan:
                return dense, fact
            return _pair(model, ex.args, ex.kwargs, ranks, options, device, threads)[:2]

        try:
            lp = latency_plan(options.speed.budget_latency, items, report.traced(), run)
        except (RuntimeError, AuditError) as exc:
            return replace(report, notes=[*report.notes, f"--budget-latency not measured: {exc}."])
        report = replace(report, latency_plan=lp)
    return report
