"""Factors fitted to the model they will live in: the sequential, output-anchored fit.

The independent fit (:class:`.whiten.Truncator`) truncates each layer under the dense model's inputs X. In the
factorized model a layer reads X^, what the factorized layers before it produce. Here the planned layers are fitted
in the order the model calls them: each one on the inputs X^ that the layers fitted before it give, anchored to the
dense layer's outputs on the dense inputs, X W^T. Per group, with C = X^T X^ (the cross term), G = X^^T X^ and
mu = RIDGE * mean(diag G):

    W* = W (C + mu I) (G + mu I)^-1

minimises ||X W^T - X^ M^T||^2 + mu ||M - W||^2: a least-squares refit, pulled toward the dense weight (so it is W
exactly when X^ = X). The rank-r fit is then the whitened truncation of W* under G (S S^T = G + lambda I, lambda the
whitening's own damping, DAMP * mean(diag G)): the rank-r map closest to W* on the shifted inputs. With X^ = X both
steps reduce to the independent fit. Why the pull (RIDGE = 1e-2, not the whitening's 1e-6): the refit estimates a
full in x in map from the fit rows, and with few rows per input dimension (the digits MLP: 1,000 rows for 512 inputs)
it fits their noise; measured in docs/calibration.md ("The sequential fit").

Stages: the planned layers in call order, those reading one input tensor (q, k, v) fitted together. Each stage is
one pass over the fit rows, running every batch twice (the dense weights, then the weights fitted so far put in
place of the dense ones: a rank-r weight computes what its two factors compute), with hooks that read each layer's
rows as the statistics do (the kinds' own feeds) and add the float64 sums C and G. Only one stage's sums and one
batch's rows are alive at once; the model's weights are put back afterwards. Embeddings (lookup counts) read ids,
which no factorized layer changes: they get the independent fit on their counts. A planned layer the calibration
never reaches gets the plain SVD, as in the independent fit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from ... import kinds
from ...results import Layer
from ..data.inputs import Batch, Calibration, eval_mode, run
from .stats import LayerInput, _batch_mask, _real_rows
from .whiten import DAMP, Truncator


RIDGE = 1e-2  # mu = RIDGE * mean(diag G): the refit's pull toward the dense weight


def fitted_map(f: np.ndarray, cross: np.ndarray, gram: np.ndarray, ridge: float = RIDGE) -> tuple[np.ndarray, float]:
    """W* = F (C + mu I)(G + mu I)^-1 for one group (F out x in, C = X^T X^, G = X^^T X^, both in x in), and
    mu = ``ridge`` * mean(diag G) (``ridge`` where that is 0)."""
    n = gram.shape[0]
    scale = float(np.mean(np.diagonal(gram))) if n else 0.0
    lam = ridge * scale if scale > 0 else ridge
    eye = np.eye(n)
    g = (gram + gram.T) / 2 + lam * eye
    rhs = (cross.T + lam * eye) @ f.T  # (G + lambda I) W*^T = (C^T + lambda I) W^T
    return np.linalg.solve(g, rhs).T, lam


def fitted_truncator(layer: Layer, weight: torch.Tensor, cross: np.ndarray, gram: np.ndarray,
                     damp: float = DAMP, ridge: float = RIDGE) -> Truncator:
    """The truncator of ``layer`` fitted on shifted inputs: W* (:func:`fitted_map`, ``ridge``) per group, decomposed
    under the shifted inputs' Gram (damped by ``damp``). ``cross`` and ``gram``: (groups, n, n) float64."""
    from .whiten import function_matrices

    f = function_matrices(layer, weight)
    fstar = np.stack([fitted_map(f[g], cross[g], gram[g], ridge)[0] for g in range(f.shape[0])])
    rows = LayerInput(layer.name, str(layer.kind), gram, 0, gram.shape[-1], gram.shape[0])
    return Truncator.of_function(layer, weight, fstar, rows, damp)


class _Rows:
    """One layer's rows for the current batch (what the kinds' hooks feed), kept until the stage adds them."""

    def __init__(self, n: int, groups: int = 1, diagonal: bool = False) -> None:
        self.n, self.groups, self.diagonal = n, groups, diagonal
        self.x: list[torch.Tensor] = []
        self.counts: np.ndarray | None = None

    def add_rows(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        x = _real_rows(x, keep)
        self.x.append(x.detach().reshape(-1, self.groups, self.n).to(torch.float64))

    def add_counts(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        if keep is not None and ids.dim() == keep.dim() and ids.shape[0] == 1 and ids.shape[1:] == keep.shape[1:]:
            ids = ids.expand(keep.shape)
        ids = _real_rows(ids, keep, 0)
        c = torch.bincount(ids.detach().reshape(-1).long(), minlength=self.n).to(torch.float64)[: self.n].numpy()
        self.counts = c if self.counts is None else self.counts + c

    def take(self) -> torch.Tensor | None:
        x = torch.cat(self.x) if self.x else None
        self.x = []
        return x


class _RowFeeds:
    """The :class:`auditor.kinds.Feeds` of a stage: the kinds attach their usual hooks, which fill :class:`_Rows`."""

    def __init__(self) -> None:
        self.feeds: dict[str, _Rows] = {}
        self.handles: list[object] = []
        self.current: list[torch.Tensor | None] = [None]
        self.missing_: dict[str, str] = {}

    def rows(self, layer: Layer, n: int, groups: int = 1, shared: bool = False) -> _Rows:
        return self.feeds.setdefault(layer.name, _Rows(n, groups))

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
def _row_hooks(model: nn.Module, layers: list[Layer]) -> Iterator[_RowFeeds]:
    """The kinds' input hooks of ``layers`` on ``model``, feeding :class:`_Rows`; removed afterwards."""
    feeds = _RowFeeds()
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
    """One stage's float64 sums per layer: C = X^T X^, G = X^^T X^ (groups, n, n); counts for lookups."""

    cross: dict[str, np.ndarray] = field(default_factory=dict)
    gram: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, x: torch.Tensor, xh: torch.Tensor) -> None:
        if x.shape != xh.shape:
            raise ValueError(f"{name}: the dense and the factorized model gave it {tuple(x.shape)} and "
                             f"{tuple(xh.shape)} rows")
        c = torch.einsum("rgi,rgj->gij", x, xh).numpy()
        g = torch.einsum("rgi,rgj->gij", xh, xh).numpy()
        self.cross[name] = self.cross[name] + c if name in self.cross else c
        self.gram[name] = self.gram[name] + g if name in self.gram else g
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]


