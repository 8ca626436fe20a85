"""Tier 2: measured rank floors. Each layer is truncated alone (whitened), the model-level metric is measured on the
held-out batches, and a bracketing search over ranks in multiples of ``align`` (starting at the tier-1 rank, each
next rank predicted from the tier-1 curve, else bisected) finds the smallest rank that meets the tolerance there and
at every larger rank tried.

The prefix is not rerun for every evaluation: one recording pass stores, per held-out batch, the outputs of the
modules that can run before a layer's block (the siblings of the block and of each of its ancestors; the block is
the layer's deepest ancestor held in a ModuleList or Sequential, else its top-level child). While a layer is swept,
each such module whose call finished before the first call of any module holding the layer's weight returns its
stored output instead of computing it (never a module holding that weight); later calls run for real. A call is
matched to its recorded batch by the identity of its input tensors, never by their data pointers (a slice shares one). Everything after the layer runs as usual, so the metric is the same number a full
forward pass gives.

The stored outputs are bounded by a byte budget (``prefix_cache_bytes``; default :func:`default_cache_bytes`): the
earliest calls of every batch are kept (a module early in the forward is replayed for every layer after it), and
calls beyond the budget are not stored and run for real when replayed, from their real inputs: the numbers are the
same at any budget, only the time changes. The sweep works on the caller's model in place, one layer's weight at a
time, restored bit for bit after every evaluation.
"""

from __future__ import annotations

import copy
import heapq
import math
import operator
import time
from dataclasses import dataclass, replace
from dataclasses import fields as fields_of
from typing import TYPE_CHECKING, Callable, Iterable, TypedDict

import torch
from torch import nn

from ... import kinds, lrmath
from ...calresults import LayerFloor
from ...results import Layer
from ..data.inputs import Calibration, eval_mode
from ..measure.metric import Evaluator, Metric
from ..references import evaluator_of
from ..session import CalibrationSession
from ..statistics.stats import InputStatistics, by_name, module_path
from ..statistics.whiten import Truncator, WhitenedSpectrum

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from torch.utils.hooks import RemovableHandle

    from ..measure.metric import Measurement
    from ..statistics.stats import LayerInput


SWEPT = kinds.registry.SWEPT  # the kinds a floor is measured for (a live view of auditor.kinds)


Floor = LayerFloor  # one layer's measured floor: the report's type (auditor/calresults.py), returned as it is


@dataclass
class Floors:
    """Tier-2 results: per-layer floors keyed by ``Layer.name`` and how they were measured."""

    floors: dict[str, Floor]
    metric: str
    higher_is_better: bool
    tolerance: float
    reference: float  # the dense model's metric (0 for the relative output error)
    align: int
    search: str  # "bisect" | "all"
    evaluations: int
    seconds: float
    prefix_cache: bool
    kind: str = "output"  # the metric's kind (auditor/calibration/measure/metric.py): how its values become costs


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return ["", *(".".join(parts[: i + 1]) for i in range(len(parts)))]


def block_of(model: nn.Module, path: str) -> str:
    """The layer's block: its deepest ancestor whose parent is a ModuleList or Sequential, else its top-level child."""
    chain = _ancestors(path)
    best = chain[1] if len(chain) > 1 else ""
    for i in range(1, len(chain)):
        parent = model.get_submodule(chain[i - 1])
        if kinds.holds_blocks(parent):
            best = chain[i]
    return best


CACHE_SHARE = 0.25  # of the memory available when the sweep starts, for the prefix cache by default
CACHE_CAP = 8 * 2**30  # bytes, at most, by default
CACHE_FALLBACK = 2 * 2**30  # bytes by default where the available memory cannot be read


def default_cache_bytes() -> int:
    """The prefix cache's default budget: a quarter of the memory available now (MemAvailable, lowered to the
    cgroup's room), at most 8 GiB; 2 GiB where it cannot be read."""
    from ...spectra.backend import available_memory

    avail = available_memory()
    return CACHE_FALLBACK if avail is None else max(0, min(int(avail * CACHE_SHARE), CACHE_CAP))


