"""What one layer kind is: the records the module walk reads (:class:`LayerSpec`, :class:`MatrixView`,
:class:`Cost`), the interface the calibration layer drives statistics through (:class:`Feeds`, :class:`Feed`),
and :class:`LayerKind`, the object that holds everything about a kind. A kind module subclasses
:class:`LayerKind` and hands an instance to :func:`auditor.kinds.register`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import numpy as np
import torch
from torch import nn

from ..results import Kind, Layer

Shape = tuple[int, ...]


@dataclass(frozen=True)
class MatrixView:
    """How one stored weight is read as ``groups`` matrices of ``m`` x ``n``; ``view`` says it in words."""

    kind: Kind | str
    m: int
    n: int
    groups: int = 1
    view: str = "(out, in) as stored"


@dataclass(frozen=True)
class Cost:
    """What one call of a module costs for one of its weights (``param`` is the name local to the module)."""

    param: str
    op: str
    macs: int = 0  # multiply-accumulates by the weight
    lookups: int = 0  # rows gathered (embeddings)


def _getattr_weight(mod: nn.Module, name: str) -> torch.Tensor | None:
    return getattr(mod, name, None)


@dataclass(frozen=True)
class LayerSpec:
    """How the auditor reads one module type.

    ``weights(mod)``: local names of the factorizable weights the module owns (attributes, possibly computed).
    ``view(mod, name, shape)``: the matrix view of one of them, from its stored shape.
    ``cost(mod, ins, out)``: the :class:`Cost` of one call for each weight, from the call's input shapes (None
    where unknown) and output shape; a weight read by the call but not costed here gets no use.
    ``tensor(mod, name)``: the weight itself (default ``getattr(mod, name)``; quantized modules call ``weight()``).
    """

    weights: Callable[[nn.Module], Iterable[str]]
    view: Callable[[nn.Module, str, Shape], MatrixView]
    cost: Callable[[nn.Module, list[Shape | None], Shape | None], list[Cost]]
    tensor: Callable[[nn.Module, str], torch.Tensor | None] = _getattr_weight


class Feed(Protocol):
    """One layer's accumulator of input statistics (made by :meth:`Feeds.rows` or :meth:`Feeds.counts`)."""

    n: int
    rows: int
    approximate: str  # why the layer-output error is an estimate for this layer; empty when exact

    def add_rows(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Rows of X: (rows, groups * n), or (batch, positions, ...) with ``keep`` the real positions."""

    def add_counts(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Ids looked up (one-hot rows: X^T X is the diagonal of lookup counts)."""


class Feeds(Protocol):
    """What the calibration layer hands a kind to read its layers' inputs: accumulators, the current batch's real
    positions, forward pre-hooks (removed by the calibration layer), and a way to say why a layer gets none."""

    def rows(self, layer: Layer, n: int, groups: int = 1, shared: bool = False) -> Feed:
        """An accumulator of X^T X, (groups, n, n); ``shared``: inputs read by several layers are multiplied once."""

    def counts(self, layer: Layer, n: int) -> Feed:
        """An accumulator of lookup counts (n,)."""

    def mask(self) -> torch.Tensor | None:
        """The current batch's real positions (batch, positions), or None for every row."""

    def hook(self, mod: nn.Module, fn: Callable[..., None], with_kwargs: bool = False) -> None:
        """Register a forward pre-hook on ``mod`` for the duration of the statistics pass."""

    def missing(self, layer: Layer, reason: str) -> None:
        """The layer gets no statistics, and why."""


def fill(p: torch.Tensor, x: np.ndarray) -> None:
    """Copy a NumPy factor into a new module's parameter (reshaped to it)."""
    with torch.no_grad():
        p.copy_(torch.from_numpy(np.ascontiguousarray(x)).reshape(p.shape))


class LayerKind:
    """Everything about one kind of layer. Override what differs from a plain (out, in) matrix.

    - ``kind``: the value layer records carry in ``Layer.kind`` (a :class:`Kind`, or a new name of your own);
    - ``finds``: module type -> :class:`LayerSpec`, how the kind is found in a module tree, viewed and costed
      (subclasses included; a type registered by a user is a leaf for ``torch.fx``);
    - :meth:`guess`: whether a tensor of a weights-only checkpoint is of this kind, from its name and shape;
    - :meth:`matrices`: the stored tensor as (groups, m, n) for spectra;
    - :meth:`statistics`: attach the input-statistics hooks for the kind's layers of one module;
    - :meth:`function_matrices` / :meth:`stored`: the map y = F x as (groups, out, in), and back to the stored layout;
    - ``swept``: whether tier 2 measures a floor by truncating it;
    - ``gradient_sensitivity``: whether the output-gradient sensitivity (calibration/tiers/fisher.py) reads its
      output's gradient (:meth:`function_view` carries it back); ``lookup_counts``: its input statistics are counts
      of the ids looked up (a diagonal Gram), not X^T X; ``cut_to_rank1``: a user metric's check cuts its modules'
      weights to rank 1 (a model cut down must score lower);
    - ``timed`` and :meth:`timing_shape`: whether ``--measure-speed`` times its module alone (called with one input
      tensor), and that input's shape at another batch;
    - :meth:`replace`: the two-module replacement at rank r (``factorize``), or ``cannot_factorize``: why no plan
      can rewrite it, which also keeps it out of the suggestions and the sweeps.
    """

    kind: Kind | str = ""
    label: str = ""  # how factorize's refusal names it among what it rewrites ("Linear"); "" if it rewrites none
    finds: dict[type, LayerSpec] = {}
    swept: bool = False
    cannot_factorize: str = ""
    linear_chain: bool = False  # a linear map two of which in a row multiply out to one (graph's chain check)
    gradient_sensitivity: bool = False  # the gradient pass reads its output's gradient (calibration's fisher.py)
    lookup_counts: bool = False  # its input statistics count the ids looked up (a diagonal Gram)
    cut_to_rank1: bool = False  # a user metric's check cuts its modules' weights to rank 1 (calibration's metrics)
    timed: bool = False  # --measure-speed times its module alone, called with one input tensor

    # -- finding it
    def guess(self, name: str, shape: Shape) -> tuple[int, int, str] | None:
        """(m, n, view) when a tensor of a weights-only checkpoint (no modules) is read as this kind, else None."""
        return None

    def module_path(self, layer: Layer) -> tuple[str, str]:
        """(owning module path, the weight's attribute name)."""
        return layer.name, "weight"

    def graph_site(self, layer: Layer) -> str:
        """The graph node a weight is used at when the model is walked without inputs."""
        return layer.name

    def accepts(self, mod: nn.Module) -> bool:
        """Whether ``mod`` is a module this kind reads statistics of and rewrites (not merely finds)."""
        return isinstance(mod, tuple(self.finds)) if self.finds else False

    # -- its matrices
    def matrices(self, t: torch.Tensor, groups: int, m: int, n: int) -> torch.Tensor:
        """The stored tensor as ``groups`` matrices of m x n (singular values do not depend on transposition)."""
        return t.reshape(groups, m, n)

    def function_matrices(self, layer: Layer, w: torch.Tensor) -> np.ndarray:
        """The layer's map as (groups, out, in) float64 (``w`` is the weight in float64 on the CPU)."""
        return w.reshape(layer.groups, layer.m, layer.n).numpy()

    def stored(self, layer: Layer, f: torch.Tensor) -> torch.Tensor:
        """Function matrices (groups, out, in) back in the stored layout (reshaped to the weight's shape after)."""
        return f

    def function_shape(self, layer: Layer) -> tuple[int, int]:
        """(out, in) of one of the layer's function matrices."""
        return layer.m, layer.n

    def function_view(self, layer: Layer, weight: torch.Tensor) -> torch.Tensor:
        """F (out x in) as a view of the stored weight (ungrouped), for carrying an output gradient back: g @ F."""
        return weight
    def timing_shape(self, shape: Shape, lead: Shape) -> Shape:
        """The shape of a timed module's input like one of ``shape`` at the batch (x positions) ``lead``: the
        leading dims become ``lead``, the features stay (a linear map's; overridden where the input differs)."""
        return (*lead, shape[-1])

    def timing_outputs(self, shape: Shape, layer: Layer) -> int:
        """The elements of one output of the timed module for an input of ``shape`` (the memory a timing at
        ``--latency-shape`` holds): a row of ``layer.m`` per input row of a linear map."""
        return math.prod(shape) // max(int(shape[-1]), 1) * layer.m

    # -- its input statistics
    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        """Attach what reads the inputs of ``layers`` (this kind's layers owned by ``mod`` at ``path``)."""
        for layer in layers:
            feeds.missing(layer, f"no input statistics for {layer.module_type} ({layer.kind})")

    # -- its replacement
    @property
    def factorizable(self) -> bool:
        return not self.cannot_factorize and type(self).replace is not LayerKind.replace

    def replace(self, layer: Layer, mod: nn.Module, r: int, a: np.ndarray | None,
                b: np.ndarray | None) -> nn.Module:
        """The two-module replacement of ``mod`` at rank r; factors a (g, out, r), b (g, r, in) when given."""
        raise NotImplementedError(f"no two-module replacement for {self.kind} layers")

    def __repr__(self) -> str:
        return f"<layer kind {self.kind}>"


class NamedByParameter:
    """Mixin for a kind whose layers are named after their parameter (``lstm.weight_ih_l0``, ``attn.in_proj_weight``):
    the owning module is the name's prefix."""

    def module_path(self, layer: Layer) -> tuple[str, str]:
        path, _, attr = layer.name.rpartition(".")
        return path, attr


class StoredTransposed:
    """Mixin for a kind that stores its map transposed, (in, out): an Embedding's (V, H) table is the map H x V of a
    one-hot row, transformers' Conv1D keeps (in, out)."""

    def function_matrices(self, layer: Layer, w: torch.Tensor) -> np.ndarray:
        return w.T.contiguous().numpy()[None]

    def stored(self, layer: Layer, f: torch.Tensor) -> torch.Tensor:
        return f[0].T

    def function_view(self, layer: Layer, weight: torch.Tensor) -> torch.Tensor:
        return weight.t()


def rows_hook(feed: Feed, feeds: Feeds) -> Callable[..., None]:
    """A pre-hook feeding the module's first input as rows, at the batch's real positions."""
    return lambda m, a: feed.add_rows(a[0], feeds.mask())


__all__ = ["Cost", "Feed", "Feeds", "LayerKind", "LayerSpec", "MatrixView", "Shape", "fill", "rows_hook"]
