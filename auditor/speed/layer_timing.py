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
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from .. import kinds
from ..results import Kind, Layer
from ..speedresults import LayerSpeed, TimeBreakEven, seconds
from .timing import MIN_BLOCKS, WARMUP_CALLS, Clock, Timing, agree, measure_blocks, refusal, same_verdict

if TYPE_CHECKING:
    from ..structure.trace import ExampleInputs

ATTEMPTS = 3  # a timing that is not repeatable is measured again, at most this many times in all
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


MAX_ENTRY_BYTES = 16 << 10  # a cache entry is a few hundred bytes: a larger file is not read, it is discarded
STALE_TMP_S = 3600.0  # a half-written entry of a process that is gone, or older than this, is removed


class Unrepeatable(Exception):
    """A timing that is not repeatable (see :func:`~auditor.speed.timing.refusal`): reported as not measured,
    never cached."""


class TimeCache:
    """One JSON file per key under ``folder``. An entry is read back only when it is small, well-formed, of this
    key and its times sane (:meth:`Timing.from_dict`); any other entry is removed and measured again. Entries are
    written to a temporary file and renamed into place; half-written ones left by a killed run are removed."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.swept = False

    def _path(self, key: dict[str, Any]) -> Path | None:
        if self.folder is None:
            return None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.folder / f"{digest[:32]}.json"

    def get(self, key: dict[str, Any]) -> Timing | None:
        path = self._path(key)
        try:
            if path is None or path.is_symlink() or not path.is_file():
                return None
            if path.stat().st_size <= MAX_ENTRY_BYTES:
                d = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
                if isinstance(d, dict) and d.get("key") == key:
                    return Timing.from_dict(d.get("timing"))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            pass
        self.drop(key)  # planted, damaged or of another key (a hash collision): measured again, written anew
        return None

    def drop(self, key: dict[str, Any]) -> None:
        path = self._path(key)
        try:
            if path is not None:
                path.unlink(missing_ok=True)
        except OSError:
            pass

    def put(self, key: dict[str, Any], timing: Timing) -> None:
        path = self._path(key)
        if path is None:
            return
        import tempfile

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.sweep()
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps({"key": key, "timing": timing.to_dict()}))
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError:
            pass

    def sweep(self) -> None:
        """Remove the half-written entries (``.*.tmp``, and the ``*.tmpPID`` of older versions) whose process is
        gone or that are older than :data:`STALE_TMP_S`; once per cache."""
        if self.swept or self.folder is None:
            return
        self.swept = True
        import time

        for p in [*self.folder.glob(".*.tmp"), *self.folder.glob("*.tmp[0-9]*")]:
            pid = p.name.rsplit(".tmp", 1)[1] if not p.name.endswith(".tmp") else p.name.split(".")[2]
            try:
                if not _alive(int(pid)) or time.time() - p.lstat().st_mtime > STALE_TMP_S:
                    p.unlink()
            except (OSError, ValueError, IndexError):
                pass


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while it runs (the cross-check), the thread count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class Timer:
    """Times modules on one device, with a cache and an optional fake clock (tests). A measurement is accepted
    only when it is repeatable (:func:`~auditor.speed.timing.refusal`: the two halves of its blocks within 25%, and on
    the CPU with more than one thread no more than 25% slower than on one thread); one that is not is measured
    again (:data:`ATTEMPTS` in all), then refused (:class:`Unrepeatable`) and not cached."""

    device: str = "cpu"
    cache: TimeCache = field(default_factory=lambda: TimeCache(None))
    clock: Clock | None = None
    min_time: float = 0.2
    env: dict[str, Any] | None = None
    min_blocks: int = MIN_BLOCKS
    warmup: int = WARMUP_CALLS
    cache_fake_times: bool = False  # tests: cache (and read back) what a fake clock measured

    def __post_init__(self) -> None:
        self.env = self.env or {"device": self.device, "device_name": device_name(self.device),
                                "threads": torch.get_num_threads(), "torch": torch.__version__,
                                "python": platform.python_version()}
        self.hits = 0
        self.wrote: set[str] = set()  # the keys this timer cached (for another layer, maybe)
        self.tag: Any = None  # what is being measured (time_layers: (layer, at)); each key cached is filed under it
        self.by_tag: dict[Any, list[dict[str, Any]]] = {}

    def forget(self, tag: Any) -> None:
        """Drop from the cache every entry written for ``tag`` (a layer whose times were refused afterwards)."""
        for k in self.by_tag.pop(tag, []):
            self.cache.drop(k)

    def keys(self, mods: list[tuple[nn.Module, str]], x: torch.Tensor) -> list[dict[str, Any]]:
        return [{**(self.env or {}), "module": what, "input": list(x.shape), "input_dtype": str(x.dtype)}
                for _, what in mods]

    def times(self, mods: list[tuple[nn.Module, str]], x: torch.Tensor, write: list[bool] | None = None,
              fresh: bool = False, own: bool = False) -> tuple[list[Timing], bool]:
        """(time per call of each ``mod(x)``, measured side by side; whether all came from the cache). Each
        module's ``what`` names it in the cache key; when any is missing (or ``fresh``; or ``own`` and written by
        this timer, for a twin layer) all are measured again together, and those ``write`` marks (all by default)
        cached. :class:`Unrepeatable` when not repeatable in :data:`ATTEMPTS` measurements."""
        keys = self.keys(mods, x)
        use_cache = self.clock is None or self.cache_fake_times
        hits = [self.cache.get(k) for k in keys] if use_cache and not fresh else [None] * len(keys)
        if own:
            hits = [None if json.dumps(k, sort_keys=True) in self.wrote else h for k, h in zip(keys, hits)]
        if all(h is not None for h in hits):
            self.hits += len(hits)
            return hits, True  # type: ignore[return-value]
        x = x.to(self.device)
        live = [m.to(self.device).eval() for m, _ in mods]
        why = ""
        for _ in range(ATTEMPTS):  # a passing load spike gets another chance
            ts, why = self._measure(live, x, ["the dense layer", *("the factorized layer" for _ in mods[1:])])
            if not why:
                break
        if why:
            raise Unrepeatable(why)
        if use_cache:
            for k, t, w in zip(keys, ts, write or [True] * len(keys)):
                if w:
                    self.cache.put(k, t)
                    self.wrote.add(json.dumps(k, sort_keys=True))
                    self.by_tag.setdefault(self.tag, []).append(k)
        return ts, False

    def _measure(self, live: list[nn.Module], x: torch.Tensor, names: list[str]) -> tuple[list[Timing], str]:
        """One side-by-side measurement, and why it is refused ("" when it is not)."""
        import statistics

        with torch.inference_mode():
            fns = [lambda m=m: m(x) for m in live]
            opts = {"device": self.device, "clock": self.clock, "min_time": self.min_time,
                    "min_blocks": self.min_blocks, "warmup": self.warmup}
            per, sizes = measure_blocks(fns, **opts)  # type: ignore[arg-type]
            one: list[float | None] = [None] * len(live)
            if torch.get_num_threads() > 1 and not self.device.startswith("cuda"):
                with one_thread():
                    per1, _ = measure_blocks(fns, **{**opts, "min_time": self.min_time / 2})  # type: ignore[arg-type]
                one = [statistics.median(p) for p in per1]
        for p, o, name in zip(per, one, names):
            why = refusal(name, p, o)
            if why:
                return [], why
        if len(per) == 2 and one[0] is not None and not same_verdict(statistics.median(per[0]), statistics.median(
                per[1]), one[0], one[1]):  # type: ignore[arg-type]
            return [], f"{names[1]} is faster than {names[0]} with threads and slower on one thread, or the reverse"
        return [Timing.of(p, c) for p, c in zip(per, sizes)], ""


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


def _lead_shape(x: torch.Tensor, kind: Kind | str, lead: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of an input like ``x`` at the batch (x positions) ``lead``, as the layer's kind says
    (:meth:`auditor.kinds.base.LayerKind.timing_shape`: for a linear layer the leading dims become ``lead``)."""
    return kinds.for_kind(kind).timing_shape(tuple(x.shape), tuple(lead))