def check_cache_bytes(budget: object) -> int | None:
    """``prefix_cache_bytes`` as an int (None stays None), or ValueError naming what is wrong."""
    if budget is None:
        return None
    try:
        n = None if isinstance(budget, bool) else operator.index(budget)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise ValueError(f"prefix_cache_bytes must be a whole number of bytes, 0 or more, not {budget!r}")
    return n


def _tensors(out: object, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    """Every tensor an output holds: in tuples, lists, dicts (a Hugging Face ``ModelOutput``) and the attributes of
    other objects (a key/value cache), to a bounded depth; each object once."""
    if id(out) in seen or depth > 8:
        return []
    seen.add(id(out))
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (str, bytes, int, float, bool, type(None))):
        return []
    items: Iterable[object]
    if isinstance(out, dict):
        items = out.values()
    elif isinstance(out, (tuple, list, set, frozenset)):
        items = out
    else:
        items = getattr(out, "__dict__", {}).values()
    found: list[torch.Tensor] = []
    for o in items:
        found += _tensors(o, seen, depth + 1)
    return found


def _storages(out: object) -> dict[tuple[str, int], int]:
    """(device, storage address) -> bytes of every storage an output's tensors keep alive: a view keeps its whole
    storage, and two views of one storage count once."""
    got: dict[tuple[str, int], int] = {}
    for t in _tensors(out, set()):
        st = t.untyped_storage()
        got[(str(t.device), st.data_ptr())] = st.nbytes()
    return got


