"""``nn.Embedding`` and ``nn.EmbeddingBag``: the table (num_embeddings, dim) as stored.

Its function matrix is W^T (dim x vocab): the inputs are one-hot rows, so X^T X is diagonal, the lookup count of
every id (kept as a vector, never V x V). Replacement (plain ``nn.Embedding`` only): Embedding(V, r) then
Linear(r, dim, bias=False)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import AuditError
from ..results import Kind, Layer
from ._weights import only_weight
from .base import Cost, Feeds, LayerKind, LayerSpec, MatrixView, Shape, StoredTransposed, fill

NAME_WORDS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings", "shared")  # weights-only guesses


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    return MatrixView(Kind.EMBEDDING, shape[0], shape[1], 1, "(num_embeddings, dim) as stored")


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    return [] if x is None else [Cost("weight", "embedding", 0, math.prod(x))]


SPEC = LayerSpec(only_weight, _view, _cost)


class EmbeddingKind(StoredTransposed, LayerKind):
    kind = Kind.EMBEDDING
    label = "Embedding"
    finds = {nn.Embedding: SPEC, nn.EmbeddingBag: LayerSpec(only_weight, _view, _cost)}
    swept = True
    gradient_sensitivity = True
    lookup_counts = True

    def function_shape(self, layer: Layer) -> tuple[int, int]:
        return layer.n, layer.m  # the map dim x vocabulary of a one-hot row, stored (vocabulary, dim)
    timed = True

    def timing_shape(self, shape: Shape, lead: Shape) -> Shape:
        """The ids: ``lead`` itself."""
        return tuple(lead)

    def timing_outputs(self, shape: Shape, layer: Layer) -> int:
        """A row of ``layer.n`` per id."""
        return math.prod(shape) * layer.n

    def guess(self, name: str, shape: Shape) -> tuple[int, int, str] | None:
        low = name.lower()
        if len(shape) != 2 or not any(w in low for w in NAME_WORDS):
            return None
        return shape[0], shape[1], "2-D tensor as stored"

    def accepts(self, mod: nn.Module) -> bool:
        return type(mod) is nn.Embedding

    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        for layer in layers:
            feed = feeds.counts(layer, layer.m)
            feeds.hook(mod, lambda m, a, feed=feed: feed.add_counts(a[0], feeds.mask()))

    def replace(self, layer, mod, r, a, b):
        assert isinstance(mod, nn.Embedding)
        if mod.max_norm is not None:
            raise AuditError(f"{layer.name} renormalises its rows (max_norm): a factorized table cannot reproduce it",
                             "Leave it out of the plan")
        kw = dict(device=mod.weight.device, dtype=mod.weight.dtype)
        first = nn.Embedding(layer.m, r, padding_idx=mod.padding_idx, scale_grad_by_freq=mod.scale_grad_by_freq,
                             sparse=mod.sparse, **kw)
        second = nn.Linear(r, layer.n, bias=False, **kw)
        if a is not None and b is not None:
            fill(first.weight, b[0].T)  # E = B^T (V x r)
            fill(second.weight, a[0])  # (dim x r)
        return nn.Sequential(first, second)


KIND = EmbeddingKind()


def embedding_sizes(model: nn.Module) -> list[int]:
    """``num_embeddings`` of every ``nn.Embedding`` and ``nn.EmbeddingBag`` of ``model``, in module order."""
    return [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
