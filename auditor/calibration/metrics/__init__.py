"""Metrics: one module per kind of metric, each holding everything about it (see :class:`MetricKind`), and the
registry the rest of the auditor asks. A new metric is one :class:`MetricKind` subclass handed to :func:`register`
(docs/design.md, "Adding a metric").

Built in: ``output`` (the relative output error), ``perplexity`` (its relative increase), ``kl`` (next-token KL),
``masked`` (the masked-token perplexity's relative increase), ``pooled`` (a sentence encoder's pooled-embedding
cosine distance) and ``user`` (a function ``fn(model, batches)``)."""

from __future__ import annotations

from . import kl, masked, output, perplexity, pooled, user
from .base import Evaluating, Measurement, MetricKind, RowScorer, Scorer
from .common import main_output
from .registry import for_kind, for_name, kinds, names, register, unregister

for _k in (output.KIND, perplexity.KIND, kl.KIND, masked.KIND, pooled.KIND, user.KIND):
    register(_k)

__all__ = ["Evaluating", "Measurement", "MetricKind", "RowScorer", "Scorer", "for_kind", "for_name", "kinds", "main_output", "names",
           "register", "unregister"]
