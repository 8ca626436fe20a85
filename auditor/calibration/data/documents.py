"""Which calibration rows belong together: documents, so that whole documents are held out and resampled.

A calibration says it in one of three ways:

- a directory of text files: each file (:func:`~auditor.calibration.data.text.is_text_file`, in name order, not
  recursing) is one document, tokenized and windowed on its own (no window spans two files);
- a text file and a separator the user names (``--document-separator``, e.g. ``"\\n\\n\\n"``): each piece between
  separators (whitespace-only pieces dropped) is one document, windowed on its own;
- a ``document`` tensor beside the inputs in a safetensors or ``.pt`` file: one integer id per row, each document's
  rows contiguous. It is read here and never given to the forward.

The fit and held-out parts are then cut on a document boundary (:func:`document_cut`), and so are the held-out rows'
search and verification parts; the verification resamples whole documents (:mod:`auditor.calibration.measure.verify`).

>>> document_cut([0, 0, 1, 1, 1, 2, 3, 3], 0.25)
6
>>> runs([5, 5, 9, 9, 9, 2])
[0, 0, 1, 1, 1, 2]
"""

from __future__ import annotations

import torch

from ...errors import AuditError

DOCUMENT_KEY = "document"  # the tensor beside the inputs that names each row's document
DOCUMENT_FIX = "Give the document tensor one integer id per row, each document's rows together"


def runs(ids: "list[int] | torch.Tensor") -> list[int]:
    """The ids renumbered 0, 1, ... by run (a new document wherever the id changes)."""
    out: list[int] = []
    prev = object()
    for x in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
        if x != prev:
            out.append(out[-1] + 1 if out else 0)
            prev = x
        else:
            out.append(out[-1])
    return out


def pop_documents(named: dict[str, torch.Tensor], where: str) -> list[int] | None:
    """The ``document`` tensor taken out of ``named`` and checked (a 1-D integer tensor, one id per row, each
    document's rows contiguous, two documents or more), as run numbers; None when there is none."""
    t = named.pop(DOCUMENT_KEY, None)
    if t is None:
        return None
    rows = {int(v.shape[0]) for v in named.values() if v.dim() > 0}
    if t.dtype in (torch.bool,) or t.dtype.is_floating_point or t.dtype.is_complex:
        raise AuditError(f"the document tensor in {where} is {str(t.dtype).removeprefix('torch.')}, not integer ids",
                         DOCUMENT_FIX + " (e.g. torch.int64)")
    if t.dim() != 1 or (rows and int(t.shape[0]) not in rows):
        shape = "x".join(str(s) for s in t.shape) or "a scalar"
        want = f"{next(iter(rows)):,} rows" if len(rows) == 1 else "the inputs' rows"
        raise AuditError(f"the document tensor in {where} has shape {shape}, not one id for each of {want}",
                         DOCUMENT_FIX)
    ids = [int(x) for x in t.tolist()]
    numbered = runs(ids) or [0]
    if len(set(ids)) < numbered[-1] + 1:
        raise AuditError(f"the document tensor in {where} gives some document's rows in two or more places",
                         "Sort the rows by document, so that each document's rows are together")
    if numbered[-1] < 1:
        raise AuditError(f"the document tensor in {where} names one document only, so none can be held out whole",
                         "Give two or more documents, or drop the document tensor (blocks of rows are resampled)")
    return numbered


def document_cut(ids: list[int], share: float) -> int:
    """The row where the last ``share`` of the rows begins, moved to the nearest document boundary that leaves a
    whole document on each side (the earlier boundary on a tie); 0 when ``share`` is 0 or there is one document."""
    n = len(ids)
    if share <= 0 or n < 2:
        return n if share <= 0 else 0
    bounds = [i for i in range(1, n) if ids[i] != ids[i - 1]]
    if not bounds:
        return 0
    target = n - share * n
    return min(bounds, key=lambda b: (abs(b - target), b))


def split_text(text: str, separator: str, where: str) -> list[str]:
    """The documents of one text: the pieces between separators, whitespace-only ones dropped; one-line errors for
    an empty separator, one that never occurs, and a text that gives one document only."""
    if not separator:
        raise AuditError("the document separator is empty", 'Give the text between documents, e.g. '
                         '--document-separator "\\n\\n\\n"')
    if separator not in text:
        raise AuditError(f"calibration text {where} never contains the document separator {separator!r}",
                         "Give the text that stands between its documents, or drop --document-separator")
    pieces = [p for p in text.split(separator) if p.strip()]
    if len(pieces) < 2:
        raise AuditError(f"calibration text {where} gives one document only between the separators {separator!r}",
                         "Give a text of two or more documents, or drop --document-separator")
    return pieces


__all__ = ["DOCUMENT_KEY", "document_cut", "pop_documents", "runs", "split_text"]
