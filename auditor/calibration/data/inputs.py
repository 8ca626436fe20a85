"""Calibration inputs: load them, check them, split off a held-out part.

A source is a safetensors (or weights-only ``.pt``) file of named tensors batched along dim 0 that match the forward's
keyword inputs (``input_ids``, ``attention_mask``, ...) or one positional input; ``file.py:fn`` / ``module:fn``
returning an iterable of batches (a tensor, a tuple of positional inputs, or a dict of keyword inputs); a text file,
tokenized with the model's tokenizer and cut into windows (:mod:`auditor.calibration.data.text`); or, from the API, such an
iterable itself. The held-out part (the last ``holdout`` share of the rows or batches) is used only to
measure, never to compute input statistics.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from ...errors import AuditError, describe_missing, first_line, size_text
from ...options import CALIBRATION_MAX_BYTES, CALIBRATION_MAX_ROWS
from .documents import document_cut, pop_documents, runs
from .text import is_text_source, model_vocab, text_inputs


@dataclass
class Batch:
    """One forward call: positional and keyword inputs."""

    args: tuple[object, ...] = ()
    kwargs: dict[str, object] = field(default_factory=dict)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"arg{i}", a) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        out += [(k, v) for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)]
        return out

    def to(self, device: torch.device) -> "Batch":
        def mv(x: object) -> object:
            return x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x

        return Batch(tuple(mv(a) for a in self.args), {k: mv(v) for k, v in self.kwargs.items()})

    @property
    def rows(self) -> int:
        ts = self.tensors()
        return int(ts[0][1].shape[0]) if ts and ts[0][1].dim() > 0 else 1

    def cut(self, lo: int, hi: int) -> "Batch":
        """Rows ``lo:hi`` of every tensor batched along dim 0 (its first dimension ``rows``); the rest as it is."""
        n = self.rows

        def part(x: object) -> object:
            return x[lo:hi] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n else x

        return Batch(tuple(part(a) for a in self.args), {k: part(v) for k, v in self.kwargs.items()})


@dataclass
class Calibration:
    """Calibration batches: ``fit`` for input statistics and initialisation, ``holdout`` only for measuring."""

    fit: list[Batch]
    holdout: list[Batch]
    source: str = "<batches>"
    digest: str = ""  # sha256 of the names, shapes, dtypes and bytes of every tensor: a cache key
    warnings: list[str] = field(default_factory=list)
    tokenized: str = ""  # for a text file: the tokenizer, token count and windows (text.TextInputs.description)
    documents: tuple[int, ...] | None = None  # each row's document (fit rows, then held out), where the source says
    document_unit: str = "documents"  # what a document is: "files" (a directory's) or "documents"

    @property
    def fit_rows(self) -> int:
        return sum(b.rows for b in self.fit)

    @property
    def holdout_rows(self) -> int:
        return sum(b.rows for b in self.holdout)

    @property
    def held_documents(self) -> tuple[int, ...] | None:
        """Each held-out row's document (numbered from 0), where the source says; None otherwise."""
        if self.documents is None or not self.holdout_rows:
            return None
        return tuple(runs(list(self.documents[len(self.documents) - self.holdout_rows:])))

    @property
    def measure(self) -> list[Batch]:
        """The batches metrics are measured on: the held-out part, or the fit part when nothing is held out."""
        return self.holdout or self.fit


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def main_output(out: object) -> torch.Tensor:
    """The tensor a metric compares: the output itself, ``.logits``, or the first tensor of a tuple or dict."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    raise AuditError(f"the model returned {type(out).__name__}, with no tensor to compare",
                     "Give --metric module:fn that scores the model")


def run(model: nn.Module, batch: Batch) -> object:
    """The model's output for one batch, moved to the model's device, without gradients, in eval mode (a model left
    in training mode is not written to: its batch norms' running statistics stay as they were)."""
    b = batch.to(model_device(model))
    with torch.no_grad(), eval_mode(model):
        return model(*b.args, **b.kwargs)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode (dropout off, batch norm on its running statistics) while the block runs, then every
    module back in the mode it had (a caller's model half in training mode comes back exactly so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


MAX_ROWS = CALIBRATION_MAX_ROWS  # calibration rows (examples, windows) read at most, unless the caller raises it
MAX_BYTES = CALIBRATION_MAX_BYTES  # bytes of calibration data (a file, the tensors a function yields) read at most
LOGITS_BUDGET = 1 << 29  # float32 bytes of a batch's output (a language model's logits) that sets its rows at most
MAX_SHAPE_PROBES = 8  # later batches of a new shape run through the forward once each, at most this many


def parse_size(text: str, flag: str = "--calibration-max-bytes") -> int:
    """``2G``, ``500M``, ``64K``, ``1T`` (binary units, optional ``iB``/``B``) or a plain number of bytes.

    >>> parse_size("2G"), parse_size("1.5MiB"), parse_size("4096")
    (2147483648, 1572864, 4096)
    """
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    value = float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))) if m else math.nan
    if not (math.isfinite(value) and 1 <= value < 2**63):
        raise AuditError(f"{flag} {text!r} is not a size", f"Give bytes with a unit, e.g. {flag} 4G")
    return int(value)