class PrefixCache:
    """Stored outputs of the modules that run before each swept layer's block, replayed while that layer is swept.

    At most ``budget`` bytes of outputs are stored (None: :func:`default_cache_bytes`; 0 stores nothing): the
    storages their tensors keep alive, each counted once. When a call's output would take the store over the budget,
    the stored calls latest in their batch's forward go first (the new one included), so every batch keeps its
    earliest calls. A call not stored runs for real when replayed. ``bytes``: the bytes stored; ``peak_bytes``: the
    most ever stored once a call was admitted (never above the budget); ``dropped``: calls recorded but not kept."""

    def __init__(self, model: nn.Module, owners: dict[str, str], evaluator: Evaluator,
                 uses: dict[str, set[str]] | None = None, budget: int | None = None) -> None:
        """``owners``: layer name -> owning module path; ``uses``: layer name -> every module path holding its
        weight (a tied weight has several). No module holding a use of the layer under test (or containing one)
        is replayed, and replay stops at the first call of any use."""
        self.model = model
        budget = check_cache_bytes(budget)
        self.budget = default_cache_bytes() if budget is None else budget
        self.bytes = self.peak_bytes = self.dropped = 0
        self.uses = {name: {path} | set((uses or {}).get(name, ())) for name, path in owners.items()}
        self.evaluator = evaluator
        self.candidates: dict[str, set[str]] = {}  # layer -> module paths that may be replayed
        for name, path in owners.items():
            block = block_of(model, path)
            chain = _ancestors(block)
            cands: set[str] = set()
            for i in range(len(chain) - 1):
                parent = model.get_submodule(chain[i])
                for child, _ in parent.named_children():
                    full = f"{chain[i]}.{child}" if chain[i] else child
                    if full != chain[i + 1] and not any(u == full or u.startswith(full + ".")
                                                          for u in self.uses[name]):
                        cands.add(full)
            self.candidates[name] = cands
        self.owners = owners
        self.all = set().union(*self.candidates.values()) if self.candidates else set()
        self.starts: list[dict[str, list[int]]] = []  # batch -> module path -> start seq of each call
        self.ends: list[dict[str, list[int]]] = []
        self.outputs: list[dict[str, list[object]]] = []
        self.batch: int | None = None
        self._ptrs = {self._key(b.args, b.kwargs): i for i, b in enumerate(evaluator.batches)}
        self._record()

    @staticmethod
    def _key(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
        """A call's inputs as the recorded batch they are, or not: each tensor's identity (the evaluator holds the
        batches, so no other live tensor has it), shape, stride, offset and version, and the keyword names. A slice
        or a copy of a batch (same data pointer, other tensor) or a batch changed in place matches none."""
        def one(t: object) -> object:
            if not isinstance(t, torch.Tensor):
                return None
            return (id(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t._version)

        return (tuple(one(a) for a in args), tuple((k, one(v)) for k, v in kwargs.items()))

    def _record(self) -> None:
        """One pass over the held-out batches recording every module's call positions and, within the budget, the
        outputs of the calls that can be replayed."""
        store = _Admission(self)
        swept_by: dict[str, set[str]] = {}  # candidate path -> the layers it may be replayed for
        used_by: dict[str, set[str]] = {}  # module path -> the layers whose weight it holds
        for name, cands in self.candidates.items():
            for p in cands:
                swept_by.setdefault(p, set()).add(name)
            for u in self.uses[name]:
                used_by.setdefault(u, set()).add(name)
        handles = self._hooks(store, swept_by, used_by)
        try:
            with torch.no_grad():
                for b in self.evaluator.batches:
                    store.seq = 0  # positions count within their batch
                    store.started.clear()
                    self.starts.append({})
                    self.ends.append({})
                    self.outputs.append({})
                    self.model(*b.args, **b.kwargs)
        finally:
            for h in handles:
                h.remove()
        # a path's stored calls are always its earliest ones (positions grow with the call, and a call that is not
        # replayable for any layer is followed by none that is), so its k-th call is stored when k < len(outputs)

    def _hooks(self, store: "_Admission", swept_by: dict[str, set[str]],
               used_by: dict[str, set[str]]) -> list["RemovableHandle"]:
        """Pre- and post-hooks on every module the sweep needs: call positions, and the replayable outputs."""
        paths = {m: p for p, m in self.model.named_modules()}
        needed = set(self.owners.values()) | self.all | set().union(*self.uses.values())
        handles = []
        for mod, path in paths.items():
            if path not in needed:
                continue

            def pre(m: nn.Module, a: object, path: str = path) -> None:
                store.seq += 1
                self.starts[-1].setdefault(path, []).append(store.seq)
                store.started.update(used_by.get(path, ()))  # the layers one of whose uses has started

            def post(m: nn.Module, a: object, out: object, path: str = path) -> None:
                store.seq += 1
                self.ends[-1].setdefault(path, []).append(store.seq)
                if path in self.all and not swept_by[path] <= store.started:  # replayable for a layer not yet
                    store.keep(path, _detach(out))  # reached: a call after every such layer's first use never is

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return handles

    def replay(self, layer: str) -> "_Replay":
        return _Replay(self, layer)


class _Admission:
    """The prefix cache's admission while it records: each call's output stored unless that takes the store over
    its budget, the stored calls latest in their batch's forward going first (the new one included), so every batch
    keeps its earliest calls. Storages shared by several outputs count once."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.seq = 0  # the position of the current call in its batch's forward
        self.started: set[str] = set()  # the layers one of whose uses has started in this batch
        self.heap: list[tuple[int, int, int, str]] = []  # (-position in its batch, -batch, -call, path): latest on top
        self.refs: dict[tuple[str, int], list[int]] = {}  # storage -> [outputs holding it, its bytes]
        self.held: dict[tuple[int, str, int], dict[tuple[str, int], int]] = {}  # (batch, path, call) -> storages
        self.cut: dict[int, int] = {}  # batch -> the earliest position dropped: nothing later in that batch is stored

    def release(self, key: tuple[int, str, int]) -> None:
        for st in self.held.pop(key):
            self.refs[st][0] -= 1
            if self.refs[st][0] == 0:
                self.cache.bytes -= self.refs.pop(st)[1]

    def keep(self, path: str, out: object) -> None:
        c = self.cache
        b = len(c.outputs) - 1
        if c.budget == 0 or b in self.cut:  # a later call of a batch that lost one: its path's stored calls
            c.dropped += 1                  # must stay its earliest ones
            return
        stored = c.outputs[b].setdefault(path, [])
        k = len(stored)
        stored.append(out)
        self.held[(b, path, k)] = sts = _storages(out)
        for st, nbytes in sts.items():
            r = self.refs.setdefault(st, [0, nbytes])
            if r[0] == 0:
                c.bytes += nbytes
            r[0] += 1
        heapq.heappush(self.heap, (-self.seq, -b, -k, path))
        while c.bytes > c.budget:  # the latest calls go first; a path loses its last stored call first
            npos, nb, nk, npath = heapq.heappop(self.heap)
            self.cut[-nb] = min(self.cut.get(-nb, -npos), -npos)
            self.release((-nb, npath, -nk))
            c.outputs[-nb][npath].pop()
            c.dropped += 1
        c.peak_bytes = max(c.peak_bytes, c.bytes)


def _map_tensors(out: object, fn: Callable[[torch.Tensor], object], other: Callable[[object], object] = lambda o: o) -> object:
    """``fn`` on every tensor of a module's output (a tensor, or a plain tuple or list of them), ``other`` on the rest;
    named tuples and other containers count as "the rest"."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_map_tensors(o, fn, other) for o in out)
    if isinstance(out, list):
        return [_map_tensors(o, fn, other) for o in out]
    return other(out)


def _detach(out: object) -> object:
    return _map_tensors(out, torch.Tensor.detach)


def _clone(out: object) -> object:
    return _map_tensors(out, torch.Tensor.clone, copy.copy)


class _Replay:
    """While active, candidate modules that finished before the layer's first call return their stored outputs."""

    def __init__(self, cache: PrefixCache, layer: str) -> None:
        self.cache, self.layer = cache, layer
        self.replayed: list[dict[str, int]] = []  # batch -> module -> calls replayed
        for b in range(len(cache.starts)):
            # the first call of any module holding the weight under test: a tied use declared later may run first
            first = min((s for u in cache.uses[layer] for s in cache.starts[b].get(u, [])), default=math.inf)
            stored = cache.outputs[b]
            self.replayed.append({p: min(len(stored.get(p, ())), sum(1 for e in cache.ends[b].get(p, []) if e < first))
                                  for p in cache.candidates[layer]})
        self.counts: dict[str, int] = {}
        self.handles: list["RemovableHandle"] = []
        self.patched: list[nn.Module] = []

    def __enter__(self) -> "_Replay":
        cache = self.cache

        def root_pre(m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            cache.batch = cache._ptrs.get(cache._key(args, kwargs))
            self.counts = {}

        self.handles.append(cache.model.register_forward_pre_hook(root_pre, with_kwargs=True))
        for path in cache.candidates[self.layer]:
            if not any(r.get(path) for r in self.replayed):
                continue
            mod = cache.model.get_submodule(path)
            original = mod.forward

            def fwd(*args: object, _path: str = path, _orig: Callable[..., object] = original, **kwargs: object) -> object:
                b = cache.batch
                k = self.counts.get(_path, 0)
                self.counts[_path] = k + 1
                if b is not None and k < self.replayed[b].get(_path, 0):
                    return _clone(cache.outputs[b][_path][k])
                return _orig(*args, **kwargs)

            mod.forward = fwd  # an instance attribute shadows the class's forward until removed
            self.patched.append(mod)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        for mod in self.patched:
            del mod.__dict__["forward"]
        self.cache.batch = None


def _grid(layer: Layer, align: int) -> list[int]:
    useful = lrmath.max_useful_rank(layer.m, layer.n)
    return list(range(align, useful + 1, align))


def _next_rank(grid: list[int], lo: int, hi: int, results: dict[int, tuple[float, bool, float | None]],
               guide: WhitenedSpectrum | None, tolerance: float) -> int:
    """The next grid index to evaluate, strictly between ``lo`` (fails; -1: none) and ``hi`` (holds; len: none).

    Guided by the tier-1 curve when there is one: a layer's model-level error is close to a fixed multiple (its
    gain) of its layer-output error e(r), so the gain measured at the nearest evaluated rank predicts the smallest
    grid rank meeting the tolerance; measured on the char transformer this takes the sweep from about 5.3 to about
    3 evaluations per layer. Plain bisection otherwise, and whenever the prediction gives no new index."""
    mid = (lo + hi) // 2  # hi = len(grid) until a rank holds: then this bisects up to the largest grid rank
    if guide is None:
        return mid
    ref = grid[hi] if hi < len(grid) else grid[lo]
    e_layer = guide.error_at(ref)
    e_model = results[ref][0]
    if not (e_layer > 0 and e_model > 0 and math.isfinite(e_model)):
        return mid
    gain = e_model / e_layer
    want = next((j for j, r in enumerate(grid) if gain * guide.error_at(r) <= tolerance), len(grid))
    if want >= hi:
        want = hi - 1  # the prediction is at or above a rank known to hold: try the next one down
    if want <= lo:
        want = lo + 1
    return want


def _tier1_index(grid: list[int], spec: WhitenedSpectrum | None, align: int, target: float) -> int:
    """The index in ``grid`` of the grid rank at or above tier 1's rank for ``target`` (the grid's middle without a
    spectrum), clamped to the grid: where tier 2's search starts and the upper sensitivity probe."""
    want = spec.rank_for(target) if spec is not None else grid[len(grid) // 2]
    return min(len(grid) - 1, max(0, math.ceil(want / align) - 1))


def _check_search(search: str) -> None:
    if search not in ("bisect", "all"):
        raise ValueError(f"search must be 'bisect' or 'all', not {search!r}")


def floor_from_points(points: dict[int, bool]) -> int | None:
    """Smallest tried rank that holds, with every larger tried rank holding too; None if the largest fails."""
    floor = None
    for r in sorted(points, reverse=True):
        if not points[r]:
            break
        floor = r
    return floor


@dataclass
class SweepSettings:
    """How floors are measured (see :class:`Sweeper` and :func:`measure_floors` for each field)."""

    tolerance: float | None = None
    align: int = 8
    metric: Metric | Callable[..., float] | None = None
    stats: InputStatistics | None = None
    spectra: dict[str, WhitenedSpectrum] | None = None
    search: str = "bisect"
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None
    evaluator: "Evaluator | None" = None  # the dense reference to measure against (the audit's); None: one here


class SweepFields(TypedDict, total=False):
    """The keywords of :class:`Sweeper` and :func:`measure_floors`: :class:`SweepSettings`' fields."""

    tolerance: float | None
    align: int
    metric: Metric | Callable[..., float] | None
    stats: InputStatistics | None
    spectra: dict[str, WhitenedSpectrum] | None
    search: str
    prefix_cache: bool
    prefix_cache_bytes: int | None
    evaluator: "Evaluator | None"


class _Evaluations:
    """One layer's evaluations at grid indices: the layer's truncated weight written into the model, the model
    measured, the original written back (bit for bit, also when the measurement raises); each rank once.
    ``results``: rank -> (value, holds, top-1 agreement)."""

    def __init__(self, layer: Layer, param: torch.Tensor, grid: list[int], inp: "LayerInput | None",
                 measure: Callable[[], "Measurement"]) -> None:
        self.grid, self.param, self.measure = grid, param, measure
        self.original = param.detach().clone()
        self.trunc = Truncator(layer, self.original, inp)
        self.results: dict[int, tuple[float, bool, float | None]] = {}

    def __call__(self, i: int) -> bool:
        r = self.grid[i]
        if r not in self.results:
            w = self.trunc.weight(r)
            try:
                with torch.no_grad():
                    self.param.copy_(w)
                del w
                m = self.measure()
            finally:
                with torch.no_grad():
                    self.param.copy_(self.original)
            self.results[r] = (m.value, m.ok, m.top1)
        return self.results[r][1]


def _bisect(grid: list[int], ev: _Evaluations, spec: WhitenedSpectrum | None, metric: Metric, align: int) -> int:
    """The bracketing search from the tier-1 rank (guided by the tier-1 curve for the output error); the rank it
    started at."""
    target = metric.tier1_target
    i = _tier1_index(grid, spec, align, target)
    guide = spec if metric.output_error else None
    lo, hi = -1, len(grid)  # grid[lo] fails (or lo = -1), grid[hi] holds with every larger rank tried
    nxt = i
    while hi - lo > 1:
        if ev(nxt):
            hi = nxt
        else:
            lo = nxt
        if hi - lo <= 1 or lo == len(grid) - 1:
            break
        nxt = _next_rank(grid, lo, hi, ev.results, guide, metric.tolerance)
    return grid[i]


def _floor_of(layer: Layer, grid: list[int], results: dict[int, tuple[float, bool, float | None]],
              floor: int | None, start: int | None, inp: "LayerInput | None", metric: Metric) -> Floor:
    """The :class:`Floor` the measured points give, with its reason in words."""
    cliff = grid[grid.index(floor) - 1] if floor is not None and grid.index(floor) > 0 else None
    pts = sorted(results.items())
    f = Floor(
        layer=layer.name, floor=floor,
        metric_at_floor=results[floor][0] if floor is not None else None,
        cliff_rank=cliff, cliff_metric=results[cliff][0] if cliff is not None else None,
        compression=layer.compression(floor) if floor is not None else None,
        keep_dense=floor is None, start_rank=start,
        points=[(r, v[0]) for r, v in pts],
        top1={r: v[2] for r, v in pts if v[2] is not None},
        init="whitened" if inp is not None else "svd",
    )
    f.reason = (f"rank {floor} holds {metric.label} within {metric.tolerance:g} at {f.compression:.2f}x"
                if floor is not None else
                f"no rank below break-even {layer.break_even:.1f} holds {metric.label} within "
                f"{metric.tolerance:g}: keep dense (measured)")
    return f


class Sweeper:
    """Everything one needs to measure floors, built once: the model (swept in place), and from the
    calibration session the evaluator (the dense reference on the held-out batches, measured once) and the input
    statistics, plus the prefix cache. ``floor(name)`` measures one layer; it is what a cluster task runs, so a
    worker builds a Sweeper once and serves many layers.

    ``calibration``: a :class:`~auditor.calibration.session.CalibrationSession` (its metric, statistics and
    evaluator are used), or calibration data (a session is built). ``metric``: a ``Metric``, a user function
    ``fn(model, batches) -> float`` (higher is better; ``tolerance`` in its units), or None for the session's metric
    (the relative output error against the dense model, ``tolerance`` default 0.01, without one).

    The sweep works on ``model`` itself, not a copy (a copy would double the weights, and a KL metric's frozen dense
    copy would triple them): each evaluation writes one layer's truncated weight into it and writes the original
    back (bit for bit, also when the evaluation raises or is interrupted), and the model is in eval mode only while
    the sweeper records or measures; every module's mode is restored after. Between calls the model is exactly as
    given; do not run it on another thread while ``floor`` runs. ``prefix_cache_bytes``: the prefix cache's budget
    (None: :func:`default_cache_bytes`; 0 stores nothing and every module runs)."""

    def __init__(self, model: nn.Module, layers: dict[str, Layer] | list[Layer],
                 calibration: Calibration | CalibrationSession, **fields: Unpack[SweepFields]) -> None:
        """The settings as keywords (:class:`SweepFields`: ``tolerance``, ``align``, ``metric``, ``stats``,
        ``spectra``, ``prefix_cache``, ``prefix_cache_bytes``)."""
        o = SweepSettings(**fields)
        check_cache_bytes(o.prefix_cache_bytes)  # before the session's passes over the data
        self.layers = by_name(layers)
        session = CalibrationSession.of(calibration, model, metric=o.metric, tolerance=o.tolerance,
                                        layers=self.layers, stats=o.stats)
        self.session = session
        self.metric = session.metric
        self.align = o.align
        self.stats = session.statistics(self.layers)
        self.work = model  # swept in place: one layer's weight at a time, restored after each evaluation
        self.spectra = o.spectra or {}
        # measures the swept model against the dense model's reference (the audit's references', or one here)
        self.evaluator = o.evaluator if o.evaluator is not None else evaluator_of(session)
        self.params = dict(self.work.named_parameters(remove_duplicate=False))
        self.cache = None
        if o.prefix_cache:
            owners, uses = self._owners_and_uses()
            with eval_mode(self.work):
                self.cache = PrefixCache(self.work, owners, self.evaluator, uses, o.prefix_cache_bytes)
        self.on_evaluation: Callable[[int], None] | None = None  # called with the evaluations so far after each

    def _owners_and_uses(self) -> tuple[dict[str, str], dict[str, set[str]]]:
        """Each layer's owning module path, and every module path holding its weight (a tied weight has several)."""
        owners = {name: module_path(layer)[0] for name, layer in self.layers.items()}
        holders: dict[int, set[str]] = {}  # id of a parameter -> every module path holding it directly
        for path, mod in self.work.named_modules(remove_duplicate=False):
            for p in mod.parameters(recurse=False):
                holders.setdefault(id(p), set()).add(path)
        uses = {name: holders.get(id(self.params[layer.param]), set()) if layer.param in self.params else set()
                for name, layer in self.layers.items()}
        return owners, uses

    @property
    def evaluations(self) -> int:
        return self.evaluator.evaluations

    def _measure(self, name: str) -> "Measurement":
        with eval_mode(self.work):
            if self.cache is not None:
                with self.cache.replay(name):
                    m = self.evaluator.measure(self.work)
            else:
                m = self.evaluator.measure(self.work)
        if self.on_evaluation is not None:
            self.on_evaluation(self.evaluations)
        return m

    def floor(self, name: str, search: str = "bisect") -> Floor:
        """One layer's measured floor: truncated alone (whitened when it has input statistics), bisection over
        multiples of ``align`` from the tier-1 rank ("bisect") or every grid rank ("all")."""
        _check_search(search)
        layer = self.layers[name]
        grid = _grid(layer, self.align)
        kind = kinds.for_kind(layer.kind)
        if not kind.swept or kind.cannot_factorize:
            why = (f"{layer.kind} cannot be factorized: {kind.cannot_factorize}" if kind.cannot_factorize
                   else f"no truncation for {layer.kind} weights")
            return Floor(None, None, None, None, None, False, layer=name, init="", reason=f"not swept: {why}")
        if not grid:
            return Floor(None, None, None, None, None, True, layer=name,
                         reason=f"no multiple of {self.align} below break-even {layer.break_even:.1f}")
        inp = self.stats.layers.get(name)
        ev = _Evaluations(layer, self.params[layer.param], grid, inp, lambda: self._measure(name))
        start = None
        if search == "all":
            for i in range(len(grid)):
                ev(i)
        else:
            start = _bisect(grid, ev, self.spectra.get(name), self.metric, self.align)
        floor = floor_from_points({r: v[1] for r, v in ev.results.items()})
        if floor is not None and grid.index(floor) > 0:
            ev(grid.index(floor) - 1)  # the cliff is always measured
        return _floor_of(layer, grid, ev.results, floor, start, inp, self.metric)


    def probe(self, name: str, ranks: list[int]) -> Floor:
        """The layer truncated alone (whitened) at each of ``ranks`` and measured: a :class:`Floor` holding those
        points and no floor. What tier 3 scales tier 1's layer-output errors by when tier 2 is not run."""
        layer = self.layers[name]
        inp = self.stats.layers.get(name)
        grid = sorted(set(ranks))
        ev = _Evaluations(layer, self.params[layer.param], grid, inp, lambda: self._measure(name))
        for i in range(len(grid)):
            ev(i)
        points = [(r, ev.results[r][0]) for r in grid]
        top1 = {r: t1 for r in grid if (t1 := ev.results[r][2]) is not None}
        return Floor(None, None, None, None, None, False, points=points, layer=name, top1=top1,
                     init="whitened" if inp is not None else "svd",
                     reason=f"probed at rank{'s' if len(points) > 1 else ''} {', '.join(str(r) for r, _ in points)}")

    def result(self, floors: dict[str, Floor], search: str, seconds: float) -> Floors:
        """``Floors`` for ``floors`` measured by this sweeper (or by workers holding one like it)."""
        return Floors(floors, self.metric.label, self.metric.higher_is_better, self.metric.tolerance,
                      self.evaluator.reference, self.align, search, sum(len(f.points) for f in floors.values()),
                      seconds, self.cache is not None, self.metric.kind)


def probe_ranks(layer: Layer, spec: WhitenedSpectrum | None, align: int, target: float) -> list[int]:
    """Where a layer's sensitivity is probed: the smallest grid rank, and the grid rank at or above the one tier 1
    gives for ``target`` (the gain between them is interpolated, flat beyond)."""
    grid = _grid(layer, align)
    if not grid:
        return []
    return sorted({grid[0], grid[_tier1_index(grid, spec, align, target)]})


def probe_sensitivity(model: nn.Module, layers: dict[str, Layer] | list[Layer],
                      calibration: Calibration | CalibrationSession, spectra: dict[str, WhitenedSpectrum],
                      aim: tuple[int, float] = (8, 0.01), steps: Callable[[int, int, int], None] | None = None,
                      evaluator: "Evaluator | None" = None) -> Floors:
    """Each layer truncated alone at its :func:`probe_ranks` and measured on the held-out batches (at most two
    evaluations a layer): ``Floors`` whose points, not floors, are what counts (``search`` "probe"). A layer's
    tier-1 layer-output error times its measured gain is its model-level cost in tier 3
    (:func:`~auditor.calibration.tiers.budget.curves_from_floors`): a layer whose errors the rest of the model hides
    costs less than one whose errors reach the output. ``aim``: the rank grid's ``(align, target)``. ``model`` is not
    modified. ``evaluator``: the dense reference to measure against (the audit's references'; None: one measured
    here)."""
    t0 = time.perf_counter()
    align, target = aim
    sweeper = Sweeper(model, layers, calibration, align=align, spectra=spectra, evaluator=evaluator)
    base = sweeper.evaluations
    out: dict[str, Floor] = {}
    if steps is not None:
        steps(0, len(sweeper.layers), 0)
        sweeper.on_evaluation = lambda n: steps(len(out), len(sweeper.layers), n - base)
    for name, layer in sweeper.layers.items():
        ranks = probe_ranks(layer, spectra.get(name), align, target)
        if ranks and kinds.for_kind(layer.kind).swept and not kinds.for_kind(layer.kind).cannot_factorize:
            out[name] = sweeper.probe(name, ranks)
        if steps is not None:
            steps(len(out), len(sweeper.layers), sweeper.evaluations - base)
    return sweeper.result(out, "probe", time.perf_counter() - t0)  # its evaluations: one per point


def measure_floors(model: nn.Module, layers: dict[str, Layer] | list[Layer],
                   calibration: Calibration | CalibrationSession, tolerance: float | None = None,
                   progress: Callable[[str], None] | None = None,
                   steps: Callable[[int, int, int], None] | None = None, **fields: Unpack[SweepFields]) -> Floors:
    """Tier 2: per-layer measured floors on ``calibration``'s held-out batches. The settings as
    keywords (:class:`SweepFields`; see :class:`Sweeper` for the arguments). ``search``:
    "bisect" (from the tier-1 rank in ``spectra``) or "all" (every grid rank: the brute-force reference). ``model``
    is swept in place and comes back bit for bit as it was (see :class:`Sweeper`); ``prefix_cache_bytes`` bounds
    the prefix cache (None: :func:`default_cache_bytes`). ``progress(line)`` is told each layer's floor;
    ``steps(layers done, layers, evaluations so far)`` is called after each evaluation and each layer."""
    t0 = time.perf_counter()
    o = SweepSettings(**fields)
    if tolerance is not None:
        o = replace(o, tolerance=tolerance)
    _check_search(o.search)  # before the sweeper's setup (two passes over the held-out rows)
    sweeper = Sweeper(model, layers, calibration, **{f.name: getattr(o, f.name) for f in fields_of(o)})
    floors: dict[str, Floor] = {}
    base = sweeper.evaluations  # the evaluator's own checks of the dense model are not the sweep's
    if steps is not None:
        steps(0, len(sweeper.layers), 0)
        sweeper.on_evaluation = lambda n: steps(len(floors), len(sweeper.layers), n - base)
    for name in sweeper.layers:
        floors[name] = f = sweeper.floor(name, o.search)
        if progress is not None:
            progress(f"{name}: floor {f.floor} after {len(f.points)} evaluations")
        if steps is not None:
            steps(len(floors), len(sweeper.layers), sweeper.evaluations - base)
    return sweeper.result(floors, o.search, time.perf_counter() - t0)
