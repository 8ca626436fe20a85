"""Per-layer timing: each planned layer's dense module and the module ``factorize`` writes for it (its kind's
``replace``, the same code path), timed at the input the trace saw (captured by a forward hook during one forward of
the model) and at ``--latency-shape``; and the time break-even rank per distinct (module, input shape), found by
bisection on a rank grid below the parameter break-even m*n/(m+n).

Factor values do not change a matmul's time, so the replacement is built without the SVD (its default
initialisation): timing a plan costs no decomposition. Times are cached (``<cache>/speed/``) keyed by the module's
configuration, rank, input shape and dtype, the device and its name, the thread count and the library versions.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import kinds
from ..results import Kind, Layer
from ..speedresults import LayerSpeed, TimeBreakEven
from .timing import MIN_BLOCKS, WARMUP_CALLS, Clock, Timing, measure_many

GRID_POINTS = 32  # the break-even grid has about this many ranks: five or six measurements by bisection


def device_name(device: str) -> str:
    """The processor or GPU, for the cache key: times on another machine are not these."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class TimeCache:
    """One JSON file per key under ``folder``; unreadable or unwritable entries are simply measured again."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def _path(self, key: dict[str, Any]) -> Path | None:
        if self.folder is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.folder / f"{digest[:32]}.json"

    def get(self, key: dict[str, Any]) -> Timing | None:
        path = self._path(key)
        try:
            if path is not None and path.is_file():
                d = json.loads(path.read_text(encoding="utf-8"))
                if d.get("key") == key:
                    return Timing.from_dict(d["timing"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def put(self, key: dict[str, Any], timing: Timing) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "timing": timing.to_dict()}), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass


@dataclass
class Timer:
    """Times modules on one device, with a cache and an optional fake clock (tests)."""

    device: str = "cpu"
    cache: TimeCache = field(default_factory=lambda: TimeCache(None))
    clock: Clock | None = None
    min_time: float = 0.2
    env: dict[str, Any] | None = None
    min_blocks: int = MIN_BLOCKS
    warmup: int = WARMUP_CALLS

    def __post_init__(self) -> None:
        self.env = self.env or {"device": self.device, "device_name": device_name(self.device),
                                "threads": torch.get_num_threads(), "torch": torch.__version__,
                                "python": platform.python_version()}
        self.hits = 0

    def times(self, mods: list[tuple[nn.Module, str]], x: torch.Tensor) -> tuple[list[Timing], bool]:
        """(time per call of each ``mod(x)``, measured side by side; whether all came from the cache). Each
        module's ``what`` names it in the cache key; when any is missing all are measured again together."""
        keys = [{**(self.env or {}), "module": what, "input": list(x.shape), "input_dtype": str(x.dtype)}
                for _, what in mods]
        use_cache = self.clock is None
        hits = [self.cache.get(k) for k in keys] if use_cache else [None] * len(keys)
        if all(h is not None for h in hits):
            self.hits += len(hits)
            return hits, True  # type: ignore[return-value]
        x = x.to(self.device)
        live = [m.to(self.device).eval() for m, _ in mods]
        with torch.inference_mode():
            ts = measure_many([lambda m=m: m(x) for m in live], device=self.device, clock=self.clock,
                              min_time=self.min_time, min_blocks=self.min_blocks, warmup=self.warmup)
        if use_cache:
            for k, t in zip(keys, ts):
                self.cache.put(k, t)
        return ts, False