def _digest(batches: list[Batch]) -> str:
    h = hashlib.sha256()
    for b in batches:
        for name, t in b.tensors():
            c = t.detach().contiguous().cpu()
            h.update(f"{name}:{tuple(c.shape)}:{c.dtype};".encode())
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def _read_file(path: Path, max_bytes: int | None = MAX_BYTES) -> dict[str, torch.Tensor]:
    what = describe_missing(path)
    if what:
        raise AuditError(f"calibration file {path} {what}", "Check the path given to --calibration")
    size = path.stat().st_size
    if size == 0:
        raise AuditError(f"calibration file {path} is empty", "Save the inputs with safetensors.torch.save_file")
    if max_bytes is not None and size > max_bytes:
        raise AuditError(f"calibration file {path} is {size_text(size)}, more than the {size_text(max_bytes)} "
                         "calibration data is capped at", "Give a smaller sample (a few hundred rows is typical), "
                         f"or raise the cap with --calibration-max-bytes {-(-size // (1 << 30))}G")
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


def _batches_from_tensors(named: dict[str, torch.Tensor], model: nn.Module | None, reading: Reading, where: str,
                          holdout: float, unit: str = "rows",
                          documents: list[int] | None = None) -> tuple[list[Batch], list[Batch]]:
    """Tensors batched along dim 0 in ``reading.batch_size`` rows, (fit, held out): the held-out share cut off the
    end (on a document boundary with ``documents``); at most ``reading.max_rows`` ``unit``."""
    batch_size, max_rows = reading.batch_size, reading.max_rows
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
    if max_rows is not None and rows > max_rows:
        raise AuditError(f"calibration source {where} holds {rows:,} {unit}, more than the cap of {max_rows:,}",
                         f"Give a smaller sample, or raise the cap with --calibration-max-rows {rows}")
    if holdout > 0 and rows < 2:
        raise AuditError(f"calibration source {where} holds one row, so nothing can be held out of it "
                         f"(--holdout {holdout:g})", "Give more rows, a second file with --holdout FILE, "
                         "or --holdout 0")
    names, var_kw = _forward_names(model)
    positional = len(named) == 1 and next(iter(named)) not in names
    unknown = [k for k in named if k not in names]
    if not positional and unknown and not var_kw:
        raise AuditError(f"calibration input(s) {', '.join(unknown)} in {where} are not keyword inputs of "
                         f"{type(model).__name__}.forward (it takes {', '.join(sorted(names)) or 'none'})",
                         "Rename the tensors after the forward's arguments, or save a single positional input")
    # the held-out rows are the last ones, cut before batching so the split is exact in rows (whole documents)
    cut = rows - (min(rows - 1, max(1, round(holdout * rows))) if holdout > 0 and rows > 1 else 0)
    if documents is not None:
        cut = document_cut(documents, holdout)

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