def latency_bytes(x: torch.Tensor, layer: Layer, lead: tuple[int, ...]) -> int:
    """About the bytes timing ``layer`` at ``lead`` holds at once: its input at that shape and two outputs (dense
    and factorized), each output as large as its kind says (:meth:`auditor.kinds.base.LayerKind.timing_outputs`)."""
    shape = _lead_shape(x, layer.kind, lead)
    numel = math.prod(shape)
    out = kinds.for_kind(layer.kind).timing_outputs(shape, layer)
    size = x.element_size() if x.is_floating_point() else 4
    return numel * x.element_size() + 2 * out * size


def check_latency_memory(items: list[tuple[Layer, torch.Tensor]], lead: tuple[int, ...]) -> None:
    """Refuse ``--latency-shape`` (AuditError) where timing a layer at it needs more memory than is available now,
    before any input at that shape is made."""
    from ..errors import AuditError
    from ..spectra.backend import available_memory

    avail = available_memory()
    if avail is None or not items:
        return
    need, layer = max(((latency_bytes(x, layer, lead), layer) for layer, x in items), key=lambda t: t[0])
    if need > avail:
        raise AuditError(f"--latency-shape {','.join(map(str, lead))} needs about {need / 2**30:,.1f} GiB to time "
                         f"layer {layer.name} (its input at that shape and its outputs), more than the "
                         f"{avail / 2**30:,.1f} GiB available", "Give a smaller --latency-shape")