def capture_inputs(model: nn.Module, args: tuple, kwargs: dict,
                   modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Module path -> the first input tensor it was called with during one forward (eval, no grad)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for path, mod in modules.items():
        def pre(_m: nn.Module, a: tuple, path: str = path) -> None:
            if path not in seen and a and isinstance(a[0], torch.Tensor):
                seen[path] = a[0].detach().clone()
        hooks.append(mod.register_forward_pre_hook(pre))
    was = model.training
    model.eval()
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return seen


def reshape_input(x: torch.Tensor, kind: Kind | str, lead: tuple[int, ...]) -> torch.Tensor:
    """An input like ``x`` at another batch/sequence, of the shape the layer's kind says
    (:meth:`auditor.kinds.base.LayerKind.timing_shape`: for a linear layer the leading dims become ``lead``)."""
    shape = kinds.for_kind(kind).timing_shape(tuple(x.shape), tuple(lead))
    if x.is_floating_point():
        return torch.randn(shape, dtype=x.dtype)
    hi = int(x.max().item()) + 1 if x.numel() else 1
    return torch.randint(0, max(hi, 1), shape, dtype=x.dtype)


def timed_module(model: nn.Module, layer: Layer) -> nn.Module | None:
    """The module a planned layer lives in, when its kind is timed by itself (one input tensor: ``LayerKind.timed``)."""
    if not kinds.for_kind(layer.kind).timed:
        return None
    path, attr = kinds.for_kind(layer.kind).module_path(layer)
    if attr != "weight":
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def factorized_module(layer: Layer, mod: nn.Module, rank: int) -> nn.Module:
    """What ``factorize`` writes for this layer at ``rank`` (its kind's replacement), with default-initialised
    factors."""
    with torch.no_grad():
        return kinds.for_kind(layer.kind).replace(layer, mod, rank, None, None)


def rank_grid(m: int, n: int, align: int, points: int = GRID_POINTS) -> tuple[list[int], int]:
    """(ranks to bisect, the grid step): multiples of a step (``align`` or more, about :data:`GRID_POINTS` ranks)
    up to the parameter break-even m*n/(m+n); every rank up to it when there are no more than GRID_POINTS."""
    be = m * n / (m + n)
    top = max(1, math.floor(be))
    align = max(1, align)
    if top <= points:
        return list(range(1, top + 1)), 1
    step = max(align, math.ceil(top / points / align) * align)
    return list(range(step, top + 1, step)), step


def bisect_break_even(grid: list[int], faster: Callable[[int], bool]) -> tuple[int | None, list[int]]:
    """The largest rank of ``grid`` at which ``faster(rank)``, assuming it holds up to a crossover and fails past
    it: (that rank or None, the ranks asked in order).

    >>> bisect_break_even([8, 16, 24, 32, 40], lambda r: r <= 24)
    (24, [24, 32])
    >>> bisect_break_even([8, 16], lambda r: False)
    (None, [8])
    """
    lo, hi, asked = -1, len(grid), []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        asked.append(grid[mid])
        if faster(grid[mid]):
            lo = mid
        else:
            hi = mid
    return (grid[lo] if lo >= 0 else None), asked


def time_break_even(layer: Layer, mod: nn.Module, x: torch.Tensor, timer: Timer, align: int, at: str,
                    dense: Timing | None = None, points: int = GRID_POINTS) -> TimeBreakEven:
    """Bisect a rank grid for the last rank whose factorized module is faster than the dense one; each probe is
    timed side by side with the dense module, so both see the same load."""
    what = repr(mod)
    grid, step = rank_grid(layer.m, layer.n, align, points)
    probes: list[tuple[int, Timing]] = []
    first: list[Timing] = []

    def faster(r: int) -> bool:
        (d, t), _ = timer.times([(copy.deepcopy(mod), what), (factorized_module(layer, mod, r), f"{what} rank {r}")],
                                x)
        first.append(d)
        probes.append((r, t))
        return t.median < d.median

    rank, _ = bisect_break_even(grid, faster)
    return TimeBreakEven(str(layer.kind), layer.m, layer.n, tuple(x.shape), at, rank, step, layer.break_even,
                         rank is not None and rank == grid[-1], dense or first[0], tuple(probes), (layer.name,),
                         tuple(first))


def time_layers(model: nn.Module, args: tuple, kwargs: dict, planned: list[tuple[Layer, int]], timer: Timer,
                align: int, latency_shape: tuple[int, ...] | None = None,
                break_even: bool = True) -> tuple[list[LayerSpeed], list[TimeBreakEven], list[str]]:
    """Each planned (layer, rank) timed dense and factorized at the traced input (and at ``latency_shape``), and
    the time break-even rank of each distinct (module, input shape); notes name the layers that could not be timed.
    Identical modules at identical inputs are measured once and their numbers shared."""
    notes: list[str] = []
    mods = {l.name: timed_module(model, l) for l, _ in planned}
    skipped = [l.name for l, _ in planned if mods[l.name] is None]
    if skipped:
        notes.append(f"Not timed (not a single-input module): {', '.join(skipped)}.")
    paths = {l.name: kinds.for_kind(l.kind).module_path(l)[0] for l, _ in planned if mods[l.name] is not None}
    inputs = capture_inputs(model, args, kwargs, {paths[n]: mods[n] for n in paths})  # type: ignore[misc]
    rows: list[LayerSpeed] = []
    found: dict[tuple, TimeBreakEven] = {}
    for layer, rank in planned:
        mod = mods[layer.name]
        if mod is None:
            continue
        x = inputs.get(paths[layer.name])
        if x is None:
            notes.append(f"Not timed: {layer.name} was not called by the example inputs.")
            continue
        shapes = [("traced", x)]
        if latency_shape is not None:
            shapes.append(("latency-shape", reshape_input(x, layer.kind, latency_shape)))
        what = repr(mod)
        for at, xi in shapes:
            (dense, fact), cached = timer.times([(copy.deepcopy(mod), what),
                                                 (factorized_module(layer, mod, rank), f"{what} rank {rank}")], xi)
            rows.append(LayerSpeed(layer.name, str(layer.kind), layer.m, layer.n, rank, tuple(xi.shape), at, dense,
                                   fact, cached))
            if not break_even:
                continue
            key = (what, tuple(xi.shape), str(xi.dtype), at)
            if key in found:
                b = found[key]
                found[key] = TimeBreakEven(**{**b.__dict__, "layers": (*b.layers, layer.name)})
            else:
                found[key] = time_break_even(layer, mod, xi, timer, align, at, dense=dense)
    return rows, list(found.values()), notes