def _as_batch(item: object, i: int, where: str) -> Batch:
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


def import_function(spec: str) -> object:
    """The callable ``file.py:fn`` or ``module:fn`` names (the user's file imported with its prints kept off stdout);
    a name that is missing or not callable is one :class:`AuditError` line. Read by --calibration-data functions and
    by --metric (measure/metric.py)."""
    from ...sources.factory import import_user_module

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
    vocab = model_vocab(model)
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


def _read_batches(items: Iterable[object], where: str, max_rows: int | None, max_bytes: int | None,
                  user: str = "") -> list[Batch]:
    """The batches an iterable yields, read until it ends or a cap is passed (an endless generator stops there with
    one line). ``user``: the ``file.py:fn`` whose generator this is; its exceptions and exits become one line."""
    from ...sources.factory import run_user_code

    out: list[Batch] = []
    rows = size = 0

    def read() -> None:
        nonlocal rows, size
        for i, x in enumerate(items):
            b = _as_batch(x, i, where)
            out.append(b)
            rows += max(1, b.rows)  # a batch of no rows still counts: an endless stream of them must end too
            size += sum(t.numel() * t.element_size() for _, t in b.tensors())
            if max_rows is not None and rows > max_rows:
                raise AuditError(f"calibration source {where} yields more than {max_rows:,} rows (stopped reading "
                                 f"at batch {i})", "Yield fewer batches (a few hundred rows is typical), or raise "
                                 f"the cap with --calibration-max-rows {2 * max_rows}")
            if max_bytes is not None and size > max_bytes:
                raise AuditError(f"calibration source {where} yields more than {size_text(max_bytes)} of tensors "
                                 f"(stopped reading at batch {i})", "Yield fewer or smaller batches, or raise the "
                                 f"cap with --calibration-max-bytes {-(-2 * max_bytes // (1 << 30))}G")

    if user:
        run_user_code(read, f"calibration function {user}()", "raised", "Fix the function that yields batches",
                       "Return (or yield) the batches instead of exiting")
    else:
        read()
    return out


@dataclass(frozen=True)
class Reading:
    """How a calibration source is read: rows per batch of a tensor file, whether the first batch (and the first of
    each other shape) runs through the forward, the tokenizer and window length of a text file, and the caps on
    rows and bytes read (None: no cap)."""

    batch_size: int = 32
    check_forward: bool = True
    tokenizer: str | Path | None = None
    length: int | None = None
    max_rows: int | None = MAX_ROWS
    max_bytes: int | None = MAX_BYTES
    separator: str | None = None  # a text file's document separator (documents.py)


def misfit(what: str, model: nn.Module, exc: BaseException) -> AuditError:
    """One line for inputs ``model``'s forward refuses: ``{what} do not fit Model.forward: {the error's first
    line}`` (the calibration's read and ``--estimate`` say it alike)."""
    return AuditError(f"{what} do not fit {type(model).__name__}.forward: {first_line(exc)}",
                      "Give inputs shaped like the model's example inputs")