def _call_order(model: nn.Module, layers: list[Layer], batch: Batch) -> list[list[Layer]]:
    """The planned layers in the order the model first reads them on ``batch``, those reading one input tensor (by
    storage, shape and strides) together: the stages. Layers never called come last, each alone."""
    seen: dict[str, tuple[int, tuple[object, ...]]] = {}
    alive: list[object] = []  # the inputs held until the pass ends, so no other tensor reuses their memory

    def note(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0] if args else None
            key = (x.data_ptr(), tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else (name,)
            seen.setdefault(name, (len(seen), key))
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
    return stages + [[l] for l in layers if l.name not in seen]


def _stage_sums(model: nn.Module, stage: list[Layer], fit: list[Batch], fitted: dict[str, torch.Tensor],
                layers: dict[str, Layer]) -> _Sums:
    """One pass over ``fit``: each batch through the dense model, then through the model with the ``fitted``
    weights, the stage's rows of both added into its sums."""
    sums = _Sums()
    with _row_hooks(model, stage) as feeds:
        for b in fit:
            feeds.current[0] = _batch_mask(b)
            run(model, b)
            dense = {name: r.take() for name, r in feeds.feeds.items()}
            with _weights(model, layers, fitted):
                run(model, b)
            for name, r in feeds.feeds.items():
                xh = r.take()
                if r.diagonal:
                    continue
                if dense[name] is not None and xh is not None:
                    sums.add(name, dense[name], xh)
        for name, r in feeds.feeds.items():
            if r.diagonal and r.counts is not None:
                sums.counts[name] = r.counts / 2  # each batch counted by both runs: the same ids
    return sums


def _stage_truncators(model: nn.Module, stage: list[Layer], sums: _Sums, damp: float,
                      ridge: float) -> dict[str, Truncator]:
    """The stage's truncators from its sums: the fitted map where the rows were read, the independent fit on the
    counts of a lookup, the plain SVD where the calibration never reached the layer."""
    out: dict[str, Truncator] = {}
    for layer in stage:
        weight = _param(model, layer)
        if layer.name in sums.gram:
            out[layer.name] = fitted_truncator(layer, weight, sums.cross[layer.name], sums.gram[layer.name], damp,
                                               ridge)
        elif layer.name in sums.counts:
            c = sums.counts[layer.name]
            inp = LayerInput(layer.name, str(layer.kind), c, int(c.sum()), c.shape[0], diagonal=True)
            out[layer.name] = Truncator(layer, weight, inp, damp)
        else:
            out[layer.name] = Truncator(layer, weight, None, damp)
    return out


def sequential_truncators(model: nn.Module, plan: dict[str, tuple[Layer, int]],
                          batches: Calibration | list[Batch], damp: float = DAMP, ridge: float = RIDGE,
                          progress: Callable[[int, int], None] | None = None) -> dict[str, Truncator]:
    """The planned layers' truncators fitted sequentially (the module docstring): ``plan`` is Layer.name -> (layer,
    rank) (:func:`auditor.surgery.checked_plan`), ``batches`` the fit rows. Each truncator is for this plan only: a
    layer's W* depends on the ranks of the layers before it. Use them as ``reuse`` of
    :func:`auditor.calibration.apply.factorize`. ``model``'s weights are unchanged afterwards."""
    fit = batches.fit if isinstance(batches, Calibration) else list(batches)
    layers = {name: layer for name, (layer, _) in plan.items()}
    out: dict[str, Truncator] = {}
    if not fit:
        return {name: Truncator(layer, _param(model, layer), None, damp) for name, layer in layers.items()}
    fitted: dict[str, torch.Tensor] = {}
    with eval_mode(model), torch.no_grad():
        stages = _call_order(model, list(layers.values()), fit[0])
        for i, stage in enumerate(stages):
            sums = _stage_sums(model, stage, fit, fitted, layers)
            for name, trunc in _stage_truncators(model, stage, sums, damp, ridge).items():
                out[name] = trunc
                fitted[name] = trunc.weight(plan[name][1])
            del sums
            if progress is not None:
                progress(i + 1, len(stages))
    return {name: out[name] for name in plan}


__all__ = ["RIDGE", "fitted_map", "fitted_truncator", "sequential_truncators"]
