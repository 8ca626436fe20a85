"""Tier 1, step 1: input statistics X^T X of every factorizable layer, accumulated in float64 by forward hooks during
one pass over the calibration batches.

What "the input X" of a layer is, per kind (rows of X are what one output row is computed from):
- Linear, transformers' Conv1D: the input vectors, every leading dimension flattened (tokens, positions);
- Conv1d/2d/3d: the unfolded patches (in/g * prod(kernel) wide, per group), with the module's own padding (zeros,
  reflect, replicate, circular, ``'same'``), stride and dilation;
- Embedding: one-hot rows, so X^T X is diagonal: the lookup count of every id (kept as a vector, never V x V);
- LSTM/GRU/RNN: each layer's input sequence (``weight_ih``) and the hidden state the recurrence reads at each step
  (``weight_hh``: h0, then the layer's own outputs shifted by one step, reversed for the backward direction), both
  recomputed layer by layer with the module's own weights;
- MultiheadAttention ``in_proj_weight``: the query (self-attention). With distinct query, key and value the three
  Grams are summed and the layer is marked approximate.

The result holds float64 NumPy arrays, never torch tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ... import kinds
from ..._env import scratch_prefix, sweep_scratch
from ...errors import AuditError
from ...kinds.conv import conv_patches
from ...results import Layer
from ..data.inputs import Batch, Calibration, eval_mode, run

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


@dataclass
class LayerInput:
    """The input statistics of one layer: ``gram`` is (groups, n, n) float64, or (n,) lookup counts when
    ``diagonal`` (embeddings)."""

    layer: str
    kind: str
    gram: np.ndarray
    rows: int  # rows of X seen: tokens, positions, patches, lookups
    width: int  # n, the input width of one group
    groups: int = 1
    diagonal: bool = False
    approximate: str = ""  # why the layer-output error is not exact for this layer; empty when it is

    @property
    def singular(self) -> bool:
        return self.rows < self.width


FIELDS = ("layer", "kind", "rows", "width", "groups", "diagonal", "approximate")


def _file_checksum(a: np.ndarray) -> str:
    from blake3 import blake3

    h = blake3(f"|{a.shape}:{a.dtype.str}|".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def _open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading (binary) when it is a regular file, never following a symbolic link and never
    blocking: a FIFO, a device or a socket put where a cache file was raises :class:`StatisticsMismatch` at once
    (opened with ``O_NONBLOCK``, checked with ``fstat`` on the descriptor itself, so nothing can be swapped in
    between)."""
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise StatisticsMismatch(f"{path.name} cannot be opened ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise StatisticsMismatch(f"{path.name} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _map_npy(path: Path) -> np.ndarray:
    """A read-only memory map of the ``.npy`` file ``path`` (a regular file: :func:`_open_regular`)."""
    from numpy.lib import format as npy

    with _open_regular(path) as fh:
        version = npy.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(fh)
        else:
            raise ValueError(f"npy format version {version}")
        if dtype.hasobject:
            raise ValueError("an array of objects")
        offset = fh.tell()
        if int(np.prod(shape)) == 0:
            return np.empty(shape, dtype=dtype)
        return np.memmap(fh, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=offset)


class GramStore(MutableMapping):
    """Input statistics kept on disk, one ``.npy`` per distinct Gram (q, k and v sharing one input share one file),
    read back memory-mapped when a layer's entry is asked for: ``store[name]`` is a fresh :class:`LayerInput` whose
    Gram is a read-only map of its file, checked against the BLAKE3 checksum written with it (a file that changed
    raises :class:`StatisticsMismatch`). Only the metadata stays in memory, so the Grams in RAM are the ones a caller
    holds. ``temporary``: the directory is removed when the store is closed or garbage-collected (and at exit)."""

    def __init__(self, directory: str | Path | None = None, temporary: bool | None = None) -> None:
        if directory is None:
            sweep_scratch()  # a killed run's folders first
            directory = tempfile.mkdtemp(prefix=scratch_prefix("grams"))
            temporary = True if temporary is None else temporary
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.temporary = bool(temporary)
        self.meta: dict[str, dict[str, object]] = {}  # name -> LayerInput fields and "file"
        self.files: dict[str, str] = {}  # file -> checksum
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.dir), True) if self.temporary else None

    def put(self, layers: dict[str, LayerInput]) -> None:
        """Write ``layers``' Grams, one file per distinct array among them."""
        written: dict[int, str] = {}
        for name, inp in layers.items():
            f = written.get(id(inp.gram))
            if f is None:
                f = written[id(inp.gram)] = f"g{len(self.files)}.npy"
                a = np.ascontiguousarray(inp.gram, dtype=np.float64)
                tmp = self.dir / f".{f}.{os.getpid()}.tmp"
                with open(tmp, "wb") as fh:
                    np.save(fh, a, allow_pickle=False)
                tmp.replace(self.dir / f)
                self.files[f] = _file_checksum(a)
            self.meta[name] = {**{k: getattr(inp, k) for k in FIELDS}, "file": f}

    def __setitem__(self, name: str, inp: LayerInput) -> None:
        self.put({name: inp})

    def __getitem__(self, name: str) -> LayerInput:
        m = self.meta[name]
        f = m["file"]
        try:
            a = _map_npy(self.dir / f)
        except StatisticsChanged:
            raise
        except (OSError, ValueError) as exc:
            raise StatisticsChanged(f"{name}: its Gram file {f} cannot be read ({exc})", self.dir) from None
        if _file_checksum(a) != self.files.get(f):
            raise StatisticsChanged(f"{name}: its Gram file {f} changed (checksum)", self.dir)
        return LayerInput(gram=a, **{k: m[k] for k in FIELDS})

    def __delitem__(self, name: str) -> None:
        del self.meta[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)

    def __contains__(self, name: object) -> bool:
        return name in self.meta

    def __reduce__(self) -> tuple[object, ...]:  # pickled (to a cluster's workers) as the Grams themselves
        return dict, ({k: replace_gram(v, np.array(v.gram)) for k, v in self.items()},)

    def close(self) -> None:
        """Remove a temporary store's directory now."""
        if self._remove is not None:
            self._remove()