def load_calibration(source: object, model: nn.Module | None = None, holdout: object = 0.25,
                     batch_size: int = 32, check_forward: bool = True, *, tokenizer: str | Path | None = None,
                     length: int | None = None, **caps: "int | str | None") -> Calibration:
    """Load calibration batches and split off the held-out part.

    ``source``: a path (``.safetensors``, ``.pt``/``.pth``/``.bin``), ``file.py:fn`` or ``module:fn``, a dict of
    tensors batched along dim 0, or an iterable of batches. ``holdout``: the share of rows (or batches) held out, or
    a second source of the same kinds that is held out whole. Every batch, fit and held out, is checked against the
    first (:func:`check_batches`: structure, dtypes, token ids, masks); with ``model`` the names are checked against
    its forward and the first batch (and the first of each other shape) is run once, so inputs that do not fit fail
    here with one line (an ``AuditError``) naming the batch. ``caps``: ``max_rows`` and ``max_bytes`` cap what is
    read (a file's size, a text file's size, the tensors a function yields; None: no cap; default
    :data:`MAX_ROWS`, :data:`MAX_BYTES`); ``separator`` (among them): a text file's document separator.
    A text file (:func:`auditor.calibration.data.text.is_text_file`) is tokenized with the tokenizer in the directory
    ``tokenizer`` into windows of ``length`` tokens (default: the model's positions, at most 512); the digest then
    covers the tokenizer's files too. Which rows are one document (:mod:`~auditor.calibration.data.documents`: a
    directory of text files, a text cut at ``separator``, a ``document`` tensor) is kept for the held-out rows, and
    the held-out share is cut on a document boundary.
    """
    unknown = sorted(set(caps) - {"max_rows", "max_bytes", "separator"})
    if unknown:
        raise TypeError(f"load_calibration() got an unexpected keyword argument {unknown[0]!r}")
    reading = Reading(batch_size, check_forward, tokenizer, length, **caps)  # type: ignore[arg-type]
    cal = _load(source, model, holdout, reading)
    check_batches(cal, model, probe=check_forward)
    return cal


def _share(holdout: object) -> object:
    """--holdout 0.25 as given on the command line (a string) read as a number; anything else as it is."""
    if isinstance(holdout, str):
        try:
            return float(holdout)
        except ValueError:
            pass
    return holdout


def _load(source: object, model: nn.Module | None, holdout: object, reading: Reading) -> Calibration:
    holdout = _share(holdout)
    if not isinstance(holdout, (int, float)) or isinstance(holdout, bool):
        return _load_pair(source, holdout, model, reading)
    if not 0 <= holdout < 1:
        raise AuditError(f"held-out share {holdout} is not in [0, 1)", "Give e.g. --holdout 0.25")
    where = str(source) if isinstance(source, (str, Path)) else "<batches>"
    batches, split, text_in, docs = _read_source(source, model, holdout, reading, where)
    if split is not None:
        batches = split[0] + split[1]
    if not batches:
        raise AuditError(f"calibration source {where} yielded no batches", "Give at least one batch of inputs")
    _check_finite(batches, where)
    fit, held = split if split is not None else _split(batches, holdout)
    probed = False  # the first batch's forward stood for by its first rows' (independent rows)
    if model is not None and reading.check_forward and (fit or held):
        cap, probed = _probe_rows(model, (fit or held)[0])
        fit, held = _cut_to(fit, cap), _cut_to(held, cap)
    cal = Calibration(fit, held, where, _digest(batches))
    if text_in is not None:  # the same ids from another tokenizer are another calibration
        cal.digest = hashlib.sha256(f"{cal.digest};tokenizer:{text_in.tokenizer_digest}".encode()).hexdigest()
        cal.tokenized = text_in.description
    if docs is not None:  # the held-out rows' documents; another grouping is another calibration
        ids, cal.document_unit = docs
        cal.documents = tuple(ids)
        cal.digest = hashlib.sha256(f"{cal.digest};documents:{ids}".encode()).hexdigest()
    if model is not None and reading.check_forward and not probed:
        try:
            run(model, (fit or held)[0])
        except Exception as exc:  # noqa: BLE001 - the inputs do not fit the forward
            raise misfit(f"calibration inputs from {where}", model, exc) from None
    warn = synthetic_warning(batches if text_in is None else [Batch((), {"input_ids": text_in.text_ids()})], model)
    if warn:
        cal.warnings.append(warn)
    return cal


