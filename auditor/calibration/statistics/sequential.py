"""Factors fitted to the model they will live in: the sequential, output-anchored fit.

The independent fit (:class:`.whiten.Truncator`) truncates each layer under the dense model's inputs X. In the
factorized model a layer reads X^, what the factorized layers before it produce. Here the planned layers are fitted
in the order the model calls them: each one on the inputs X^ that the layers fitted before it give, anchored to the
dense layer's outputs on the dense inputs, X W^T. Per group, with C = X^T X^ (the cross term), G = X^^T X^ and
mu = p * mean(diag G), p = :func:`pull` (RIDGE up to PULL_ROWS rows per input, then shrinking as n / rows):

    W* = W (C + mu I) (G + mu I)^-1

minimises ||X W^T - X^ M^T||^2 + mu ||M - W||^2: a least-squares refit, pulled toward the dense weight (so it is W
exactly when X^ = X). The rank-r fit is then the whitened truncation of W* under G (S S^T = G + lambda I, lambda the
whitening's own damping, DAMP * mean(diag G)): the rank-r map closest to W* on the shifted inputs. With X^ = X both
steps reduce to the independent fit. Why the pull (RIDGE = 1e-2, not the whitening's 1e-6): the refit estimates a
full in x in map from the fit rows, and with few rows per input dimension (the digits MLP: 1,000 rows for 512 inputs)
it fits their noise; with many (a language model's tens of thousands of tokens for 192 inputs) the same pull holds
the refit back, so it shrinks as n / rows past PULL_ROWS rows per input; measured in docs/calibration.md ("The
sequential fit").

Stages: the planned layers in call order, those reading one input tensor (q, k, v) fitted together. Each stage is
one pass over the fit rows, running every batch twice (the dense weights, then the weights fitted so far put in
place of the dense ones: a rank-r weight computes what its two factors compute), with hooks that read each layer's
rows as the statistics do (the kinds' own feeds) and add the float64 sums C and G. In a model of repeated blocks
(:func:`.stream.find_blocks`, run one after another as :mod:`.stream` checks) a stage inside block k runs block k
alone, on the dense model's inputs to it and on the fitted model's, both kept per batch and carried to block k + 1
once its stages are done (GPTQ's sequential mode); the stages before the blocks (embeddings), and every stage of a
model without such blocks, run the whole model, and those after them (the output head) the model with every block
returning the last block's kept output, dense or fitted (the blocks are not run again). In a block the dense runs
are one per batch for all its stages (:func:`_dense_rows`: every stage's dense rows read at once, in the run's dtype,
with the block's dense output), so only the fitted runs are made per stage, and each ends as the stage's last
layer is about to run, its rows read (:func:`_stop_after`: a stage's layers read one input, so none of its outputs
is needed). Alive at once: one stage's sums, one
batch's float64 rows, and with blocks the two kept inputs of each batch and the block's dense rows of every fit
batch (each taken out once its stage has summed it); the model's weights are put back afterwards. Embeddings (lookup
counts) read ids, which no factorized layer changes: they get the independent fit on their counts. A planned layer
the calibration never reaches gets the plain SVD, as in the independent fit.

Block by block, once a block's stages are fitted its planned layers' factors are trained together on the block's
output (:mod:`.refine`, ``refine`` epochs at most; 0: the closed form only), and the refined block's outputs are what
the next block reads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from ... import kinds
from ...results import Layer
from ..data.inputs import Batch, Calibration, eval_mode, main_output, model_device, run
from .refine import EPOCHS, Batches, Refined, Refinement, refine_block
from .stats import LayerInput, batch_mask, kept_rows
from .stream import (Blocks, NotSequential, check_sequential, find_blocks, first_inputs, hidden_state,
                     patched_forwards, with_hidden)
from .whiten import DAMP, Pinned, Truncator, spill_array


_VIEWS = {torch.float32: torch.float32, torch.float64: torch.float64, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}  # a weight's bits as numpy holds them (bfloat16 through int16)
RIDGE = 1e-2  # mu = RIDGE * mean(diag G): the refit's pull toward the dense weight, at PULL_ROWS rows per input or fewer
PULL_ROWS = 2  # rows per input dimension up to which the whole RIDGE pulls; beyond, the pull shrinks as n / rows


def pull(ridge: float, n: int, rows: int) -> float:
    """The refit's pull for a layer of ``n`` inputs fitted on ``rows`` rows: ``ridge`` while there are at most
    ``PULL_ROWS`` rows per input, then ``ridge * PULL_ROWS * n / rows``: a least-squares refit's noise goes as n / rows,
    and a pull sized for the digits MLP's 1,000 rows of 512 inputs held the refit back on a language model's 60,000
    rows of 192 (docs/calibration.md, "The sequential fit")."""
    if rows <= 0 or PULL_ROWS * n >= rows:
        return ridge
    return ridge * PULL_ROWS * n / rows


def fitted_map(f: np.ndarray, cross: np.ndarray, gram: np.ndarray, ridge: float = RIDGE) -> tuple[np.ndarray, float]:
    """W* = F (C + mu I)(G + mu I)^-1 for one group (F out x in, C = X^T X^, G = X^^T X^, both in x in), and
    mu = ``ridge`` * mean(diag G) (``ridge`` where that is 0)."""
    n = gram.shape[0]
    scale = float(np.mean(np.diagonal(gram))) if n else 0.0
    lam = ridge * scale if scale > 0 else ridge
    rhs = (f @ cross).T  # (G + lambda I) W*^T = (C^T + lambda I) W^T, column-major as LAPACK takes it
    rhs += lam * f.T
    return ridge_solve(gram, lam, rhs).T, lam


def ridge_solve(gram: np.ndarray, lam: float, rhs: np.ndarray) -> np.ndarray:
    """(G + lambda I)^-1 ``rhs`` for a Gram G (n x n, made symmetric) and lambda > 0: a Cholesky solve in one n x n
    array beside G (symmetrised and ridged in place, and factored in place: handed to LAPACK as its transpose, the
    same symmetric matrix in the column-major order LAPACK takes, so it is not copied); LU where it is not positive
    definite, a non-finite G included. (2026-12-07: LU on (G + G^T) / 2 + lambda I formed through an identity, four
    n x n arrays beside G and C at once: 3.9 GB at the 7B shape's down projection, the fit's largest.)"""
    from scipy.linalg import LinAlgError, cho_factor, cho_solve

    g = gram + gram.T
    g *= 0.5
    g.flat[:: g.shape[0] + 1] += lam
    try:  # (no condition estimate: a non-finite G gives NaN, as LU did)
        return cho_solve(cho_factor(g.T, overwrite_a=True, check_finite=False), rhs, check_finite=False)
    except (LinAlgError, ValueError):
        g = (gram + gram.T) / 2
        g.flat[:: g.shape[0] + 1] += lam
        return np.linalg.solve(g, rhs)


def fitted_truncator(layer: Layer, weight: torch.Tensor, cross: np.ndarray, gram: np.ndarray,
                     damp: float = DAMP, ridge: float = RIDGE) -> Truncator:
    """The truncator of ``layer`` fitted on shifted inputs: W* (:func:`fitted_map`, ``ridge``) per group, decomposed
    under the shifted inputs' Gram (damped by ``damp``). ``cross`` and ``gram``: (groups, n, n) float64."""
    from .whiten import function_matrices

    f = function_matrices(layer, weight)
    fstar = np.stack([fitted_map(f[g], cross[g], gram[g], ridge)[0] for g in range(f.shape[0])])
    rows = LayerInput(layer.name, str(layer.kind), gram, 0, gram.shape[-1], gram.shape[0])
    return Truncator.of_function(layer, weight, fstar, rows, damp)