def reshape_input(x: torch.Tensor, kind: Kind | str, lead: tuple[int, ...]) -> torch.Tensor:
    """An input like ``x`` at another batch/sequence, of the shape the layer's kind says (:func:`_lead_shape`)."""
    shape = _lead_shape(x, kind, lead)
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
                    points: int = GRID_POINTS) -> TimeBreakEven:
    """Bisect a rank grid for the last rank whose factorized module is faster than the dense one; each probe is
    timed side by side with the dense module, so both see the same load. :class:`Unrepeatable` when a probe is.
    Its ``dense`` time is the first probe's (a caller that timed the layer's row puts that one in its place)."""
    what = repr(mod)
    grid, step = rank_grid(layer.m, layer.n, align, points)
    probes: list[tuple[int, Timing]] = []
    first: list[Timing] = []

    def faster(r: int) -> bool:
        (d, t), _ = timer.times([(copy.deepcopy(mod), what), (factorized_module(layer, mod, r), f"{what} rank {r}")],
                                x, write=[False, True])  # the dense time cached is the one its row reported
        first.append(d)
        probes.append((r, t))
        return t.median < d.median

    rank, _ = bisect_break_even(grid, faster)
    return TimeBreakEven(str(layer.kind), layer.m, layer.n, tuple(x.shape), at, rank, step, layer.break_even,
                         rank is not None and rank == grid[-1], first[0], tuple(probes), (layer.name,),
                         tuple(first))


def time_layers(model: nn.Module, example: ExampleInputs, planned: list[tuple[Layer, int]], timer: Timer,
                align: int, latency_shape: tuple[int, ...] | None = None,
                break_even: bool = True) -> tuple[list[LayerSpeed], list[TimeBreakEven], list[str]]:
    """Each planned (layer, rank) timed dense and factorized at the traced input (``example``, the model's example
    inputs: :class:`~auditor.structure.trace.ExampleInputs`) and at ``latency_shape``, and
    the time break-even rank of each distinct (module, input shape); notes name the layers that could not be timed,
    or whose timing was not repeatable (:func:`agreeing_twins`: layers of one shape must agree too). Identical
    modules at identical inputs share one break-even."""
    notes: list[str] = []
    mods = {l.name: timed_module(model, l) for l, _ in planned}
    skipped = [l.name for l, _ in planned if mods[l.name] is None]
    if skipped:
        notes.append(f"Not timed (not a single-input module): {', '.join(skipped)}.")
    paths = {l.name: kinds.for_kind(l.kind).module_path(l)[0] for l, _ in planned if mods[l.name] is not None}
    wanted = {paths[n]: mods[n] for n in paths}  # type: ignore[misc]
    inputs = capture_inputs(model, example.args, example.kwargs, wanted)
    if latency_shape is not None:
        check_latency_memory([(l, inputs[paths[l.name]]) for l, _ in planned if inputs.get(paths.get(l.name, ""))
                              is not None], latency_shape)
    rows: list[LayerSpeed] = []
    found: dict[tuple, TimeBreakEven | None] = {}
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
        for at, xi in shapes:
            timed = _Timed(layer, mod, at, xi)
            row = _row(timed, rank, timer, notes)
            if row is None:
                continue
            rows.append(row)
            if break_even:
                _share_break_even(found, timed, timer, align, row, notes)
    kept = agreeing_twins(rows, {l.name: (l, mods[l.name]) for l, _ in planned}, inputs, paths, latency_shape,
                          timer, notes)
    refused = {(r.layer, r.at) for r in rows} - {(r.layer, r.at) for r in kept}  # their break-even is suspect too
    return kept, [b for b in found.values() if b is not None and not any((n, b.at) in refused for n in b.layers)], \
        notes