def bounded_rows(positions: int, width: int) -> int:
    """Rows a batch holds at most when each row's output is ``positions`` x ``width`` float32 values:
    :data:`LOGITS_BUDGET` of them, at least one (``--estimate`` counts the batches the load will cut)."""
    return max(1, LOGITS_BUDGET // max(1, positions * width * 4))


def _probe_rows(model: nn.Module, first: Batch) -> tuple[int | None, bool]:
    """(the rows a batch holds at most, or None; whether the probes stand for the first batch's forward), read from
    forwards of ``first``'s first two rows together and its second row alone, in eval mode.

    The cap (:func:`bounded_rows`) applies where one row's output (a language model's logits: positions x
    vocabulary, float32) times the rows would pass :data:`LOGITS_BUDGET`: every forward of the audit then holds at
    most that much output, and a backward its gradient (a 49,152-token vocabulary at 512 positions is 100 MB a row, 32
    rows 3.2 GB). None (nothing cut) unless cutting is safe and needed. Both need every tensor of ``first`` batched
    along dim 0, its output (rows, positions, features) in floats, and rows independent (the second row's output the
    same run alone as beside the first: not a sequence-first model, whose dim 0 is positions): then the other rows,
    of the same shapes and with their ids and masks checked (:func:`check_batches`), run as these did, and the whole
    first batch is not run once more (a 7B model's batch of 16 x 256 positions is about 6 minutes of CPU). A forward
    that fails, or rows not shown independent, leave the batches as they are and the whole first batch to be run."""
    rows = first.rows
    ts = first.tensors()
    if rows <= 2 or not ts or any(t.dim() == 0 or int(t.shape[0]) != rows for _, t in ts):
        return None, False
    try:
        pair, alone = main_output(run(model, first.cut(0, 2))), main_output(run(model, first.cut(1, 2)))
    except Exception:  # noqa: BLE001 - the run of the whole first batch (or the metric) says what does not fit
        return None, False
    if not all(y.dim() == 3 and y.is_floating_point() for y in (pair, alone)):
        return None, False
    if tuple(pair.shape) != (2, *alone.shape[1:]) or alone.shape[0] != 1:
        return None, False
    gap = float((pair[1:].float() - alone.float()).norm())  # a batched row differs by rounding alone (bf16: ~4e-3)
    if not gap <= 1e-2 * float(alone.float().norm()):
        return None, False
    cap = bounded_rows(int(alone.shape[1]), int(alone.shape[2]))
    return (cap if cap < rows else None), True


def _cut_to(batches: list[Batch], rows: int | None) -> list[Batch]:
    """``batches`` cut into batches of at most ``rows`` rows: the same rows in the same order (the digest stays)."""
    if rows is None or all(b.rows <= rows for b in batches):
        return batches
    return [b.cut(i, min(i + rows, b.rows)) for b in batches for i in range(0, b.rows, rows)]


def _load_pair(source: object, holdout: object, model: nn.Module | None, reading: Reading) -> Calibration:
    """A calibration source fitted on whole and a second source held out whole."""
    fit = _load(source, model, 0.0, reading)
    try:
        held = _load(holdout, model, 0.0, reading)
    except AuditError as exc:  # the same checks, said of the held-out source
        raise AuditError(exc.what.replace("calibration file", "held-out file", 1),
                         exc.fix.replace("--calibration", "--holdout")) from None
    max_rows = reading.max_rows
    if max_rows is not None and fit.fit_rows + held.fit_rows > max_rows:
        raise AuditError(f"the calibration and held-out sources hold {fit.fit_rows + held.fit_rows:,} rows, more "
                         f"than the cap of {max_rows:,}", "Give fewer rows, or raise the cap with "
                         f"--calibration-max-rows {fit.fit_rows + held.fit_rows}")
    tokenized = "; ".join(f"{what}: {c.tokenized}" for what, c in (("fit", fit), ("held out", held))
                          if c.tokenized)
    return Calibration(fit.fit, held.fit, f"{fit.source} (held out: {held.source})",
                       hashlib.sha256((fit.digest + held.digest).encode()).hexdigest(),
                       fit.warnings + [w for w in held.warnings if w not in fit.warnings], tokenized,
                       None if held.documents is None else (-1,) * fit.fit_rows + held.documents,
                       held.document_unit)


Split = tuple[list[Batch], list[Batch]]


Docs = tuple[list[int], str]  # each row's document (run numbers) and what a document is


def _read_source(source: object, model: nn.Module | None, holdout: float, reading: Reading,
                 where: str) -> tuple[list[Batch], Split | None, object, Docs | None]:
    """(batches, their (fit, held-out) split where the reader cuts rows itself, the text inputs of a text file,
    each row's document where the source says)."""
    r = reading
    if is_text_source(source):
        text_in = _text(Path(source), model, holdout, reading, where)
        docs = list(text_in.documents) if text_in.documents is not None else None
        split = _batches_from_tensors(text_in.tensors, model, r, where, holdout, "windows", docs)
        return [], split, text_in, (docs, text_in.unit) if docs is not None else None
    if r.length is not None or r.separator is not None:
        flag = "--calibration-length" if r.length is not None else "--document-separator"
        what = "window length" if r.length is not None else "document separator"
        raise AuditError(f"a calibration {what} applies to a text file; {where} is not one",
                         f"Drop {flag}, or give a text file")
    if isinstance(source, (str, Path)):
        text = str(source)
        path = Path(text)
        if ":" in path.name and not path.exists():
            return _read_batches(_called(text), text, r.max_rows, r.max_bytes, user=text), None, None, None
        named = _read_file(path, r.max_bytes)
    elif isinstance(source, dict):
        named, text = dict(source), where
    else:
        return _read_batches(source, where, r.max_rows, r.max_bytes), None, None, None
    docs = pop_documents(named, text)
    split = _batches_from_tensors(named, model, r, text, holdout, documents=docs)
    return [], split, None, (docs, "documents") if docs is not None else None


def _text(path: Path, model: nn.Module | None, holdout: float, reading: Reading, where: str) -> object:
    """A text file tokenized into windows (:func:`~auditor.calibration.data.text.text_inputs`)."""
    names, _ = _forward_names(model)
    text_in = text_inputs(path, reading.tokenizer, model, reading.length, attention_mask="attention_mask" in names,
                          max_bytes=reading.max_bytes, max_rows=reading.max_rows, separator=reading.separator)
    windows = int(text_in.tensors["input_ids"].shape[0])
    if holdout > 0 and windows < 2:
        raise AuditError(f"calibration text {where} gives one window of {text_in.window} tokens, so nothing can "
                         f"be held out of it (--holdout {holdout:g})", "Give a longer text, a shorter window "
                         "with --calibration-length N, a second file with --holdout FILE, or --holdout 0")
    return text_in


def _called(text: str) -> Iterable[object]:
    """What the calibration function ``file.py:fn`` / ``module:fn`` returns: an iterable of batches."""
    from ...sources.factory import run_user_code

    fn = import_function(text)
    items = run_user_code(fn, f"calibration function {text}()", "raised", "Fix the function that yields batches",
                           "Return (or yield) the batches instead of exiting")
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes, torch.Tensor, dict)):
        raise AuditError(f"{text}() returned {type(items).__name__}, not batches",
                         "Return (or yield) a list of tensors, tuples of positional inputs, or dicts")
    return items