def refit_weight(layer: Layer, weight: torch.Tensor, cross: np.ndarray, gram: np.ndarray,
                 ridge: float) -> torch.Tensor | None:
    """A layer the plan keeps dense, refitted at full rank on the shifted inputs: W* (:func:`fitted_map`, pull
    ``ridge``) per group, in the weight's stored layout, dtype and device. None where its inputs did not move (the
    sums of the dense and the shifted rows are the same: W* would be W)."""
    from .whiten import function_matrices, stored_weight

    if np.array_equal(cross, gram):
        return None
    f = function_matrices(layer, weight)
    fstar = np.stack([fitted_map(f[g], cross[g], gram[g], ridge)[0] for g in range(f.shape[0])])
    w = stored_weight(layer, torch.from_numpy(fstar), tuple(weight.shape), weight.dtype, weight.device)
    return w.contiguous()  # a parameter's layout


class _Rows:
    """One layer's rows for the current batch (what the kinds' hooks feed), kept until the stage adds them. Layers
    fed one tensor (q, k and v) get one float64 copy of it (``seen``, by the tensor's storage, shape and version)."""

    def __init__(self, n: int, groups: int = 1, diagonal: bool = False,
                 seen: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 raw: bool = False) -> None:
        self.n, self.groups, self.diagonal, self.raw = n, groups, diagonal, raw
        self.x: list[torch.Tensor] = []
        self.counts: np.ndarray | None = None
        self.seen = seen if seen is not None else {}

    def add_rows(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version, self.groups, self.n)
        hit = self.seen.get(key)
        if hit is None:  # the entry holds the tensor itself, so no other tensor can take its memory meanwhile
            rows = kept_rows(x, keep).detach().reshape(-1, self.groups, self.n)
            # ``raw``: a copy in the run's own dtype, made float64 where it is added (the same values)
            hit = self.seen[key] = (x, rows.clone() if self.raw else rows.to(torch.float64))
        self.x.append(hit[1])

    def add_counts(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        if keep is not None and ids.dim() == keep.dim() and ids.shape[0] == 1 and ids.shape[1:] == keep.shape[1:]:
            ids = ids.expand(keep.shape)
        ids = kept_rows(ids, keep, 0)
        c = torch.bincount(ids.detach().reshape(-1).long(), minlength=self.n).to(torch.float64)[: self.n].numpy()
        self.counts = c if self.counts is None else self.counts + c

    def take(self) -> torch.Tensor | None:
        x = (self.x[0] if len(self.x) == 1 else torch.cat(self.x)) if self.x else None
        self.x = []
        return x


class _RowFeeds:
    """The :class:`auditor.kinds.Feeds` of a stage: the kinds attach their usual hooks, which fill :class:`_Rows`."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw  # rows kept in the run's dtype (:func:`_dense_rows`), not float64
        self.feeds: dict[str, _Rows] = {}
        self.seen: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # one run's inputs' rows
        self.handles: list[object] = []
        self.current: list[torch.Tensor | None] = [None]
        self.missing_: dict[str, str] = {}

    def rows(self, layer: Layer, n: int, groups: int = 1, shared: bool = False) -> _Rows:
        return self.feeds.setdefault(layer.name, _Rows(n, groups, seen=self.seen, raw=self.raw))

    def counts(self, layer: Layer, n: int) -> _Rows:
        return self.feeds.setdefault(layer.name, _Rows(n, diagonal=True))

    def mask(self) -> torch.Tensor | None:
        return self.current[0]

    def hook(self, mod: nn.Module, fn: Callable[..., None], with_kwargs: bool = False) -> None:
        self.handles.append(mod.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def missing(self, layer: Layer, reason: str) -> None:
        self.missing_[layer.name] = reason

    def remove(self) -> None:
        for h in self.handles:
            h.remove()  # type: ignore[attr-defined]
        self.handles.clear()


@contextlib.contextmanager
def _row_hooks(model: nn.Module, layers: list[Layer], raw: bool = False) -> Iterator[_RowFeeds]:
    """The kinds' input hooks of ``layers`` on ``model``, feeding :class:`_Rows`; removed afterwards."""
    feeds = _RowFeeds(raw)
    try:
        groups: dict[str, tuple[object, nn.Module, list[Layer]]] = {}
        for layer in layers:
            kind = kinds.for_kind(layer.kind)
            path, _ = kind.module_path(layer)
            mod = model.get_submodule(path)
            groups.setdefault(f"{kind.kind}:{path}", (kind, mod, []))[2].append(layer)
        for key, (kind, mod, group) in groups.items():
            kind.statistics(key.partition(":")[2], mod, group, feeds)  # type: ignore[attr-defined]
        yield feeds
    finally:
        feeds.remove()


def _param(model: nn.Module, layer: Layer) -> torch.Tensor:
    path, attr = kinds.for_kind(layer.kind).module_path(layer)
    return getattr(model.get_submodule(path), attr)


@contextlib.contextmanager
def _weights(model: nn.Module, layers: dict[str, Layer], weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` with the weights ``weights`` (layer name -> stored tensor) in place of its own while the block runs."""
    saved = []
    try:
        for name, w in weights.items():
            p = _param(model, layers[name])
            saved.append((p, p.data))
            p.data = w
        yield
    finally:
        for p, d in saved:
            p.data = d


@dataclass
class _Sums:
    """One stage's float64 sums per layer: C = X^T X^, G = X^^T X^ (groups, n, n); counts for lookups. Layers that
    read one pair of tensors (q, k and v) hold one C and one G between them: the same arrays under each name."""

    cross: dict[str, np.ndarray] = field(default_factory=dict)
    gram: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def add(self, pairs: "dict[str, tuple[torch.Tensor, torch.Tensor]]") -> None:
        """One batch's rows, (dense, fitted) per layer, added into the sums: each product made once per pair of
        tensors and added in place, C's before G's is made, so one n x n product is alive beside the sums
        (2026-12-07: both products, and a new sum per layer each batch: the 7B shape's down_proj stage held five
        11,008-wide float64 arrays at once, its q, k and v stage six 4,096-wide ones where two are needed)."""
        groups: dict[tuple[int, int], list[str]] = {}
        for name, (x, xh) in pairs.items():
            if x.shape != xh.shape:
                raise ValueError(f"{name}: the dense and the factorized model gave it {tuple(x.shape)} and "
                                 f"{tuple(xh.shape)} rows")
            groups.setdefault((id(x), id(xh)), []).append(name)
        for names in groups.values():
            x, xh = pairs[names[0]]
            c = _product(x, xh)
            _add_into(self.cross, names, c)
            g = c.copy() if xh is x else None
            del c  # freed before G's product is made, unless it is a new sum
            _add_into(self.gram, names, _product(xh, xh) if g is None else g)
            del g
            for name in names:
                self.rows[name] = self.rows.get(name, 0) + x.shape[0]

    def pull(self, name: str, ridge: float) -> float:
        """The refit's pull for ``name``: :func:`pull` at its input width and the rows summed (``ridge`` where no Gram)."""
        gram = self.gram.get(name)
        return pull(ridge, gram.shape[-1], self.rows.get(name, 0)) if gram is not None else ridge


def input_key(x: object, other: object) -> tuple[object, ...]:
    """What tells one input tensor from another while a forward runs (its storage, shape and strides), so layers
    reading the same one are one stage; ``(other,)`` for an input that is not a tensor."""
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else (other,)


def _call_order(model: nn.Module, layers: list[Layer], batch: Batch) -> tuple[list[list[Layer]], bool]:
    """The planned layers in the order the model first reads them on ``batch``, those reading one input tensor (by
    storage, shape and strides) together: the stages (layers never called come last, each alone); and whether every
    planned module was called exactly once (then a stage's run may stop as its last layer is reached)."""
    seen: dict[str, tuple[int, tuple[object, ...]]] = {}
    calls: dict[str, int] = {}
    alive: list[object] = []  # the inputs held until the pass ends, so no other tensor reuses their memory

    def note(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0] if args else None
            seen.setdefault(name, (len(seen), input_key(x, name)))
            calls[name] = calls.get(name, 0) + 1
            alive.append(x)
        return hook

    handles = []
    for layer in layers:
        path, _ = kinds.for_kind(layer.kind).module_path(layer)
        handles.append(model.get_submodule(path).register_forward_pre_hook(note(layer.name)))
    try:
        run(model, batch)
    finally:
        for h in handles:
            h.remove()
    stages: list[list[Layer]] = []
    last: tuple[object, ...] | None = None
    for layer in sorted((l for l in layers if l.name in seen), key=lambda l: seen[l.name][0]):
        key = seen[layer.name][1]
        if stages and key == last:
            stages[-1].append(layer)
        else:
            stages.append([layer])
        last = key
    return stages + [[l] for l in layers if l.name not in seen], all(calls.get(l.name) == 1 for l in layers)


def _product(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """a^T b per group, (groups, n, n) float64."""
    return (a[:, 0].T @ b[:, 0])[None].numpy() if a.shape[1] == 1 else torch.einsum("rgi,rgj->gij", a, b).numpy()


def _add_into(held: dict[str, np.ndarray], names: list[str], p: np.ndarray) -> None:
    """``p`` added into each of ``names``' sums in ``held``. Names without a sum take ``p`` itself (one array
    between them); names holding one array that no other name holds add into it in place, once; an array another
    name holds too gets a new sum for these names (the same numbers: a + p either way)."""
    fresh = [n for n in names if n not in held]
    for n in fresh:
        held[n] = p
    by_array: dict[int, list[str]] = {}
    for n in names:
        if n not in fresh:
            by_array.setdefault(id(held[n]), []).append(n)
    for group in by_array.values():
        cur = held[group[0]]
        if sum(a is cur for a in held.values()) == len(group):
            np.add(cur, p, out=cur)
        else:
            new = cur + p
            for n in group:
                held[n] = new


Runs = list[tuple["torch.Tensor | None", Callable[[], object], Callable[[], object]]]  # per batch: mask, dense, fitted


class _StageRead(Exception):
    """Raised once every layer of a stage has read its input: the rest of the forward is not needed."""


def _zeros_out(mod: nn.Linear) -> Callable[..., torch.Tensor]:
    """A stand-in forward for a stage's ``nn.Linear`` whose output no row of the stage reads: zeros of its shape."""
    def forward(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        return x.new_zeros((*x.shape[:-1], mod.out_features))
    return forward


@contextlib.contextmanager
def _stop_after(model: nn.Module, stage: list[Layer], stop: bool) -> Iterator[Callable[[Callable[[], object]], None]]:
    """A runner that calls a run and, with ``stop``, ends it (:class:`_StageRead`) as the last of the stage's modules
    is about to run, its rows read (forward pre-hooks, after the kinds' row hooks; removed afterwards). The stage's
    modules all read one input tensor (:func:`_call_order`), made before any of them runs, so none of their outputs
    reaches a row of the stage: with ``stop`` a plain ``nn.Linear`` among them computes zeros of its output's shape
    for the run (:func:`_zeros_out`), and the last one does not run. A stage's run so costs the block up to the
    stage's first layer, where it cost the block up to its last (2026-12-07: a Llama block's stages ran 2.36 of the
    block a batch, now 1.36)."""
    mods = {id(m): m for m in (model.get_submodule(kinds.for_kind(l.kind).module_path(l)[0]) for l in stage)}
    ran: set[int] = set()

    def before(mod: nn.Module, _a: object) -> None:
        ran.add(id(mod))
        if len(ran) == len(mods):
            raise _StageRead

    handles = [m.register_forward_pre_hook(before) for m in mods.values()] if stop else []
    stubs = [m for m in mods.values() if stop and type(m) is nn.Linear and "forward" not in vars(m)]

    def call(fn: Callable[[], object]) -> None:
        ran.clear()
        try:
            for m in stubs:
                m.forward = _zeros_out(m)  # type: ignore[method-assign]
            fn()
        except _StageRead:
            pass
        finally:
            for m in stubs:
                del m.forward

    try:
        yield call
    finally:
        for h in handles:
            h.remove()


def _stage_sums(model: nn.Module, stage: list[Layer], runs: Runs, stop: bool = False,
                captured: "list[dict[str, torch.Tensor | None]] | None" = None) -> _Sums:
    """One pass over the batches: each run dense, then with the weights fitted so far, the stage's rows of both
    added into its sums. ``stop``: each run ends once the stage's layers have run. ``captured``: each batch's dense
    rows as :func:`_dense_rows` kept them (the dense runs are not made again), taken out as they are summed."""
    sums = _Sums()
    with _row_hooks(model, stage) as feeds, _stop_after(model, stage, stop) as call:
        for j, (mask, dense_run, fitted_run) in enumerate(runs):
            feeds.current[0] = mask
            if captured is None:
                call(dense_run)
                dense = {name: r.take() for name, r in feeds.feeds.items()}
            else:
                dense = _as_float64({l.name: captured[j].pop(l.name, None) for l in stage})  # freed as summed
            feeds.seen.clear()
            call(fitted_run)
            pairs = {}
            for name, r in feeds.feeds.items():
                xh = r.take()
                if not r.diagonal and dense[name] is not None and xh is not None:
                    pairs[name] = (dense[name], xh)
            sums.add(pairs)
            feeds.seen.clear()
            del dense, pairs
        for name, r in feeds.feeds.items():
            if r.diagonal and r.counts is not None:
                sums.counts[name] = r.counts / 2  # each batch counted by both runs: the same ids
    return sums


def _as_float64(rows: "dict[str, torch.Tensor | None]") -> "dict[str, torch.Tensor | None]":
    """Kept rows as float64, one copy per tensor (q, k and v share theirs, so their products are made once)."""
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor | None] = {}
    for name, x in rows.items():
        if x is not None and id(x) not in made:
            made[id(x)] = x.to(torch.float64)
        out[name] = made[id(x)] if x is not None else None
    return out


def _dense_rows(model: nn.Module, layers: list[Layer], blk: nn.Module,
                inputs: list[tuple[tuple[object, ...], dict[str, object]]], masks: list[object]
                ) -> "tuple[list[dict[str, torch.Tensor | None]], list[torch.Tensor]] | None":
    """One dense run of block ``blk`` per batch, reading the input rows of every one of its ``layers`` at once (in
    the run's dtype; q, k and v one tensor) and its output: what each of its stages' dense runs read, without a run
    per stage (a Llama block's four stages ran it 2.36 times a batch, stopped after each stage's layers). None where
    a layer is fed lookup counts (both runs count them: the stages run as before)."""
    rows: list[dict[str, torch.Tensor | None]] = []
    outs: list[torch.Tensor] = []
    with _row_hooks(model, layers, raw=True) as feeds:
        if any(r.diagonal for r in feeds.feeds.values()):  # the kinds made their feeds as they hooked
            return None
        for j, (args, kwargs) in enumerate(inputs):
            feeds.current[0] = masks[j]  # type: ignore[assignment]
            outs.append(hidden_state(blk(*args, **kwargs)))
            rows.append({name: r.take() for name, r in feeds.feeds.items()})
            feeds.seen.clear()
    return rows, outs


def weighted_truncator(layer: Layer, weight: torch.Tensor, cross: np.ndarray, gram: np.ndarray,
                       moment: tuple[np.ndarray, bool, int], damp: float = DAMP, ridge: float = RIDGE) -> Truncator | None:
    """The fitted map W* = F T (T = (C + mu I)(G + mu I)^-1) truncated loss-aware under the shifted inputs' Gram
    (:func:`~auditor.calibration.tiers.fisher.weighted_bases`): in the metric the output-gradient moment G puts on
    the outputs; a moment carried to input space (H = F^T G F) becomes W*'s own, T^T H T. One group only; None where
    the moment is zero."""
    from .whiten import weighted_bases
    from .whiten import function_matrices

    f = function_matrices(layer, weight)[0]
    fstar, lam = fitted_map(f, cross[0], gram[0], ridge)
    h, carried, samples = moment
    if carried:
        rhs = np.array(cross[0].T, order="F")  # C^T + lambda I, column-major as LAPACK takes it
        rhs.flat[:: rhs.shape[0] + 1] += lam
        t = ridge_solve(gram[0], lam, rhs).T
        h = t.T @ h @ t
    cut = weighted_bases(fstar, gram[0], False, h, carried, damp, samples)
    return None if cut is None else Truncator.from_bases(layer, weight, fstar[None], cut[1])


def _stage_truncators(model: nn.Module, stage: list[Layer], sums: _Sums, damp: float, ridge: float,
                      moments: "Mapping[str, tuple[np.ndarray, bool, int]] | None" = None) -> dict[str, Truncator]:
    """The stage's truncators from its sums (:func:`_truncator`), its layers on every core at once, each on one BLAS
    thread, or on its share of the cores' where the stage has fewer layers than cores (``whiten.on_every_core``), in
    the stage's order."""
    from .whiten import on_every_core

    def one(layer: Layer) -> Truncator:
        return _truncator(model, layer, sums, (damp, ridge), moments)

    return dict(zip([l.name for l in stage], on_every_core(one, stage, share=True)))


def _truncator(model: nn.Module, layer: Layer, sums: _Sums, damping: tuple[float, float],
               moments: "Mapping[str, tuple[np.ndarray, bool, int]] | None") -> Truncator:
    """One layer's truncator from its stage's sums: the fitted map where the rows were read (loss-aware where
    ``moments`` has the layer's output-gradient moment), the independent fit on the counts of a lookup, the plain SVD
    where the calibration never reached the layer. ``damping``: (damp, ridge)."""
    damp, ridge = damping
    weight = _param(model, layer)
    ridge_l = sums.pull(layer.name, ridge)
    if layer.name in sums.gram and moments is not None and layer.name in moments and \
            sums.gram[layer.name].shape[0] == 1:
        cut = weighted_truncator(layer, weight, sums.cross[layer.name], sums.gram[layer.name],
                                 moments[layer.name], damp, ridge_l)
        if cut is not None:
            return cut
    if layer.name in sums.gram:
        return fitted_truncator(layer, weight, sums.cross[layer.name], sums.gram[layer.name], damp, ridge_l)
    if layer.name in sums.counts:
        c = sums.counts[layer.name]
        inp = LayerInput(layer.name, str(layer.kind), c, int(c.sum()), c.shape[0], diagonal=True)
        return Truncator(layer, weight, inp, damp)
    return Truncator(layer, weight, None, damp)


@dataclass
class _Fitter:
    """The fit so far: each stage's truncators (``out``) and the weights they put in place (``fitted``)."""

    model: nn.Module
    plan: dict[str, tuple[Layer, int]]
    damp: float
    ridge: float
    moments: "Mapping[str, tuple[np.ndarray, bool, int]] | None" = None
    refit: dict[str, Layer] = field(default_factory=dict)  # layers kept dense, refitted at full rank
    out: dict[str, Pinned | Refined] = field(default_factory=dict)  # each planned layer's factors at its rank
    fitted: dict[str, torch.Tensor] = field(default_factory=dict)
    refitted: dict[str, torch.Tensor] = field(default_factory=dict)
    epochs: int = EPOCHS  # the block refinement's most epochs (0: none)
    device: torch.device | None = None  # where a block's refinement trains (None: where its weights are)
    scratch: "tempfile.TemporaryDirectory[str] | None" = None  # finished blocks' factors and weights (:meth:`spill`)
    stop: bool = False  # a stage's runs stop as its last layer is reached (each planned module is called once)

    @property
    def layers(self) -> dict[str, Layer]:
        return {**{name: layer for name, (layer, _) in self.plan.items()}, **self.refit}

    def stage(self, stage: list[Layer], runs: Runs,
              captured: "list[dict[str, torch.Tensor | None]] | None" = None) -> None:
        sums = _stage_sums(self.model, stage, runs, self.stop, captured)
        planned = [l for l in stage if l.name in self.plan]
        for name, trunc in _stage_truncators(self.model, planned, sums, self.damp, self.ridge, self.moments).items():
            self.out[name] = trunc.pinned(self.plan[name][1])  # the decomposition dropped: its rank's factors kept
            self.fitted[name] = trunc.weight(self.plan[name][1])
        for layer in stage:
            if layer.name in self.refit and layer.name in sums.gram:
                w = refit_weight(layer, _param(self.model, layer), sums.cross[layer.name], sums.gram[layer.name],
                                 sums.pull(layer.name, self.ridge))
                if w is not None:
                    self.fitted[layer.name] = self.refitted[layer.name] = w

    def refine(self, blk: nn.Module, prefix: str, stage_layers: list[Layer], inputs: list[tuple[tuple[object, ...],
               dict[str, object]]], targets: list[torch.Tensor], masks: list[torch.Tensor | None]) -> None:
        """The planned layers of block ``blk`` (its parameters' names start with ``prefix`` in the model) trained
        together on its output (:func:`.refine.refine_block`), with every other weight fitted so far in place. While
        it trains, each planned layer's closed-form factors wait on disk, written as its master factors are made
        (:meth:`_spill_out`), and its fitted weight is not held (the refinement computes with the factors): made
        again from the factors it keeps, refined or not, bit for bit (2026-12-08: both held, with a second float64
        copy of every factor, beside the refinement's factors four times over)."""
        planned = []
        for layer in stage_layers:
            path, attr = kinds.for_kind(layer.kind).module_path(layer)
            if layer.name in self.out and not isinstance(self.out[layer.name], Refined) and path.startswith(prefix):
                planned.append((layer, f"{path[len(prefix):]}.{attr}"))
                self.fitted.pop(layer.name, None)

        def closed_forms() -> Iterator[tuple[Layer, str, tuple[np.ndarray, np.ndarray]]]:
            for layer, name in planned:
                yield layer, name, self.out[layer.name].factors(self.plan[layer.name][1])
                self._spill_out(layer)  # asked for the next: this layer's masters are made

        with _weights(self.model, self.layers, self.fitted):
            done = refine_block(blk, closed_forms(), Batches(inputs, targets, masks), hidden_state, self.epochs,
                                device=self.device)
        for layer, _ in planned:
            closed, kept = self.out[layer.name], done.get(layer.name)
            assert isinstance(closed, Pinned)  # a planned layer is one not refined yet
            rank = self.plan[layer.name][1]
            if kept is not None:  # the refined factors replace the closed form, and its files
                closed.remove_files()
                self.out[layer.name], self.fitted[layer.name] = kept, kept.weight(rank)
            else:  # the closed form, read from disk where it waited there: mapped afresh, its read pages let go
                self.fitted[layer.name] = closed.weight(rank)
                self.out[layer.name] = closed.remapped() if closed.on_disk else closed

    def _base(self, layer: Layer) -> str:
        """Where ``layer``'s spilled arrays go: a file name's stem in the fit's temporary directory (made once)."""
        from ..._env import scratch_prefix, sweep_scratch

        if self.scratch is None:
            sweep_scratch()  # a killed run's folders first
            self.scratch = tempfile.TemporaryDirectory(prefix=scratch_prefix("sequential"))
        return os.path.join(self.scratch.name, f"l{list(self.plan).index(layer.name)}")

    def _spill_out(self, layer: Layer) -> None:
        """``layer``'s factors written to the fit's temporary directory and read back memory-mapped, once."""
        held = self.out.get(layer.name)
        if held is not None and not held.on_disk:
            self.out[layer.name] = held.spilled(self._base(layer))

    def spill(self, layers: list[Layer]) -> None:
        """A finished block's planned layers: their factors and fitted weights written to a temporary directory and
        read back memory-mapped, so what the fit holds in its heap is one block's, not every planned layer's (a
        weight on a device, or not contiguous, stays where it is)."""
        for layer in layers:
            if layer.name not in self.plan or layer.name not in self.out:
                continue
            self._spill_out(layer)
            w = self.fitted.get(layer.name)
            if w is not None and w.device.type == "cpu" and w.is_contiguous() and w.dtype in _VIEWS:
                bits = spill_array(f"{self._base(layer)}.w.npy", w.view(_VIEWS[w.dtype]).numpy())
                self.fitted[layer.name] = torch.from_numpy(bits).view(w.dtype)

    def swapped(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` run with the weights fitted so far in place of the dense ones."""
        def call() -> object:
            with _weights(self.model, self.layers, self.fitted):
                return fn()
        return call

    def whole(self, fit: list[Batch]) -> Runs:
        """Each batch through the whole model."""
        return [(batch_mask(b), lambda b=b: run(self.model, b), self.swapped(lambda b=b: run(self.model, b)))
                for b in fit]


def _by_block(stages: list[list[Layer]], found: Blocks) -> list[int | None] | None:
    """Each stage's block (None outside the blocks), or None unless the stages run as the blocks do: the layers
    before the blocks, then the blocks' in block order, then those after."""
    where = {l.name: i for i, ls in enumerate(found.layers) for l in ls}
    out: list[int | None] = []
    for stage in stages:
        blocks = {where.get(l.name) for l in stage}
        if len(blocks) != 1:
            return None
        out.append(blocks.pop())
    inside = [b for b in out if b is not None]
    first = out.index(inside[0]) if inside else len(out)
    last = len(out) - out[::-1].index(inside[-1]) if inside else len(out)
    if inside != sorted(inside) or any(b is None for b in out[first:last]):
        return None
    return out


def _block_runs(fitter: _Fitter, blk: nn.Module, kept: list[list[tuple[tuple[object, ...], dict[str, object]]]],
                masks: list[object]) -> Runs:
    """Each batch through one block: on the dense model's inputs to it (``kept[0]``), and with the weights fitted so
    far on the fitted model's (``kept[1]``)."""
    return [(masks[j], lambda d=d: blk(*d[0], **d[1]), fitter.swapped(lambda f=f: blk(*f[0], **f[1])))
            for j, (d, f) in enumerate(zip(kept[0], kept[1]))]


def _advance(fitter: _Fitter, blk: nn.Module, kept: list[list[tuple[tuple[object, ...], dict[str, object]]]],
             dense: list[torch.Tensor]) -> None:
    """Both models' inputs to the next block: this block's outputs, ``dense`` (the dense model's, computed by the
    caller) and with the fitted weights."""
    for j, (d, f) in enumerate(zip(kept[0], kept[1])):
        kept[0][j] = with_hidden(d[0], d[1], dense[j])
        kept[1][j] = with_hidden(f[0], f[1], hidden_state(fitter.swapped(lambda f=f: blk(*f[0], **f[1]))()))


def _tail_runs(fitter: _Fitter, blocks: list[nn.Module], kept: list[list[tuple[tuple[object, ...], dict[str, object]]]],
               masks: list[object], fit: list[Batch], shape: object) -> Runs | None:
    """Each batch through the model after its blocks: every block returns the last block's output for the batch
    (the dense model's, then the fitted model's: ``kept``, the inputs the next block would read), so a stage after
    the blocks (an output head) reads its inputs without the blocks run again (two whole-model runs a batch were
    most of a 7B fit's head stage). Only where that is the model: a block's output is its hidden state alone (a
    tensor, or a tuple whose other entries are None), and the first batch's output from the tail equals the whole
    model's bit for bit (a head that reads every block's output, or something a block returns beside its hidden
    state, fails it); else None, and those stages run the whole model."""
    if not (isinstance(shape, torch.Tensor) or (isinstance(shape, tuple) and all(x is None for x in shape[1:]))):
        return None

    def tail(j: int, which: int) -> Callable[[], object]:
        args, kwargs = kept[which][j]
        h = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs["hidden_states"]
        out = h if isinstance(shape, torch.Tensor) else (h, *shape[1:])  # type: ignore[index]

        def call() -> object:
            with patched_forwards(blocks, lambda i, blk: lambda *_a, **_k: out):
                return run(fitter.model, fit[j])
        return call
    try:
        same = torch.equal(main_output(tail(0, 0)()), main_output(run(fitter.model, fit[0])))
    except Exception:  # noqa: BLE001 - a model the tail cannot run: the whole model, as before
        same = False
    return [(masks[j], tail(j, 0), fitter.swapped(tail(j, 1))) for j in range(len(fit))] if same else None


def _blockwise(fitter: _Fitter, stages: list[list[Layer]], fit: list[Batch],
               progress: Callable[[], None]) -> tuple[int, Runs | None]:
    """The stages fitted block by block (GPTQ-style: each stage runs one block per batch with the weights fitted so
    far, after one dense run of the block per batch for all its stages, not the whole model), those before the
    blocks on the whole model. Returns how many stages were fitted, fewer than all when the model's blocks cannot be
    run one after another (the rest then go through the whole model) or stages follow the blocks; and for those the
    runs of the model after its blocks (:func:`_tail_runs`), None if there are none."""
    model = fitter.model
    found = find_blocks(model, list(fitter.layers.values()))
    order = _by_block(stages, found) if found is not None else None
    if found is None or order is None or all(b is None for b in order):
        return 0, None
    blocks, first = list(found.blocks), order.index(next(b for b in order if b is not None))
    for stage in stages[:first]:
        fitter.stage(stage, fitter.whole(fit))
        progress()
    dev = model_device(model)
    try:
        kept = [first_inputs(model, blocks[0], fit, dev), fitter.swapped(
            lambda: first_inputs(model, blocks[0], fit, dev))()]
        shape = blocks[0](*kept[0][0][0], **kept[0][0][1])
        check_sequential(model, blocks, fit[0].to(dev), kept[0][0], shape)
    except NotSequential:
        return first, None
    masks = [batch_mask(b) for b in fit]
    done = first
    for i, blk in enumerate(blocks):
        mine = [l for k in range(done, len(stages)) if order[k] == i for l in stages[k]]
        read = _dense_rows(model, mine, blk, kept[0], masks) if mine else None
        rows, dense = read if read is not None else (None, None)
        del read
        while done < len(stages) and order[done] == i:
            fitter.stage(stages[done], _block_runs(fitter, blk, kept, masks), rows)
            done += 1
            progress()
        rows = None  # every stage's rows are summed
        refine = fitter.epochs > 0 and any(l.name in fitter.plan for l in mine)
        if done < len(stages) or refine:
            dense = dense if dense is not None else [hidden_state(blk(*d[0], **d[1])) for d in kept[0]]
            if refine:
                fitter.refine(blk, f"{found.path}.{i}." if found.path else f"{i}.", mine, kept[1], dense, masks)
            if done < len(stages):
                _advance(fitter, blk, kept, dense)
        fitter.spill(mine)  # the block is done: its factors and fitted weights out of the heap
    return done, (_tail_runs(fitter, blocks, kept, masks, fit, shape) if done < len(stages) else None)


@dataclass(frozen=True)
class SequentialFit:
    """What the sequential fit made: each planned layer's truncator, and each refitted dense layer's new weight
    (layer name -> the weight in its stored layout; a layer whose inputs did not move, or that no row reached, has
    none)."""

    truncators: dict[str, Truncator | Pinned | Refined]
    refitted: dict[str, torch.Tensor]
    refined: tuple[str, ...] = ()  # the planned layers whose factors the block refinement trained
    scratch: "tempfile.TemporaryDirectory[str] | None" = field(default=None, repr=False, compare=False)  # spilled


def sequential_truncators(model: nn.Module, plan: dict[str, tuple[Layer, int]],
                          batches: Calibration | list[Batch], ridge: float = RIDGE,
                          progress: Callable[[int, int], None] | None = None,
                          moments: "Mapping[str, tuple[np.ndarray, bool, int]] | None" = None,
                          refine: int = EPOCHS) -> "dict[str, Truncator | Pinned | Refined]":
    """The planned layers' truncators fitted sequentially (the module docstring): ``plan`` is Layer.name -> (layer,
    rank) (:func:`auditor.surgery.checked_plan`), ``batches`` the fit rows. Each truncator is for this plan only: a
    layer's W* depends on the ranks of the layers before it. Use them as ``reuse`` of
    :func:`auditor.calibration.apply.factorize`. ``model``'s weights are unchanged afterwards. ``moments``: per
    layer the mean output-gradient moment and whether it is carried (``fisher.MeanMoments``): those layers' W*
    truncated loss-aware (:func:`weighted_truncator`). ``refine``: see :func:`sequential_fit`."""
    return sequential_fit(model, plan, batches, ridge, progress, moments, refine=refine).truncators


def sequential_fit(model: nn.Module, plan: dict[str, tuple[Layer, int]], batches: Calibration | list[Batch],
                   ridge: float = RIDGE, progress: Callable[[int, int], None] | None = None,
                   moments: "Mapping[str, tuple[np.ndarray, bool, int]] | None" = None,
                   refit: dict[str, Layer] | None = None, refine: "int | Refinement" = EPOCHS) -> SequentialFit:
    """:func:`sequential_truncators`, and with ``refit`` (Layer.name -> layer: layers the plan keeps dense) each of
    those refitted at full rank where the fit reaches it with moved inputs: W* of the module docstring, not truncated,
    put in place for the layers after it as a fitted layer's weight is. A dense layer then absorbs part of the error
    the factorized layers before it pass on, at no parameter cost (as GPTQ's sequential mode updates the weights
    it has not yet quantized). ``refine``: the block refinement's most epochs (:mod:`.refine`; 0: the closed form
    only), or a :class:`.refine.Refinement` (its epochs and the device a block trains on); it runs where the fit goes
    block by block, each block's factors trained once its stages are fitted."""
    fit = batches.fit if isinstance(batches, Calibration) else list(batches)
    how = refine if isinstance(refine, Refinement) else Refinement(refine)
    fitter = _Fitter(model, plan, DAMP, ridge, moments, dict(refit or {}), epochs=how.epochs, device=how.device)
    if not fit:
        return SequentialFit({name: Truncator(layer, _param(model, layer), None, DAMP)
                              for name, (layer, _) in plan.items()}, {})
    with eval_mode(model), torch.no_grad():
        stages, fitter.stop = _call_order(model, list(fitter.layers.values()), fit[0])
        count = [0]

        def step() -> None:
            count[0] += 1
            if progress is not None:
                progress(count[0], len(stages))

        done, tail = _blockwise(fitter, stages, fit, step) if len(stages) > 1 else (0, None)
        for stage in stages[done:]:
            fitter.stage(stage, tail if tail is not None else fitter.whole(fit))
            step()
    out = {name: fitter.out[name] for name in plan}
    return SequentialFit(out, dict(fitter.refitted), tuple(n for n, t in out.items() if isinstance(t, Refined)),
                         fitter.scratch)


__all__ = ["PULL_ROWS", "RIDGE", "SequentialFit", "fitted_map", "fitted_truncator", "input_key", "pull",
           "refit_weight", "sequential_fit", "sequential_truncators", "weighted_truncator"]
