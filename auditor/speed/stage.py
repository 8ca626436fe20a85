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
from .layers import TimeCache, Timer, time_layers
from .report import LatencyPlan, LayerSpeed, ModelRun, ModelSpeed, SpeedReport

if TYPE_CHECKING:
    from ..options import AuditOptions
    from ..results import Audit, Layer


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


def latency_plan(target: float, items: list[tuple["Layer", int]], timed: dict[str, LayerSpeed],
                 dense_s: float) -> LatencyPlan:
    """The plan saving the most parameters whose predicted latency removes ``target`` of ``dense_s``: every planned
    layer, then (while the target is missed) the layers that cost time left dense, the worst time per parameter
    saved first; none when even the layers that save time do not reach it. A layer's saving is (dense - factorized)
    times its calls per forward; an untimed layer counts as saving none."""
    def saving(layer: "Layer") -> float:
        s = timed.get(layer.name)
        return (s.dense.median - s.factorized.median) * max(1, layer.calls) if s is not None else 0.0

    keep = list(items)
    dropped: list[str] = []
    costly = sorted((it for it in items if saving(it[0]) < 0),
                    key=lambda it: saving(it[0]) / max(1, it[0].params - it[0].params_at(it[1])))

    def predicted() -> float:
        return -sum(saving(l) for l, _ in keep) / dense_s if dense_s > 0 else 0.0

    for it in costly:
        if predicted() <= -target:
            break
        keep.remove(it)
        dropped.append(it[0].name)
    change = predicted()
    if change > -target:
        return LatencyPlan(target, {}, 0, change, tuple(dropped))
    return LatencyPlan(target, {l.name: r for l, r in keep}, sum(l.params - l.params_at(r) for l, r in keep),
                       change, tuple(dropped))


def _whole(model: nn.Module, args: tuple, kwargs: dict, plan: dict[str, int], options: "AuditOptions",
           device: str, threads: int, lead: tuple[int, ...] | None) -> tuple[ModelRun, str]:
    from .model import lead_shape, measure_subprocess, run_model

    if options.origin is not None:
        source, load = options.origin
        return measure_subprocess(source, load, plan, device, threads, lead), "subprocess"
    from ..factorize import factorize

    a, k = lead_shape(args, kwargs, lead)
    return run_model(factorize(model, plan, init=False) if plan else model, a, k, device), "in-process"


def measure_speed(model: Any, inputs: Any, audit: "Audit", options: "AuditOptions") -> SpeedReport:
    """Time the reviewed plan (the user's or the suggested ranks) on ``options.device`` (default: the CPU)."""
    from ..structure.trace import ExampleInputs

    if not isinstance(model, nn.Module):
        raise AuditError("--measure-speed needs the model's code; a weights-only checkpoint cannot run",
                         "Audit a factory (file.py:fn) or a Hugging Face directory to measure speed")
    ex = ExampleInputs.of(inputs)
    if ex is None:
        raise AuditError("--measure-speed needs example inputs to time the layers at",
                         "Pass --input-shape or --input-ids (or inputs to audit())")
    device = _device(options.device)
    threads = torch.get_num_threads()
    items = [(audit.layer(it.layer), it.rank) for it in (audit.review.items if audit.review else [])]
    timer = Timer(device=device, cache=TimeCache(cache_folder(options)))
    lead = tuple(options.latency_shape) if options.latency_shape else None
    rows, break_even, notes = time_layers(model, ex.args, ex.kwargs, items, timer, audit.settings.align, lead)
    if timer.hits:
        notes.append(f"{timer.hits} layer time(s) read from the cache ({cache_folder(options)}).")
    dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch.")
    report = SpeedReport(device, dtype, threads, {"torch": torch.__version__}, rows, break_even, notes=notes)
    if not items:
        return replace(report, notes=[*notes, "No planned layer: the whole model is not timed."])
    plan = {l.name: r for l, r in items}
    try:
        dense, where = _whole(model, ex.args, ex.kwargs, {}, options, device, threads, None)
        fact, _ = _whole(model, ex.args, ex.kwargs, plan, options, device, threads, None)
        report = replace(report, model=ModelSpeed(dense, fact, ex.description, where))
    except (RuntimeError, AuditError) as exc:
        return replace(report, notes=[*report.notes, f"Whole model not timed: {exc}."])
    if options.budget_latency is not None:
        lp = latency_plan(options.budget_latency, items, timed=report.traced(), dense_s=dense.timing.median)
        if lp.met:
            run = fact if lp.ranks == plan else _whole(model, ex.args, ex.kwargs, lp.ranks, options, device,
                                                       threads, None)[0]
            lp = replace(lp, measured=run)
        report = replace(report, latency_plan=lp)
    return report