def _pair(layer: Layer, mod: nn.Module, rank: int) -> list[tuple[nn.Module, str]]:
    what = repr(mod)
    return [(copy.deepcopy(mod), what), (factorized_module(layer, mod, rank), f"{what} rank {rank}")]


@dataclass(frozen=True)
class _Timed:
    """What one row times: a planned layer, its module, and the input it is timed at (``at``: "traced" or
    "latency-shape")."""

    layer: Layer
    mod: nn.Module
    at: str
    x: torch.Tensor


def _row(timed: _Timed, rank: int, timer: Timer, notes: list[str], fresh: bool = False) -> LayerSpeed | None:
    """One layer's row (dense and factorized side by side), or None with a note when it is not repeatable. A time
    this run cached for a twin layer is not reused: each row is its own measurement, so twins can be compared."""
    layer, mod, at, x = timed.layer, timed.mod, timed.at, timed.x
    timer.tag = (layer.name, at)
    try:
        (dense, fact), cached = timer.times(_pair(layer, mod, rank), x, fresh=fresh, own=True)
    except Unrepeatable as exc:
        notes.append(f"Not timed: {layer.name} ({at}): {exc}; time on a quieter machine, or with "
                     "OMP_NUM_THREADS=1.")
        return None
    return LayerSpeed(layer.name, str(layer.kind), layer.m, layer.n, rank, tuple(x.shape), at, dense, fact, cached)


def _share_break_even(found: dict[tuple, TimeBreakEven | None], timed: _Timed, timer: Timer, align: int,
                      row: LayerSpeed, notes: list[str]) -> None:
    """The time break-even of this (module, input shape), measured once and shared by identical layers; its dense
    time is the one ``row`` reported."""
    layer, mod, x, at = timed.layer, timed.mod, timed.x, timed.at
    key = (repr(mod), tuple(x.shape), str(x.dtype), at)
    if key not in found:
        timer.tag = (layer.name, at)
        try:
            found[key] = replace(time_break_even(layer, mod, x, timer, align, at), dense=row.dense)
        except Unrepeatable as exc:
            found[key] = None
            notes.append(f"Time break-even of {layer.name} ({at}) not found: {exc}.")
        return
    b = found[key]
    if b is not None:
        found[key] = TimeBreakEven(**{**b.__dict__, "layers": (*b.layers, layer.name)})


def agreeing_twins(rows: list[LayerSpeed], mods: dict[str, tuple[Layer, nn.Module | None]],
                   inputs: dict[str, torch.Tensor], paths: dict[str, str], latency_shape: tuple[int, ...] | None,
                   timer: Timer, notes: list[str]) -> list[LayerSpeed]:
    """Layers of one module configuration, rank and input shape are twins: their times must agree within 25% (a
    stall timed for one of them, or read from the cache, would otherwise pass as its own). Twins that disagree
    are measured again afresh; those still apart are refused (their cache entries dropped) with a note."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((repr(mods[r.layer][1]), r.rank, r.input_shape, r.at), []).append(i)
    out = list(rows)
    refused: set[int] = set()
    for idx in groups.values():
        if len(idx) < 2 or _twins_agree([out[i] for i in idx]):
            continue
        xs = {i: inputs[paths[rows[i].layer]] if rows[i].at == "traced" else reshape_input(
            inputs[paths[rows[i].layer]], mods[rows[i].layer][0].kind, latency_shape or ()) for i in idx}
        for i in idx:
            layer, mod = mods[rows[i].layer]
            timed = _Timed(layer, mod, rows[i].at, xs[i])  # type: ignore[arg-type]
            row = _row(timed, rows[i].rank, timer, notes, fresh=True)
            if row is None:
                refused.add(i)
            else:
                out[i] = row
        if not _twins_agree([out[i] for i in idx if i not in refused]):
            for i in idx:
                timer.forget((rows[i].layer, rows[i].at))  # its rows' times and its break-even's probes
            refused.update(idx)
            names = ", ".join(rows[i].layer for i in idx)
            notes.append(f"Not timed: {names} ({rows[idx[0]].at}): layers of the same shape took "
                         f"{', '.join(seconds(out[i].dense.median) for i in idx)} dense (more than 25% apart; their "
                         "time break-even is left out too); time on a quieter machine, or with OMP_NUM_THREADS=1.")
    return [r for i, r in enumerate(out) if i not in refused]


def _twins_agree(rows: list[LayerSpeed]) -> bool:
    for attr in ("dense", "factorized"):
        xs = [getattr(r, attr).median for r in rows]
        if xs and not agree(min(xs), max(xs)):
            return False
    return True