def _signature(b: Batch) -> tuple[object, ...]:
    """What must be the same in every batch: the positional inputs (a tensor's dtype and rank, or another value's
    type) and the keyword names with the same per value."""
    def one(v: object) -> object:
        return ("tensor", v.dtype, v.dim()) if isinstance(v, torch.Tensor) else type(v).__name__

    return tuple(one(a) for a in b.args), tuple(sorted((k, one(v)) for k, v in b.kwargs.items()))


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')} {v.dim()}-D"
    return type(v).__name__


def _token_input(name: str, t: torch.Tensor) -> bool:
    """Integer inputs whose values index an embedding: positional ones and ``*ids`` / ``input*`` keywords (not labels,
    whose ignore index -100 is legitimate, masks, position ids or lengths)."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return False
    low = name.lower()
    if any(w in low for w in ("label", "mask", "position", "length")):
        return False  # ignore indices (-100), masks, positions and lengths index no vocabulary
    return name.startswith("arg") or "ids" in low or "input" in low


IGNORE_INDEX = -100  # a label that is not scored (PyTorch's cross-entropy and Hugging Face's collators)


def _label_input(name: str, t: torch.Tensor) -> bool:
    """Integer ``labels`` (or ``*label*``) inputs: token ids or class ids, with -100 for positions not scored."""
    return "label" in name.lower() and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _where_in(t: torch.Tensor, bad: torch.Tensor) -> str:
    """The first ``True`` of ``bad`` (shaped like ``t``) in words: row and position."""
    idx = [int(i) for i in bad.nonzero()[0]]
    names = ("row", "position")
    return ", ".join(f"{names[k] if k < 2 else f'index {k}'} {i}" for k, i in enumerate(idx))


def token_value_problem(t: torch.Tensor, vocab: int | None, labels: bool) -> str | None:
    """What is wrong with token ids (``labels``: labels) ``t``, as the end of one line, or None: an id must be in
    0 .. ``vocab`` - 1; a label must be that or -100 (:data:`IGNORE_INDEX`); any other negative label would be
    clamped to token 0 and scored as if it were one. One validator for ids and labels, at loading and at scoring.

    >>> token_value_problem(torch.tensor([[1, -100, -5]]), 10, labels=True)
    'holds -5 at row 0, position 2: a label is a token id (0 to 9) or -100, the ignore index'
    >>> token_value_problem(torch.tensor([[1, 12]]), 10, labels=False)
    'holds token id 12 at row 0, position 1, outside the vocabulary (0 to 9)'
    """
    if t.numel() == 0:
        return None
    t = t.detach()
    if labels:
        bad = (t < 0) & (t != IGNORE_INDEX)
        if vocab is not None:
            bad |= t >= vocab
        if not bool(bad.any()):
            return None
        v = int(t[bad][0]) if t.dim() else int(t)
        ids = f"a token id (0 to {vocab - 1})" if vocab is not None else "a token or class id (0 or more)"
        at = f" at {_where_in(t, bad)}" if t.dim() else ""
        return f"holds {v}{at}: a label is {ids} or {IGNORE_INDEX}, the ignore index"
    bad = t < 0
    if vocab is not None:
        bad |= t >= vocab
    if not bool(bad.any()):
        return None
    v = int(t[bad][0]) if t.dim() else int(t)
    at = f" at {_where_in(t, bad)}" if t.dim() else ""
    span = f"0 to {vocab - 1}" if vocab is not None else "0 or more"
    return f"holds token id {v}{at}, outside the vocabulary ({span})"


def check_batches(cal: Calibration, model: nn.Module | None = None, probe: bool = True) -> None:
    """Every calibration batch, fit and held out, checked cheaply before any work, each failure one line naming the
    batch: the same structure as the first batch (positional inputs, keyword names, each tensor's dtype and rank),
    token ids in the model's vocabulary (0 <= id < rows of its largest embedding), no ``attention_mask`` row that
    masks everything. With ``model`` and ``probe``, the first batch of every other shape (at most
    ``MAX_SHAPE_PROBES``) runs through the forward once, so another width fails here, not in the middle of tier 1."""
    labelled = [(f"batch {i}", b) for i, b in enumerate(cal.fit)]
    labelled += [(f"held-out batch {i}", b) for i, b in enumerate(cal.holdout)]
    if not labelled:
        return
    where = cal.source
    vocab = model_vocab(model)
    hf = getattr(model, "config", None) is not None
    for label, b in labelled:
        _check_structure(label, b, labelled[0][1], where)
        for name, t in b.tensors():
            if t.numel() > 0:
                _check_values(f"{name} in {label} from {where}", name, t, vocab, hf)
    if model is not None and probe:
        _probe_shapes(labelled, model, where)


def _check_structure(label: str, b: Batch, ref: Batch, where: str) -> None:
    """The batch has the first batch's inputs: positional count, keyword names, each tensor's dtype and rank."""
    if _signature(b) == _signature(ref):
        return
    if len(b.args) != len(ref.args) or set(b.kwargs) != set(ref.kwargs):
        have = f"{len(b.args)} positional and keywords {sorted(b.kwargs) or 'none'}"
        want = f"{len(ref.args)} positional and keywords {sorted(ref.kwargs) or 'none'}"
    else:
        pairs = [(f"input {i}", x, y) for i, (x, y) in enumerate(zip(b.args, ref.args))]
        pairs += [(k, b.kwargs[k], ref.kwargs[k]) for k in sorted(b.kwargs)]
        name, x, y = next((n, x, y) for n, x, y in pairs if _signature(Batch((x,)))
                          != _signature(Batch((y,))))
        have, want = f"{name} {_describe(x)}", f"{_describe(y)}"
    raise AuditError(f"calibration {label} from {where} has other inputs than batch 0: {have}, where batch 0 "
                     f"has {want}", "Give every batch the same inputs, with the same dtypes")


def _check_values(at: str, name: str, t: torch.Tensor, vocab: int | None, hf: bool) -> None:
    """One input's values (``at``: "input_ids in batch 3 from FILE"): token ids within the vocabulary, labels
    scorable, no attention-mask row that masks everything."""
    if vocab is not None and _token_input(name, t):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise AuditError(f"calibration input {at} holds token id {bad}, outside the model's vocabulary (0 to "
                             f"{vocab - 1}: its largest embedding has {vocab} rows)",
                             "Tokenize with the model's own tokenizer")
    if _label_input(name, t):  # token-level labels (shaped like 2-D ids) are token ids; others class ids
        token_level = t.dim() >= 2
        problem = token_value_problem(t, vocab if token_level else None, labels=True)
        if problem:
            raise AuditError(f"calibration input {at} {problem}",
                             f"Give {IGNORE_INDEX} where a position is not scored and the target id elsewhere")
    if name == "attention_mask" and t.dim() >= 1 and (hf or not t.is_floating_point()):
        dead = (t.reshape(t.shape[0], -1) == 0).all(dim=1)
        if bool(dead.any()):
            row = int(dead.nonzero()[0])
            whole = bool(dead.all())
            raise AuditError(f"calibration {at} is all zeros "
                             + ("" if whole else f"in row {row} ") + "(every position masked out): nothing "
                             "the model computes there is measured", "Give 1 on the real tokens and 0 on "
                             "padding only, and leave out rows with no tokens")


def _probe_shapes(labelled: list[tuple[str, Batch]], model: nn.Module, where: str) -> None:
    """The first batch of every other shape (at most ``MAX_SHAPE_PROBES``) runs through the forward once."""
    shapes = {tuple(tuple(t.shape[1:]) for _, t in labelled[0][1].tensors())}
    tried = 0
    for label, b in labelled[1:]:
        shape = tuple(tuple(t.shape[1:]) for _, t in b.tensors())
        if shape in shapes or tried >= MAX_SHAPE_PROBES:
            continue
        shapes.add(shape)
        tried += 1
        try:
            run(model, b)
        except Exception as exc:  # noqa: BLE001 - the batch does not fit the forward
            sizes = ", ".join(f"{n} {'x'.join(map(str, t.shape))}" for n, t in b.tensors())
            first_sizes = ", ".join(f"{'x'.join(map(str, t.shape))}" for _, t in labelled[0][1].tensors())
            raise AuditError(f"calibration {label} from {where} ({sizes}; batch 0: {first_sizes}) does not fit "
                             f"{type(model).__name__}.forward: {first_line(exc)}",
                             "Give every batch the width the model takes") from None