def replace_gram(inp: LayerInput, gram: np.ndarray) -> LayerInput:
    return LayerInput(gram=gram, **{k: getattr(inp, k) for k in FIELDS})


@dataclass
class InputStatistics:
    """X^T X per layer (keyed by ``Layer.name``), the layers that got none and why, and warnings to show.
    ``layers`` is a dict, or a :class:`GramStore` whose Grams are read from disk on demand."""

    layers: "dict[str, LayerInput] | GramStore" = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    batches: int = 0
    digest: str = ""  # the calibration's digest

    def __contains__(self, name: str) -> bool:
        return name in self.layers

    def save(self, path: str | Path, key: str = "") -> None:
        """Write every Gram and the metadata to one ``.npz`` file (for a cache keyed by the weights' and the
        calibration's digests: the statistics depend on both). The metadata holds ``key`` and a BLAKE3 checksum over
        the key, the metadata and every Gram's bytes, which :meth:`load` verifies."""
        arrays = {f"gram:{k}": np.ascontiguousarray(v.gram, dtype=np.float64) for k, v in self.layers.items()}
        meta = {"layers": {k: {f: getattr(v, f) for f in ("layer", "kind", "rows", "width", "groups", "diagonal",
                                                          "approximate")} for k, v in self.layers.items()},
                "missing": self.missing, "warnings": self.warnings, "batches": self.batches, "digest": self.digest,
                "key": key}
        meta["checksum"] = _checksum(meta, arrays)
        with open(path, "wb") as fh:
            np.savez(fh, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)

    def _meta(self, key: str) -> dict[str, object]:
        return {"missing": self.missing, "warnings": self.warnings, "batches": self.batches, "digest": self.digest,
                "key": key}

    def spill(self, directory: str | Path, key: str = "") -> "InputStatistics":
        """Write every Gram to ``directory`` (one ``.npy`` per distinct Gram, see :class:`GramStore`; the Grams of a
        store already there are not rewritten) and ``meta.json``: the layers' fields, the files' BLAKE3 checksums,
        ``key``, and a checksum over all of it, which :meth:`open` verifies. Returns the statistics reading from
        there."""
        directory = Path(directory)
        store = self.layers if isinstance(self.layers, GramStore) and self.layers.dir == directory else None
        if store is None:
            store = GramStore(directory, temporary=False)
            store.put(dict(self.layers))
        meta = {**self._meta(key), "layers": store.meta, "files": store.files}
        meta["checksum"] = _checksum(meta, {})
        tmp = directory / f".meta.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta))
        tmp.replace(directory / "meta.json")
        return InputStatistics(store, dict(self.missing), list(self.warnings), self.batches, self.digest)

    @classmethod
    def open(cls, directory: str | Path, key: str | None = None) -> "InputStatistics":
        """Read what :meth:`spill` wrote, the Grams left on disk (memory-mapped when asked for). Raises
        :class:`StatisticsMismatch` unless ``meta.json`` is intact and, with ``key``, was written under that key,
        and every Gram file matches its checksum and passes :func:`gram_problem` (each read once, one at a time)."""
        directory = Path(directory)
        try:
            with _open_regular(directory / "meta.json") as fh:
                meta = json.loads(fh.read(1 << 26).decode())
        except (OSError, ValueError) as exc:
            raise StatisticsMismatch(f"no readable metadata ({exc})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("layers"), dict) \
                or not isinstance(meta.get("files"), dict):
            raise StatisticsMismatch("no metadata")
        if key is not None and meta.get("key") != key:
            raise StatisticsMismatch("saved under another key")
        check = meta.pop("checksum", None)
        if check != _checksum(meta, {}):
            raise StatisticsMismatch("checksum")
        store = GramStore(directory, temporary=False)
        store.files = {str(k): str(v) for k, v in meta["files"].items()}
        for name, m in meta["layers"].items():
            if not isinstance(m, dict) or set(m) != {*FIELDS, "file"} or m["file"] not in store.files \
                    or not re.fullmatch(r"g\d+\.npy", str(m["file"])):
                raise StatisticsMismatch(f"{name}: bad metadata")
            store.meta[name] = m
        for name in store:
            inp = store[name]  # the checksum
            problem = gram_problem(inp)
            del inp
            if problem:
                raise StatisticsMismatch(f"{name}: {problem}")
        return cls(store, meta["missing"], meta["warnings"], meta["batches"], meta["digest"])

    @classmethod
    def load(cls, path: str | Path, key: str | None = None) -> "InputStatistics":
        """Read what :meth:`save` wrote. Raises :class:`StatisticsMismatch` unless the entry is intact and, with
        ``key``, was saved under that key: the checksum matches, and every Gram has its layer's shape, is finite,
        symmetric and passes the cheap positive-semidefinite checks (non-negative diagonal, |G_ij| <= sqrt(G_ii
        G_jj)); lookup counts are non-negative."""
        with _open_regular(Path(path)) as fh, np.load(fh, allow_pickle=False) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            if not isinstance(meta, dict) or not isinstance(meta.get("layers"), dict):
                raise StatisticsMismatch("no metadata")
            if key is not None and meta.get("key") != key:
                raise StatisticsMismatch("saved under another key")
            names = [f"gram:{k}" for k in meta["layers"]]
            if set(z.files) != {"__meta__", *names}:
                raise StatisticsMismatch("other arrays than the metadata names")
            arrays = {n: z[n] for n in names}
        check = meta.pop("checksum", None)
        if check != _checksum(meta, arrays):
            raise StatisticsMismatch("checksum")
        layers = {k: LayerInput(gram=arrays[f"gram:{k}"], **v) for k, v in meta["layers"].items()}
        for inp in layers.values():
            problem = gram_problem(inp)
            if problem:
                raise StatisticsMismatch(f"{inp.layer}: {problem}")
        return cls(layers, meta["missing"], meta["warnings"], meta["batches"], meta["digest"])


class StatisticsMismatch(ValueError):
    """A cached statistics entry that is damaged, from another calibration, or not a valid set of Grams."""


class StatisticsChanged(StatisticsMismatch, AuditError):
    """A Gram file of statistics in use changed or went away under the audit (another run rewrote or removed the
    cache entry, or something not a regular file stands in its place): one line, exit 2, not an internal error."""

    def __init__(self, what: str, directory: Path | None = None) -> None:
        where = f" in {directory}" if directory is not None else ""
        AuditError.__init__(self, f"the input statistics{where} changed while this audit was reading them: {what}",
                            "Run again (they are recomputed), and give runs that may overlap their own --cache-dir")


def _checksum(meta: dict[str, object], arrays: dict[str, np.ndarray]) -> str:
    from blake3 import blake3

    h = blake3(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}:{a.shape}:{a.dtype.str}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


GRAM_SLACK = 1e-9  # symmetry and Cauchy-Schwarz hold to this share of the largest diagonal entry (float64 sums)


def gram_problem(inp: LayerInput) -> str:
    """Why ``inp`` is not a valid set of input statistics (empty when it is): its Gram's shape for its width and
    groups, dtype float64, finite values, counts (embeddings) non-negative, a Gram symmetric with a non-negative
    diagonal and |G_ij| <= sqrt(G_ii G_jj), all within ``GRAM_SLACK`` of the largest diagonal entry. O(n^2)."""
    g = inp.gram
    if not isinstance(g, np.ndarray) or g.dtype != np.float64:
        return "not a float64 array"
    if isinstance(inp.rows, bool) or not isinstance(inp.rows, int) or inp.rows < 0:
        return f"rows {inp.rows!r}"
    want = (inp.width,) if inp.diagonal else (inp.groups, inp.width, inp.width)
    if g.shape != want:
        return f"shape {g.shape}, expected {want}"
    if not np.isfinite(g).all():
        return "non-finite values"
    if inp.diagonal:
        return "negative counts" if (g < 0).any() else ""
    diag = np.diagonal(g, axis1=1, axis2=2)
    if (diag < 0).any():
        return "a negative diagonal entry"
    top = float(diag.max()) if diag.size else 0.0
    slack = GRAM_SLACK * top
    if (np.abs(g - g.transpose(0, 2, 1)) > slack).any():
        return "not symmetric"
    root = np.sqrt(diag)
    if (np.abs(g) > root[:, :, None] * root[:, None, :] * (1 + GRAM_SLACK) + slack).any():
        return "not positive semidefinite (an entry exceeds sqrt(G_ii G_jj))"
    return ""


def by_name(layers: dict[str, Layer] | list[Layer]) -> dict[str, Layer]:
    """Layers keyed by ``Layer.name`` (module path; full parameter name for RNN and attention weights), from
    ``collect_layers``' dict (keyed by parameter name) or a list."""
    return {layer.name: layer for layer in (layers.values() if isinstance(layers, dict) else layers)}


def module_path(layer: Layer) -> tuple[str, str]:
    """(owning module path, parameter attribute name)."""
    return kinds.for_kind(layer.kind).module_path(layer)


SHARED_KEEP = 4  # recent inputs whose Gram is kept for the next layer reading the same tensor


class _Sum:
    """A running float64 sum that several accumulators may point at: q, k and v (gate and up) read one input
    tensor every batch, so they keep one Gram, not three. ``last`` is the product added in the current batch (None
    between batches), ``batches`` how many were added."""

    __slots__ = ("gram", "last", "batches", "users", "array")

    def __init__(self) -> None:
        self.gram: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.batches = 0
        self.users = 1
        self.array: np.ndarray | None = None  # the result, converted once for every accumulator pointing here


class NonFiniteInput(Exception):
    """A layer's input on a calibration batch holds NaN or infinite values (``activations``), or its product X^T X
    overflows ``dtype``; :meth:`StatisticsHooks.batch` turns it into one line naming the layer and the batch."""

    def __init__(self, layer: str, activations: bool, dtype: torch.dtype) -> None:
        super().__init__(layer)
        self.layer, self.activations, self.dtype = layer, activations, dtype

    def error(self, index: int | None) -> AuditError:
        batch = f"calibration batch {index}" if index is not None else "a calibration batch"
        if self.activations:
            return AuditError(f"the forward produced NaN or infinite values on {batch}: the input of layer "
                              f"{self.layer} holds them, so its statistics cannot be read",
                              "Check the model's weights and that batch's inputs (a float16/bf16 overflow: "
                              "--compute-dtype float32)")
        return AuditError(f"the input statistics of layer {self.layer} overflow "
                          f"{str(self.dtype).replace('torch.', '')} on {batch} (its inputs are finite but too large "
                          f"to square)", "Scale the inputs down, or read the statistics on the CPU (--device cpu, "
                          "float64 products)")


class _Acc:
    """A float64 Gram accumulator on the layer's device. ``batch_dtype``: the dtype each batch's X^T X is formed in
    (float64; float32 on a GPU), always added into a float64 sum."""

    def __init__(self, layer: Layer, n: int, groups: int = 1, diagonal: bool = False,
                 shared: dict[tuple[object, ...], object] | None = None) -> None:
        self.layer, self.n, self.groups, self.diagonal = layer, n, groups, diagonal
        self.sum: _Sum | None = None
        self.batches = 0  # products this accumulator has taken into its sum
        self.rows = 0
        self.approximate = ""
        self.shared = shared  # this batch's Grams by input tensor: q, k and v projections read one input once
        self.batch_dtype = torch.float64

    @property
    def gram(self) -> torch.Tensor | None:
        return self.sum.gram if self.sum is not None else None

    def _take(self, g: torch.Tensor, src: _Sum | None = None) -> None:
        """Add this batch's product ``g`` to the running sum. The first accumulator of a batch to add to a shared sum
        adds; the others that got the same product only count it; one that got another product leaves the shared
        sum (with its own history) first. ``src``: the sum of the accumulator that formed ``g``, joined when this
        accumulator has nothing yet and that sum holds ``g`` alone."""
        s = self.sum
        if s is None and src is not None and src.batches == 1 and src.last is g:
            self.sum, self.batches = src, 1
            src.users += 1
            return
        if s is not None and s.batches == self.batches + 1 and s.last is g:
            self.batches += 1  # already in the shared sum
            return
        if s is None or s.batches != self.batches:  # nothing yet, or the shared sum took another product this batch
            self._leave()
            s = self.sum = self.sum or _Sum()
        s.gram = g if s.gram is None else s.gram + g
        s.last = g
        s.batches += 1
        self.batches += 1

    def _leave(self) -> None:
        """Leave a shared sum that took one more product this batch than this accumulator: keep this one's history
        (the sum without that product) in a sum of its own."""
        s = self.sum
        if s is None or s.batches == self.batches:
            return
        s.users -= 1
        own = _Sum()
        own.batches = self.batches
        own.gram = None if self.batches == 0 else s.gram - s.last
        self.sum = own if self.batches else None

    def settle(self) -> None:
        """At the end of a batch: an accumulator whose shared sum took a product it did not get leaves it."""
        if self.sum is not None and self.sum.batches != self.batches:
            self._leave()

    def end_batch(self) -> None:
        if self.sum is not None:
            self.sum.last = None

    def add_rows(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """x: (rows, groups * n) or (rows, n), or (batch, positions, ...) with ``keep`` (batch, positions): the real
        positions (``attention_mask`` != 0), the only rows counted."""
        # the entry holds the tensor itself, so its memory cannot be reused by another tensor while the key lives
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version, x.dtype, self.groups, self.n)
        hit = self.shared.get(key) if self.shared is not None else None
        src = x
        x = kept_rows(x, keep)
        if hit is None:
            x = x.detach().reshape(-1, self.groups, self.n).to(self.batch_dtype)
            g = torch.einsum("rgi,rgj->gij", x, x) if self.groups > 1 else (x[:, 0].T @ x[:, 0])[None]
            g = g.to(torch.float64)
            if not bool(torch.isfinite(g).all()):
                raise NonFiniteInput(self.layer.name, not bool(torch.isfinite(x).all()), self.batch_dtype)
            self._take(g)
            if self.shared is not None:
                while len(self.shared) >= SHARED_KEEP:
                    self.shared.pop(next(iter(self.shared)))
                self.shared[key] = (src, g, self.sum)
        else:
            g = hit[1]
            x = x.reshape(-1, self.groups, self.n)
            self._take(g, hit[2])
        self.rows += x.shape[0]

    def add_counts(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        if keep is not None and ids.dim() == keep.dim() and ids.shape[0] == 1 and ids.shape[1:] == keep.shape[1:]:
            ids = ids.expand(keep.shape)  # positions looked up once for the batch (1, T): once per real token
        ids = kept_rows(ids, keep, 0)  # a pad looked up at a masked position is no lookup of the text
        c = torch.bincount(ids.detach().reshape(-1).long(), minlength=self.n).to(torch.float64)[: self.n]
        self._take(c)
        self.rows += ids.numel()

    def result(self) -> LayerInput | None:
        s = self.sum
        if s is None or s.gram is None:
            return None
        if s.array is None:
            s.array = s.gram.cpu().numpy()
        return LayerInput(self.layer.name, str(self.layer.kind), s.array, self.rows, self.n,
                          self.groups, self.diagonal, self.approximate)


def kept_rows(x: torch.Tensor, keep: torch.Tensor | None, features: int = 1) -> torch.Tensor:
    """``x`` at the real positions only, when it is (batch, positions, ``features`` more dimensions) with ``keep``
    (batch, positions) its leading dimensions; else as is (a layer whose rows are not the batch's positions, as a
    pooled (batch, width) input)."""
    if keep is None or x.dim() != keep.dim() + features or tuple(x.shape[:keep.dim()]) != tuple(keep.shape):
        return x
    return x[keep.to(x.device)]


def batch_mask(b: Batch) -> torch.Tensor | None:
    """The real positions of a batch: ``attention_mask`` != 0 when it is 2-D (batch, positions); None when there is
    none or it keeps every position (then nothing is selected, and the sums are bit for bit those without it)."""
    m = b.kwargs.get("attention_mask")
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        return None
    keep = m != 0
    return None if bool(keep.all()) else keep


class _Feeds:
    """What a layer kind reads its inputs through (:class:`auditor.kinds.Feeds`): accumulators owned by ``hooks``,
    the current batch's real positions, and forward pre-hooks that :meth:`StatisticsHooks.remove` takes off."""

    def __init__(self, hooks: "StatisticsHooks") -> None:
        self._hooks = hooks

    def rows(self, layer: Layer, n: int, groups: int = 1, shared: bool = False) -> _Acc:
        acc = self._hooks.accs[layer.name] = _Acc(layer, n, groups, shared=self._hooks._shared if shared else None)
        return acc

    def counts(self, layer: Layer, n: int) -> _Acc:
        acc = self._hooks.accs[layer.name] = _Acc(layer, n, diagonal=True)
        return acc

    def mask(self) -> torch.Tensor | None:
        return self._hooks._mask[0]

    def hook(self, mod: nn.Module, fn: Callable[..., None], with_kwargs: bool = False) -> None:
        self._hooks._handles.append(mod.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def missing(self, layer: Layer, reason: str) -> None:
        self._hooks.missing[layer.name] = reason


class StatisticsHooks:
    """Forward hooks that accumulate X^T X for ``layers`` while ``model`` (or any of its submodules) runs.

    The seam between what a layer kind reads (the hooks attached here) and how the batches are driven (one pass over
    the whole model in :func:`input_statistics`, or one block at a time): attach, run each batch inside
    ``with hooks.batch(mask):``, then :meth:`close` for the result. Layers with no statistics are in ``missing``."""

    def __init__(self, model: nn.Module, layers: dict[str, Layer] | list[Layer],
                 batch_dtype: torch.dtype = torch.float64) -> None:
        self.accs: dict[str, _Acc] = {}
        self.missing: dict[str, str] = {}
        self._shared: dict[tuple[object, ...], object] = {}
        self._handles: list["RemovableHandle"] = []
        self._mask: list[torch.Tensor | None] = [None]  # the current batch's real positions, for the hooks
        try:
            self._attach(model, list(by_name(layers).values()))
        except BaseException:
            self.remove()
            raise
        for acc in self.accs.values():
            acc.batch_dtype = batch_dtype

    def _attach(self, model: nn.Module, layer_list: list[Layer]) -> None:
        """Each layer's kind attaches what reads its inputs (auditor/kinds), once per owning module."""
        feeds = _Feeds(self)
        groups: dict[tuple[str, str], tuple[object, nn.Module, list[Layer]]] = {}
        for layer in layer_list:
            kind = kinds.for_kind(layer.kind)
            path, _ = kind.module_path(layer)
            try:
                mod = model.get_submodule(path)
            except AttributeError:
                self.missing[layer.name] = "no module of that name in the model"
                continue
            if not kind.accepts(mod):
                self.missing[layer.name] = f"no input statistics for {layer.module_type} ({layer.kind})"
                continue
            groups.setdefault((str(kind.kind), path), (kind, mod, []))[2].append(layer)
        for (_, path), (kind, mod, group) in groups.items():
            kind.statistics(path, mod, group, feeds)
        order = [layer.name for layer in layer_list]  # accumulators and reasons in the layers' order
        self.accs = {n: self.accs[n] for n in order if n in self.accs}
        self.missing = {n: self.missing[n] for n in order if n in self.missing}

    @contextmanager
    def batch(self, mask: torch.Tensor | None = None, index: int | None = None) -> Iterator[None]:
        """Run one batch through the hooked modules inside this block. ``mask``: (batch, positions) real positions
        (``attention_mask`` != 0), or None for every row. Inputs shared by several layers (q, k and v) are
        multiplied once per batch. A layer input holding NaN or infinite values raises :class:`AuditError` naming
        the layer and the batch (``index``)."""
        self._shared.clear()
        self._mask[0] = mask
        try:
            yield
        except NonFiniteInput as exc:
            raise exc.error(index) from None
        finally:
            self._shared.clear()
            self._mask[0] = None
            for acc in self.accs.values():
                acc.settle()
            for acc in self.accs.values():
                acc.end_batch()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self, batches: int = 0, digest: str = "") -> InputStatistics:
        """Remove the hooks and return what they accumulated."""
        self.remove()
        out = InputStatistics(batches=batches, digest=digest, missing=dict(self.missing))
        for name, acc in self.accs.items():
            res = acc.result()
            if res is None:
                out.missing[name] = "never called on the calibration inputs"
                continue
            out.layers[name] = res
            if res.rows < res.width:
                what = "lookups" if res.diagonal else "rows"
                out.warnings.append(f"{name} saw {res.rows} calibration {what}, fewer than its input width "
                                    f"{res.width}: its statistics are singular (damped); give more calibration data")
        return out


def input_statistics(model: nn.Module, layers: dict[str, Layer] | list[Layer], batches: Calibration | list[Batch],
                     progress: Callable[[int, int], None] | None = None,
                     batch_dtype: torch.dtype = torch.float64) -> InputStatistics:
    """One forward pass over ``batches`` (a ``Calibration``: its fit part), in eval mode, with hooks that accumulate
    X^T X in float64 for every layer they can read. Layers with no statistics are listed in ``missing`` with the reason.
    ``progress(done, total)`` is called after each batch."""
    digest = batches.digest if isinstance(batches, Calibration) else ""
    fit = batches.fit if isinstance(batches, Calibration) else list(batches)
    hooks = StatisticsHooks(model, layers, batch_dtype)
    try:
        with eval_mode(model):  # dropout off, batch norm on its running statistics; the caller's modes come back
            for i, b in enumerate(fit):
                with hooks.batch(batch_mask(b), i):
                    run(model, b)
                if progress is not None:
                    progress(i + 1, len(fit))
    finally:
        hooks.remove()
    return hooks.close(len(fit), digest)


__all__ = ["GramStore", "InputStatistics", "LayerInput", "StatisticsHooks", "batch_mask", "by_name", "conv_patches",
           "input_statistics", "kept_rows", "module_path"]
