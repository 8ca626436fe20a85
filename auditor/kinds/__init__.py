"""Layer kinds: one module per kind, each holding everything about it (see :class:`LayerKind`), and the registry
that every other part of the auditor asks. A new kind is one :class:`LayerKind` subclass handed to
:func:`register` (docs/design.md, "Adding a layer kind").

Built in: ``linear`` (nn.Linear), ``hf_conv1d`` (transformers' Conv1D), ``conv`` and ``conv_transpose``
(nn.Conv1d/2d/3d and the transposed ones), ``embedding`` (nn.Embedding, nn.EmbeddingBag), ``rnn`` (LSTM, GRU,
RNN), ``mha_in_proj`` (nn.MultiheadAttention's input projections), ``matmul`` (a graph's x @ W, and module types
registered with ``register_layer_spec``) and ``tensor`` (a weights-only checkpoint's 2-D tensors)."""

from __future__ import annotations

from . import conv, embedding, hf_conv1d, linear, matmul, mha, registry, rnn
from .base import Cost, Feed, Feeds, LayerKind, LayerSpec, MatrixView, Shape, fill
from .embedding import embedding_sizes
from .registry import (for_kind, for_module, for_type, guess, is_known, is_user_leaf, kinds, register,
                       rewritable_labels, spec_for_type, spec_types, unregister)

# The catch-alls first: a weights-only guess asks the latest registered kind first. The factorizable kinds in the
# order factorize's refusal names them.
for _k in (matmul.TENSOR, matmul.MATMUL, linear.KIND, hf_conv1d.KIND, conv.KIND, conv.TRANSPOSE, embedding.KIND,
           rnn.KIND, mha.KIND):
    register(_k, builtin=True)
registry.when_imported(hf_conv1d._register)

__all__ = ["Cost", "Feed", "Feeds", "LayerKind", "LayerSpec", "MatrixView", "Shape", "embedding_sizes", "fill",
           "for_kind", "for_module", "for_type", "guess", "is_known", "is_user_leaf", "kinds", "register",
           "rewritable_labels", "spec_for_type", "spec_types", "unregister"]
