"""What every metric reads from a forward: the tensor it compares, the real positions of a batch, and the targets of
token metrics (next-token and masked-token)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...errors import AuditError
from ..data.inputs import IGNORE_INDEX as IGNORE
from ..data.inputs import Batch
from ..data.inputs import main_output as main_output  # the tensor a metric compares (its home: the load reads it too)
from .chunks import Scored


def row_mask(b: Batch) -> torch.Tensor | None:
    """The real positions of a batch: ``attention_mask`` != 0 when it is 2-D (batch, positions); None when there is
    no such mask or it keeps every position."""
    m = b.kwargs.get("attention_mask")
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        return None
    keep = m != 0
    return None if bool(keep.all()) else keep


def real_rows(y: torch.Tensor, b: Batch) -> torch.Tensor:
    """The output at the real positions only (rows with ``attention_mask`` 0 left out) when it is (batch,
    positions, features) under the mask; the whole output otherwise."""
    keep = row_mask(b)
    if keep is None or y.dim() != 3 or tuple(y.shape[:2]) != tuple(keep.shape):
        return y
    return y[keep]


def next_token_targets(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token targets, which of them count) of a batch: the ids (or ``labels``) shifted by one, counted where
    the target is real and not -100, and the position predicting it real too."""
    ids = b.kwargs.get("labels")
    if not isinstance(ids, torch.Tensor):
        ids = b.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise AuditError("a next-token metric needs 2-D integer token ids (input_ids) in every held-out batch",
                         "Give input_ids (batch, positions), or use --metric output-error")
    tgt = ids[:, 1:].long()
    keep = tgt != -100
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        keep = keep & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    return tgt.clamp_min(0), keep


def next_token_scored(y: torch.Tensor, b: Batch) -> Scored:
    """The counted positions of ``y`` (each predicting the next token) and their targets, read a chunk at a time
    (:class:`~.chunks.Scored`)."""
    tgt, keep = next_token_targets(b)
    if y.dim() != 3 or y.shape[:2] != (tgt.shape[0], tgt.shape[1] + 1):
        raise AuditError(f"a next-token metric needs logits (batch, positions, vocab) for the input ids "
                         f"{tuple(tgt.shape[0:1]) + (tgt.shape[1] + 1,)}; the model returned {tuple(y.shape)}",
                         "Use --metric output-error, or a user metric, for this model")
    return Scored.of(y, keep, tgt)  # keep is (rows, positions - 1): the last position predicts nothing


def check_targets(b: Batch, width: int, what: str, i: int | None = None) -> None:
    """The ids (or ``labels``) a token metric scores must index the model's ``width`` logits
    (:func:`~auditor.calibration.data.inputs.token_value_problem`, the loader's own validator): one line naming the value
    and where, else."""
    from ..data.inputs import token_value_problem

    labels = isinstance(b.kwargs.get("labels"), torch.Tensor)
    name = "labels" if labels else "input_ids"
    t = b.kwargs.get(name)
    if not isinstance(t, torch.Tensor):
        t = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
        name = "input ids"
    if not isinstance(t, torch.Tensor):
        return
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == t.shape:  # padding is not scored
        t = torch.where(mask != 0, t, torch.full_like(t, IGNORE if labels else 0))
    problem = token_value_problem(t, width, labels=labels)
    if problem:
        batch = f"held-out batch {i}" if i is not None else "a held-out batch"
        raise AuditError(f"calibration {name} in {batch} {problem.replace('the vocabulary', 'the logits')}: the "
                         f"{what} metric scores them against the model's {width} logits",
                         "Give ids the model's output covers (tokenize with its own tokenizer), or use --metric "
                         "output-error")


def masked_targets(b: Batch) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(targets, which of them count, whether they came from ``labels``) of a masked-LM batch: ``labels`` where
    they are not -100, else every input id; positions with ``attention_mask`` 0 never count."""
    ids = b.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((a for a in b.args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise AuditError("a masked-token metric needs 2-D integer token ids (input_ids) in every held-out batch",
                         "Give input_ids (batch, positions), or use --metric output-error")
    labels = b.kwargs.get("labels")
    given = isinstance(labels, torch.Tensor)
    if given and (labels.shape != ids.shape or labels.is_floating_point()):
        raise AuditError(f"a masked-token metric needs integer labels shaped like input_ids {tuple(ids.shape)}; "
                         f"a held-out batch has {labels.dtype} labels {tuple(labels.shape)}",
                         "Give labels (batch, positions): the original id at masked positions, -100 elsewhere")
    tgt = (labels if given else ids).long()
    keep = tgt != -100
    mask = b.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        keep = keep & (mask != 0)
    return tgt.clamp_min(0), keep, given


def masked_scored(y: torch.Tensor, b: Batch) -> Scored:
    """The masked positions of ``y`` and their targets, read a chunk at a time (:class:`~.chunks.Scored`)."""
    tgt, keep, _ = masked_targets(b)
    if y.dim() != 3 or tuple(y.shape[:2]) != tuple(tgt.shape):
        raise AuditError(f"a masked-token metric needs logits (batch, positions, vocab) for the input ids "
                         f"{tuple(tgt.shape)}; the model returned {tuple(y.shape)}",
                         "Use --metric output-error, or a user metric, for this model")
    return Scored.of(y, keep, tgt)


def kept_row_sums(values: torch.Tensor, keep: torch.Tensor) -> np.ndarray:
    """Per row (``keep``: rows x positions) the float64 sum of ``values``, one per kept position in row-major order
    (a :class:`~.chunks.Scored`'s), the positions not kept adding 0."""
    full = torch.zeros(keep.shape, dtype=torch.float64, device=keep.device)
    full[keep] = values.double()
    return full.sum(1).cpu().numpy()


def per_row(y: torch.Tensor, b: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-row sums of fn(y) over every dimension but the first, positions with ``attention_mask`` 0 left out."""
    v = fn(y)
    keep = row_mask(b)
    if keep is not None and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(keep.shape):
        v = v * keep.reshape(*keep.shape, *([1] * (v.dim() - 2))).to(v.dtype)
    return v.reshape(v.shape[0], -1).sum(1)
