"""Calibration inputs: load them, check them, split off a held-out part.

A source is a safetensors (or weights-only ``.pt``) file of named tensors batched along dim 0 that match the forward's
keyword inputs (``input_ids``, ``attention_mask``, ...) or one positional input; ``file.py:fn`` / ``module:fn``
returning an iterable of batches (a tensor, a tuple of positional inputs, or a dict of keyword inputs); a text file,
tokenized with the model's tokenizer and cut into windows (:mod:`auditor.calibration.text`); or, from the API, such an
iterable itself. The held-out part (the last ``holdout`` share of the rows or batches) is used only to
measure, never to compute input statistics.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AuditError, first_line
from .text import is_text_source, text_inputs


@dataclass
class Batch:
    """One forward call: positional and keyword inputs."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"arg{i}", a) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        out += [(k, v) for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)]
        return out

    def to(self, device: torch.device) -> "Batch":
        def mv(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

        return Batch(tuple(mv(a) for a in self.args), {k: mv(v) for k, v in self.kwargs.items()})

    @property
    def rows(self) -> int:
        ts = self.tensors()
        return int(ts[0][1].shape[0]) if ts and ts[0][1].dim() > 0 else 1


@dataclass
class Calibration:
    """Calibration batches: ``fit`` for input statistics and initialisation, ``holdout`` only for measuring."""

    fit: list[Batch]
    holdout: list[Batch]
    source: str = "<batches>"
    digest: str = ""  # sha256 of the names, shapes, dtypes and bytes of every tensor: a cache key
    warnings: list[str] = field(default_factory=list)
    tokenized: str = ""  # for a text file: the tokenizer, token count and windows (text.TextInputs.description)

    @property
    def fit_rows(self) -> int:
        return sum(b.rows for b in self.fit)

    @property
    def holdout_rows(self) -> int:
        return sum(b.rows for b in self.holdout)

    @property
    def measure(self) -> list[Batch]:
        """The batches metrics are measured on: the held-out part, or the fit part when nothing is held out."""
        return self.holdout or self.fit


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def run(model: nn.Module, batch: Batch) -> Any:
    """The model's output for one batch, moved to the model's device, without gradients."""
    b = batch.to(model_device(model))
    with torch.no_grad():
        return model(*b.args, **b.kwargs)


def _digest(batches: list[Batch]) -> str:
    h = hashlib.sha256()
    for b in batches:
        for name, t in b.tensors():
            c = t.detach().contiguous().cpu()
            h.update(f"{name}:{tuple(c.shape)}:{c.dtype};".encode())
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise AuditError(f"calibration file {path} does not exist", "Check the path given to --calibration")
    if path.stat().st_size == 0:
        raise AuditError(f"calibration file {path} is empty", "Save the inputs with safetensors.torch.save_file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
            raise AuditError(f"cannot read calibration file {path}: {first_line(exc)}",
                             "Save the inputs with safetensors.torch.save_file") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - refused pickles and truncated files alike
        raise AuditError(f"cannot read calibration file {path} as weights-only torch data: {first_line(exc)[:160]}",
                         "Save a dict of tensors (torch.save({'input_ids': ids}, f)) or use safetensors") from None
    if isinstance(obj, torch.Tensor):
        obj = {"input": obj}
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise AuditError(f"calibration file {path} does not hold named tensors",
                         "Save a dict of tensors batched along dim 0, e.g. {'input_ids': ids}")
    return obj


def _forward_names(model: nn.Module | None) -> tuple[set[str], bool]:
    """Keyword names the forward accepts, and whether it takes **kwargs."""
    if model is None:
        return set(), True
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def _batches_from_tensors(named: dict[str, torch.Tensor], model: nn.Module | None, batch_size: int,
                          where: str, holdout: float) -> tuple[list[Batch], list[Batch]]:
    if not named:
        raise AuditError(f"calibration file {where} holds no tensors", "Save at least one input tensor")
    sizes = {k: (int(v.shape[0]) if v.dim() > 0 else None) for k, v in named.items()}
    if any(s is None for s in sizes.values()):
        raise AuditError(f"calibration tensor(s) {', '.join(k for k, s in sizes.items() if s is None)} in {where} "
                         "are scalars", "Batch every input along dim 0")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {s}" for k, s in sizes.items())
        raise AuditError(f"calibration tensors in {where} disagree on the batch size (dim 0): {listed}",
                         "Give every input the same number of rows")
    rows = next(iter(sizes.values()))
    if rows == 0:
        raise AuditError(f"calibration file {where} holds zero rows", "Save at least one example")
    names, var_kw = _forward_names(model)
    positional = len(named) == 1 and next(iter(named)) not in names
    unknown = [k for k in named if k not in names]
    if not positional and unknown and not var_kw:
        raise AuditError(f"calibration input(s) {', '.join(unknown)} in {where} are not keyword inputs of "
                         f"{type(model).__name__}.forward (it takes {', '.join(sorted(names)) or 'none'})",
                         "Rename the tensors after the forward's arguments, or save a single positional input")
    # the held-out rows are the last ones, cut before batching so the split is exact in rows
    cut = rows - (min(rows - 1, max(1, round(holdout * rows))) if holdout > 0 and rows > 1 else 0)

    def batches(lo: int, hi: int) -> list[Batch]:
        out = []
        for i in range(lo, hi, batch_size):
            j = min(i + batch_size, hi)
            if positional:
                out.append(Batch((next(iter(named.values()))[i:j],), {}))
            else:
                out.append(Batch((), {k: v[i:j] for k, v in named.items()}))
        return out

    return batches(0, cut), batches(cut, rows)


def _as_batch(item: Any, i: int, where: str) -> Batch:
    if isinstance(item, Batch):
        return item
    if isinstance(item, torch.Tensor):
        return Batch((item,), {})
    if isinstance(item, dict) and all(isinstance(k, str) for k in item):
        return Batch((), dict(item))
    if isinstance(item, (tuple, list)):
        return Batch(tuple(item), {})
    raise AuditError(f"batch {i} from {where} is a {type(item).__name__}",
                     "Yield tensors, tuples of positional inputs, or dicts of keyword inputs")


def _import_fn(spec: str) -> Any:
    from ..load import import_user_module

    target, _, attr = spec.rpartition(":")
    module = import_user_module(target, "calibration file")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AuditError(f"{target} has no function named {attr!r}", "Name a function that returns batches")
    return fn


def _split(batches: list[Batch], holdout: float) -> tuple[list[Batch], list[Batch]]:
    if holdout <= 0:
        return batches, []
    if len(batches) >= 2:
        k = min(len(batches) - 1, max(1, round(holdout * len(batches))))
        return batches[:-k], batches[-k:]
    b = batches[0]
    rows = b.rows
    ts = b.tensors()
    if rows < 2 or any(t.dim() == 0 or t.shape[0] != rows for _, t in ts):
        raise AuditError("a single calibration batch of one row cannot be split into fit and held-out parts",
                         "Give more rows, or --holdout 0")
    k = min(rows - 1, max(1, round(holdout * rows)))

    def cut(sl: slice) -> Batch:
        return Batch(tuple(a[sl] if isinstance(a, torch.Tensor) else a for a in b.args),
                     {n: (v[sl] if isinstance(v, torch.Tensor) else v) for n, v in b.kwargs.items()})

    return [cut(slice(0, rows - k))], [cut(slice(rows - k, rows))]


def _check_finite(batches: list[Batch], where: str) -> None:
    for i, b in enumerate(batches):
        for name, t in b.tensors():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise AuditError(f"calibration input {name} in {where} (batch {i}) holds NaN or infinite values",
                                 "Clean the calibration data")


def _vocab(model: nn.Module | None) -> int | None:
    if model is None:
        return None
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return max(sizes) if sizes else None


def token_statistics(ids: torch.Tensor, vocab: int) -> dict[str, float]:
    """How random a stream of token ids looks.

    ``coincidence`` is the chance that two positions hold the same id, times the vocabulary size: 1 for ids drawn
    uniformly at random, far above 1 for text (Zipf). ``entropy_ratio`` is the unigram entropy over log(vocab).
    ``repeated_trigrams`` is the share of trigram positions whose trigram occurred before (near 0 for random ids)."""
    flat = ids.reshape(-1).long().cpu()
    n = flat.numel()
    counts = torch.bincount(flat.clamp(min=0), minlength=vocab).double()
    coinc = float((counts * (counts - 1)).sum() / max(n * (n - 1), 1)) * vocab
    p = counts[counts > 0] / n
    entropy = float(-(p * p.log()).sum())
    rows = ids.reshape(ids.shape[0], -1).long().cpu() if ids.dim() > 1 else flat[None]
    seen: set[tuple[int, int, int]] = set()
    total = rep = 0
    for row in rows.tolist():
        for j in range(len(row) - 2):
            tri = (row[j], row[j + 1], row[j + 2])
            total += 1
            rep += tri in seen
            seen.add(tri)
    return {"tokens": float(n), "coincidence": coinc, "entropy_ratio": entropy / math.log(max(vocab, 2)),
            "repeated_trigrams": rep / total if total else 0.0}


def synthetic_warning(batches: list[Batch], model: nn.Module | None) -> str | None:
    """A warning when the integer inputs look like token ids drawn uniformly at random."""
    vocab = _vocab(model)
    for name, t in (batches[0].tensors() if batches else []):
        if t.is_floating_point() or t.dtype == torch.bool or "mask" in name or "type" in name:
            continue
        ids = torch.cat([dict(b.tensors())[name].reshape(-1) for b in batches if name in dict(b.tensors())])
        if ids.numel() < 200 or int(ids.min()) < 0:
            continue
        v = vocab if vocab is not None and vocab > int(ids.max()) else int(ids.max()) + 1
        s = token_statistics(ids, v)
        if s["coincidence"] < 1.5 and s["repeated_trigrams"] < 0.01:
            return (f"calibration {name} looks like token ids drawn uniformly at random (two positions agree "
                    f"{s['coincidence']:.2f}x as often as chance, unigram entropy {100 * s['entropy_ratio']:.0f}% of "
                    f"log {v}, {100 * s['repeated_trigrams']:.2f}% repeated trigrams): floors measured on it are "
                    "meaningless; use real inputs")
    return None


def load_calibration(source: Any, model: nn.Module | None = None, holdout: Any = 0.25,
                     batch_size: int = 32, check_forward: bool = True, *, tokenizer: str | Path | None = None,
                     length: int | None = None) -> Calibration:
    """Load calibration batches and split off the held-out part.

    ``source``: a path (``.safetensors``, ``.pt``/``.pth``/``.bin``), ``file.py:fn`` or ``module:fn``, a dict of
    tensors batched along dim 0, or an iterable of batches. ``holdout``: the share of rows (or batches) held out, or
    a second source of the same kinds that is held out whole. With ``model`` the names are checked against its
    forward and the first batch is run once, so inputs that do not fit fail here with one line (an ``AuditError``).
    A text file (:func:`auditor.calibration.text.is_text_file`) is tokenized with the tokenizer in the directory
    ``tokenizer`` into windows of ``length`` tokens (default: the model's positions, at most 512); the digest then
    covers the tokenizer's files too.
    """
    if isinstance(holdout, str):
        try:
            holdout = float(holdout)  # --holdout 0.25 as given on the command line
        except ValueError:
            pass
    if not isinstance(holdout, (int, float)) or isinstance(holdout, bool):
        fit = load_calibration(source, model, 0.0, batch_size, check_forward, tokenizer=tokenizer, length=length)
        try:
            held = load_calibration(holdout, model, 0.0, batch_size, check_forward, tokenizer=tokenizer,
                                    length=length)
        except AuditError as exc:  # the same checks, said of the held-out source
            raise AuditError(exc.what.replace("calibration file", "held-out file", 1),
                             exc.fix.replace("--calibration", "--holdout")) from None
        tokenized = "; ".join(f"{what}: {c.tokenized}" for what, c in (("fit", fit), ("held out", held))
                              if c.tokenized)
        return Calibration(fit.fit, held.fit, f"{fit.source} (held out: {held.source})",
                           hashlib.sha256((fit.digest + held.digest).encode()).hexdigest(),
                           fit.warnings + [w for w in held.warnings if w not in fit.warnings], tokenized)
    if not 0 <= holdout < 1:
        raise AuditError(f"held-out share {holdout} is not in [0, 1)", "Give e.g. --holdout 0.25")
    where = str(source) if isinstance(source, (str, Path)) else "<batches>"
    split: tuple[list[Batch], list[Batch]] | None = None
    text_in = None
    if is_text_source(source):
        names, _ = _forward_names(model)
        text_in = text_inputs(Path(source), tokenizer, model, length, attention_mask="attention_mask" in names)
        split = _batches_from_tensors(text_in.tensors, model, batch_size, where, holdout)
    elif length is not None:
        raise AuditError(f"a calibration window length applies to a text file; {where} is not one",
                         "Drop --calibration-length, or give a text file")
    elif isinstance(source, (str, Path)):
        text = str(source)
        path = Path(text)
        if ":" in path.name and not path.exists():
            fn = _import_fn(text)
            try:
                items = list(fn())
            except AuditError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise AuditError(f"{text}() raised {first_line(exc)}", "Fix the function that yields batches") from None
            batches = [_as_batch(x, i, text) for i, x in enumerate(items)]
        else:
            split = _batches_from_tensors(_read_file(path), model, batch_size, text, holdout)
    elif isinstance(source, dict):
        split = _batches_from_tensors(dict(source), model, batch_size, where, holdout)
    else:
        batches = [_as_batch(x, i, where) for i, x in enumerate(source)]
    if split is not None:
        batches = split[0] + split[1]
    if not batches:
        raise AuditError(f"calibration source {where} yielded no batches", "Give at least one batch of inputs")
    _check_finite(batches, where)
    fit, held = split if split is not None else _split(batches, holdout)
    cal = Calibration(fit, held, where, _digest(batches))
    if text_in is not None:  # the same ids from another tokenizer are another calibration
        cal.digest = hashlib.sha256(f"{cal.digest};tokenizer:{text_in.tokenizer_digest}".encode()).hexdigest()
        cal.tokenized = text_in.description
    if model is not None and check_forward:
        try:
            run(model, fit[0])
        except Exception as exc:  # noqa: BLE001 - the inputs do not fit the forward
            raise AuditError(f"calibration inputs from {where} do not fit {type(model).__name__}.forward: "
                             f"{first_line(exc)}", "Give inputs shaped like the model's example inputs") from None
    warn = synthetic_warning(batches if text_in is None else [Batch((), {"input_ids": text_in.text_ids()})], model)
    if warn:
        cal.warnings.append(warn)
    return cal


def as_calibration(data: Any, model: nn.Module | None = None, holdout: float = 0.25) -> Calibration:
    """A ``Calibration`` as is, or ``load_calibration(data, model, holdout)``."""
    return data if isinstance(data, Calibration) else load_calibration(data, model, holdout)

