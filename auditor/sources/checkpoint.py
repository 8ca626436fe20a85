"""Checkpoints: the tensors of a weights file or checkpoint directory (safetensors, sharded or not, and torch state
dicts loaded with ``weights_only=True``), copied into a model (:func:`apply_weights`) or read with no architecture code
(:class:`WeightsOnly`); and :class:`Loaded`, what every model source resolves to.

The loaders of :mod:`auditor.sources` (factories, weight files) and :mod:`auditor.sources.hf` (Hugging Face directories) both
build on this module; it imports neither."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import weakref
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import AuditError, first_line
from .. import kinds
from ..results import Layer
from .tensorref import DTYPES, MAX_HEADER, TensorRef, inside, open_regular, read_header


@dataclass
class Loaded:
    """A resolved model source: the model (an ``nn.Module`` or :class:`WeightsOnly`), example inputs for tracing
    (or None), a display name, the source string, and notes on how it was loaded (missing or unused tensors,
    inputs made from the config, a structure-only build)."""

    model: Any  # nn.Module or WeightsOnly
    example_inputs: Any
    name: str
    source: str
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints applied to a model


@dataclass
class Checkpoint:
    """The tensors of a checkpoint by name, read one at a time through ``get`` (memory-mapped where possible)."""

    where: str
    names: list[str]
    get: Callable[[str], torch.Tensor]
    mapped: bool = False  # ``get`` returns the file's own pages (safetensors: private memory maps), never a copy
    files: tuple[str, ...] = ()  # the files ``get`` maps (safetensors), watched while their pages are the weights

    @classmethod
    def of_dict(cls, where: str, state: dict[str, torch.Tensor]) -> "Checkpoint":
        return cls(where, list(state), state.__getitem__)


NOT_WEIGHTS = re.compile(r"(training_args\.bin|optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state.*\.pth)$")
UNREADABLE = ("*.h5", "*.msgpack", "*.gguf", "*.ckpt", "*.onnx", "*.npz", "*.keras")


def open_checkpoint(location: str | Path, flag: bool = False) -> Checkpoint | None:
    """A weights file or checkpoint directory as a :class:`Checkpoint`; None for a directory without weights
    (an error instead when ``flag``: the user named it with ``--weights``)."""
    p = Path(location)
    label = f"--weights {location}" if flag else str(location)
    if not p.exists():
        raise AuditError(f"weights file {location} does not exist", "Check the --weights path")
    if p.is_file():
        if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json"):
            w = WeightsOnly.open(p)
            return Checkpoint(str(p), list(w.index), w.tensor, mapped=True, files=_files_of(w))
        if p.name.endswith(".bin.index.json"):
            return Checkpoint.of_dict(str(p), _bin_shards(p))
        return Checkpoint.of_dict(str(p), safe_torch_load(p))
    if (p / "model.safetensors.index.json").is_file() or list(p.glob("*.safetensors")):
        w = WeightsOnly.open(p)
        return Checkpoint(str(p), list(w.index), w.tensor, mapped=True, files=_files_of(w))
    if (p / "pytorch_model.bin.index.json").is_file():
        return Checkpoint.of_dict(str(p), _bin_shards(p / "pytorch_model.bin.index.json"))
    if (p / "pytorch_model.bin").is_file():
        return Checkpoint.of_dict(str(p / "pytorch_model.bin"), safe_torch_load(p / "pytorch_model.bin"))
    torch_files = sorted(f for ext in ("*.bin", "*.pt", "*.pth") for f in p.glob(ext)
                         if flag and f.is_file() and not NOT_WEIGHTS.match(f.name))
    if len(torch_files) == 1:
        return Checkpoint.of_dict(str(torch_files[0]), safe_torch_load(torch_files[0]))
    if len(torch_files) > 1:
        raise AuditError(f"{label} holds several checkpoint files ({', '.join(f.name for f in torch_files[:5])})",
                         "Name the one to load, e.g. --weights DIR/FILE")
    other = sorted(f.name for pat in UNREADABLE for f in p.glob(pat))
    if other:
        raise AuditError(f"{label} holds weights in a format the auditor does not read ({', '.join(other[:3])})",
                         "Convert them to safetensors (or a state dict saved with torch.save)")
    if flag:
        raise AuditError(f"{label} holds no weights (no .safetensors, pytorch_model.bin, .pt or .pth file)",
                         "Point --weights at the weights file or the checkpoint directory that holds it")
    return None


def _bin_shards(index: Path) -> dict[str, torch.Tensor]:
    """The shards of ``pytorch_model.bin.index.json``, each loaded with ``weights_only=True``; only plain file
    names beside the index are opened."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read shard index {index}: {first_line(exc)}", "Check the index JSON") from None
    files = sorted({str(f) for f in weight_map.values()})
    for f in files:
        if Path(f).name != f or f in ("", ".", ".."):
            raise AuditError(f"shard index {index} names {f!r}, which is not a file beside it",
                             "Shard names must be plain file names in the checkpoint directory")
        if not (index.parent / f).is_file():
            raise AuditError(f"shard {f} named in {index} is missing", "Copy every shard the index names")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(safe_torch_load(index.parent / f))
    return state


CHUNK_BYTES = 256 << 20  # tensors are copied into the model this many bytes at a time


def _listing(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... and {len(names) - most} more" if len(names) > most else "")


def apply_weights(model: nn.Module, ckpt: Checkpoint | None, partial: bool = False, prefix: str = "",
                  ignore_missing: Sequence[str] = (), ignore_unexpected: Sequence[str] = ()) -> list[str]:
    """Copy a checkpoint's tensors into ``model`` (through ``load_state_dict``, a chunk at a time, so peak memory
    is the model plus one chunk) and return notes. Every parameter must be covered, directly or through a tied
    name: otherwise :class:`AuditError` lists the missing ones, unless ``partial`` (then a note does). ``prefix``:
    a base-model prefix (Hugging Face ``base_model_prefix``) the checkpoint's names may have or lack.
    ``ignore_missing`` / ``ignore_unexpected``: regular expressions for names a checkpoint may lack or carry
    without a note (Hugging Face ``_keys_to_ignore_on_load_missing`` / ``_unexpected``)."""
    if ckpt is None:
        return []
    where = ckpt.where
    if not ckpt.names:
        raise AuditError(f"{where} holds no tensors", "Point at the checkpoint that holds the model's weights")
    missing, unexpected = _copy_tensors(model, ckpt, prefix)
    if unexpected and len(unexpected) >= len(ckpt.names):
        raise AuditError(f"none of the tensors in {where} match the model ({_listing(sorted(unexpected), 3)})",
                         "Use the config.json or factory that belongs to these weights")
    notes = _missing_notes(model, where, _truly_missing(model, missing, ignore_missing), partial)
    unexpected = {n for n in unexpected if not any(re.search(pat, n) for pat in ignore_unexpected)}
    if unexpected:
        notes.append(f"{len(unexpected)} tensor(s) in {where} are not part of the model and were ignored: "
                     f"{_listing(sorted(unexpected))}.")
    return notes


def _copy_tensors(model: nn.Module, ckpt: Checkpoint, prefix: str) -> tuple[set[str], set[str]]:
    """Copy the checkpoint into ``model`` a chunk of :data:`CHUNK_BYTES` at a time, and put a checkpoint tensor in
    place of each parameter that is on the meta device (:func:`parameters_on_meta`: no copy; every name tied to it
    too); returns the model's names nothing covered and the checkpoint's names the model lacks. A shape or dtype
    torch cannot copy is an error."""
    where = ckpt.where
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rename = _best_rename(ckpt.names, set(own), prefix)
    ties = _tie_groups(model)
    placed: set[str] = set()
    missing: set[str] | None = None
    unexpected: set[str] = set()
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal missing, size
        try:
            result = model.load_state_dict(chunk, strict=False)
        except Exception as exc:  # noqa: BLE001 - dtype or layout torch cannot copy
            raise AuditError(f"cannot copy the tensors of {where} into the model: {first_line(exc)}",
                             "Use the weights that belong to this model") from None
        missing = set(result.missing_keys) if missing is None else missing & set(result.missing_keys)
        unexpected.update(result.unexpected_keys)
        chunk.clear()
        size = 0

    for name in ckpt.names:
        key = rename(name)
        if key not in own:
            unexpected.add(key)
            continue
        t = ckpt.get(name)
        if tuple(t.shape) != own[key]:
            raise AuditError(f"tensor {name} in {where} has shape {tuple(t.shape)} but the model has "
                             f"{own[key]}", "Use the config.json or factory that belongs to these weights")
        if key in ties:
            placed |= _place(model, ties[key], t, ckpt.mapped)
            continue
        chunk[key] = t
        size += t.numel() * t.element_size()
        if size >= CHUNK_BYTES:
            flush()
    if chunk or missing is None:
        flush()
    return (missing or set()) - placed, unexpected


MAP_MIN_BYTES = 1 << 30  # weights at least this large are mapped, not copied (where memory matters; a smaller
#                          model is copied, so nothing that later writes its checkpoint can reach its weights)
_WATCHED: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, int, int, int]]]" = weakref.WeakKeyDictionary()


def _files_of(w: "WeightsOnly") -> tuple[str, ...]:
    return tuple(sorted({str(f) for f, _, _ in w.index.values() if f is not None and str(f)}))


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def watch_mapped(model: nn.Module, ckpt: Checkpoint) -> None:
    """Remember the identity (device, inode, size, modification time) of the files ``model``'s weights are mapped
    from, for :func:`check_mapped`."""
    _WATCHED[model] = {os.path.abspath(f): _identity(f) for f in ckpt.files}  # a later chdir changes nothing


def check_mapped(model: nn.Module) -> None:
    """An :class:`AuditError` if a file ``model``'s weights are mapped from was written, replaced or removed since the
    load: a mapped page shows the file as it is now, so the audit may have read two versions of the weights (a
    truncated file would even stop the process when a page past its end is read)."""
    if not isinstance(model, nn.Module):  # weights only: read tensor by tensor, nothing mapped into a model
        return
    for path, before in (_WATCHED.get(model) or {}).items():
        try:
            now = _identity(path)
        except OSError:
            now = None
        if now != before:
            raise AuditError(f"the checkpoint file {path} changed while it was audited (its weights are read from "
                             "the file as the audit runs), so the numbers may mix two versions of the weights",
                             "Audit it again while nothing writes to it, or audit a copy of the checkpoint")


# parameters that are a checkpoint file's own pages, by id (an entry leaves with its parameter)
MAPPED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def mapped_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters that are pages of a checkpoint file (memory-mapped, private: read from the
    file as they are touched, dropped by the kernel under pressure and read again; never anonymous memory)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if MAPPED.get(id(p)) is p)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` a module registers while this runs is put on the meta device, so building a model
    allocates and initialises no weights (a 7B model's 13 GB of random values took minutes); buffers stay where they
    are made (a rotary embedding's ``inv_freq`` is computed by its constructor, not loaded). The checkpoint's tensors
    then take the parameters' places (:func:`apply_weights`)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and type(p) is nn.Parameter and p.device.type != "meta":
            moved = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
            moved.__dict__.update(p.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def covers(model: nn.Module, ckpt: Checkpoint, prefix: str) -> bool:
    """Whether every parameter of ``model`` (under one of its tied names) is among the checkpoint's tensors in the
    model's dtype and shape, so that each can be the file's pages as they are (a tensor to cast would be a copy, and
    the memory a build needs would be the model's). The tensors are opened (mapped), none of their pages read."""
    names = dict(model.named_parameters(remove_duplicate=False))
    rename = _best_rename(ckpt.names, set(names), prefix)
    present = {rename(n): n for n in ckpt.names}
    for group in set(_tie_groups(model).values()):
        found = next((n for n in group if n in present), None)
        if found is None:
            return False
        t, p = ckpt.get(present[found]), names[found]
        if t.dtype != p.dtype or tuple(t.shape) != tuple(p.shape):
            return False
    return True


def _tie_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter on the meta device -> every name of that parameter (tied weights share one)."""
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.device.type == "meta":
            groups.setdefault(id(p), []).append(n)
    return {n: tuple(g) for g in groups.values() for n in g}


def _place(model: nn.Module, names: tuple[str, ...], t: torch.Tensor, mapped: bool) -> set[str]:
    """``t`` as the parameter under every one of ``names`` (one tensor: ties kept), cast where the model's dtype
    differs (a copy then); returns the names placed."""
    first = model.get_parameter(names[0])
    if first.device.type != "meta":  # placed already under another of its names
        return set(names)
    data = t.detach() if t.dtype == first.dtype else t.detach().to(first.dtype)
    param = nn.Parameter(data, requires_grad=first.requires_grad)
    if mapped and data.data_ptr() == t.data_ptr():
        MAPPED[id(param)] = param
    for n in names:
        path, _, attr = n.rpartition(".")
        setattr(model.get_submodule(path) if path else model, attr, param)
    return set(names)


def _missing_notes(model: nn.Module, where: str, lost: set[str], partial: bool) -> list[str]:
    """Notes on the parameters and buffers the checkpoint lacks; lacking parameters is an error unless ``partial``."""
    notes: list[str] = []
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    order = [*params, *(n for n, _ in model.named_buffers(remove_duplicate=False))]  # the model's own order
    lost_params = [n for n in order if n in lost and n in params]
    lost_buffers = [n for n in order if n in lost and n not in params]
    if lost_params:
        total = sum(p.numel() for p in model.parameters())
        share = sum(params[n].numel() for n in lost_params) / total if total else 0.0
        what = (f"{where} lacks {len(lost_params)} of the model's parameter tensors ({100 * share:.1f}% of its "
                f"parameters): {_listing(lost_params)}")
        if not partial:
            raise AuditError(what, "Give the complete checkpoint (every shard) and the config it belongs to; a partial "
                                   "audit (--partial) leaves those tensors at random initial values")
        notes.append(f"Partial audit: {what}. They keep random initial values: their spectra describe noise.")
    if lost_buffers:
        notes.append(f"{where} lacks {len(lost_buffers)} buffer(s), which keep their initial values: "
                     f"{_listing(lost_buffers)}.")
    return notes


def _best_rename(names: Sequence[str], own: set[str], prefix: str) -> Callable[[str], str]:
    """Checkpoints of a task model audited as its base model (or the reverse) differ by ``prefix.``: pick the
    renaming under which most names match the model."""
    if not prefix:
        return lambda n: n
    p = prefix + "."
    options: list[Callable[[str], str]] = [lambda n: n, lambda n: n[len(p):] if n.startswith(p) else n,
                                           lambda n: n if n.startswith(p) else p + n]
    scores = [sum(f(n) in own for n in names) for f in options]
    return options[scores.index(max(scores))]


def _truly_missing(model: nn.Module, missing: set[str], ignore: Sequence[str]) -> set[str]:
    """Missing names, less those tied to a loaded name (one tensor under two names) and those matching
    ``ignore``."""
    groups: dict[int, set[str]] = {}
    group_of: dict[str, set[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        group_of[n] = groups.setdefault(id(t), set())
        group_of[n].add(n)
    out = set()
    for n in missing:
        if any(re.search(pat, n) for pat in ignore):
            continue
        if not group_of.get(n, {n}) - missing:  # no name of this tensor was loaded
            out.add(n)
    return out


def safe_torch_load(path: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only; nothing in the file is executed.
    Zip checkpoints are memory-mapped; legacy (pre-1.6, non-zip) files are read whole, also ``weights_only``."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        raise AuditError(
            f"refused to load {path}: it needs full unpickling, which can run code ({first_line(exc)[:120]})",
            "Convert it to safetensors, or re-save a plain state_dict that torch.load(weights_only=True) accepts",
        ) from None
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read checkpoint {path}: {first_line(exc)}",
                         "Check that the file is a complete torch checkpoint") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise AuditError(f"{path} does not hold a state dict of tensors", "Save model.state_dict()")
    odd = [k for k in obj if not isinstance(k, str)]
    if odd:
        raise AuditError(f"{path} has {len(odd)} tensor name(s) that are not strings, e.g. {odd[0]!r}",
                         "Save model.state_dict(), whose keys are parameter names")
    return obj


# ---------------------------------------------------------------------------------------------------------------
# Weights only


@dataclass
class WeightsOnly:
    """A checkpoint with no architecture code: each safetensors header parsed once, tensors read one at a time
    through memory mapping, and handed to the spectral engine as picklable :class:`TensorRef` file references.

    Byte-identical matrices (the same tied tensor saved twice, e.g. in two shards) are one layer, found by content
    hash (BLAKE3), the other names listed as its aliases and its parameters counted once."""

    name: str
    source: str
    index: dict[str, tuple[Path | None, tuple[int, ...], str]]  # tensor name -> (file, shape, dtype)
    state: dict[str, torch.Tensor] | None = None  # for .bin state dicts (already memory-mapped by torch.load)
    notes: list[str] = field(default_factory=list)
    refs: dict[str, TensorRef] = field(default_factory=dict)  # tensor name -> file reference (safetensors)
    _ties: dict[str, str] | None = None  # duplicate name -> canonical name, once computed

    @classmethod
    def open(cls, path: Path) -> "WeightsOnly":
        weight_map: dict[str, str] | None = None
        files: list[Path]
        if path.is_dir():
            idx = path / "model.safetensors.index.json"
            if idx.is_file():
                files, weight_map = _shards(idx)
            else:
                files = sorted(path.glob("*.safetensors"))
        elif path.name.endswith(".index.json"):
            files, weight_map = _shards(path)
        else:
            files = [path]
        refs: dict[str, TensorRef] = {}
        for f in files:
            for k, ref in read_header(f).items():
                if k in refs and (weight_map is None or weight_map.get(k) == Path(refs[k].path or "").name):
                    if weight_map is None:
                        raise AuditError(f"tensor {k} is in both {Path(refs[k].path or '').name} and {f.name}",
                                         "Keep each tensor in one file, or add a model.safetensors.index.json")
                    continue  # the index names the other shard for it
                refs[k] = ref
        if weight_map is not None:
            lost = [k for k, fname in weight_map.items() if k not in refs or Path(refs[k].path or "").name != fname]
            if lost:
                raise AuditError(f"{len(lost)} tensor(s) named in the shard index are not in their shard: "
                                 f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}",
                                 "Copy the complete checkpoint, or fix model.safetensors.index.json")
        index = {k: (Path(r.path or ""), r.shape, _ST_CODES.get(r.dtype, r.dtype.upper())) for k, r in refs.items()}
        notes = [f"Read {len(files)} safetensors file(s) through memory mapping, one tensor at a time."]
        return cls(path.stem if path.is_file() else path.name, str(path), index, notes=notes, refs=refs)

    @classmethod
    def from_state_dict(cls, path: Path) -> "WeightsOnly":
        state = safe_torch_load(path)
        index = {k: (None, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in state.items()}
        return cls(path.stem, str(path), index, state=state, notes=["Loaded with torch.load(weights_only=True)."])

    @property
    def total_params(self) -> int:
        dups = self.ties()
        return sum(math.prod(s) for k, (_, s, _) in self.index.items() if k not in dups)

    def _ref(self, name: str) -> TensorRef:
        if self.state is not None:
            t = self.state[name]
            return TensorRef.of_tensor(t, name, "", 0, 0)
        return self.refs[name]

    def tensor(self, name: str) -> torch.Tensor:
        return self._ref(name).load()

    def ref(self, layer: Layer) -> TensorRef:
        """A picklable reference to the layer's tensor with its matrix view: a worker can read it alone."""
        return self._ref(layer.param).with_view(str(layer.kind), layer.m, layer.n, layer.groups)

    def loader(self, layer: Layer) -> Callable[[], torch.Tensor]:
        return self.ref(layer)  # a TensorRef is callable; the spectral engine takes it as the reference it is

    def ties(self) -> dict[str, str]:
        """Tied tensors: duplicate name -> canonical (first) name, for every tensor, vectors and scalars included
        (a tied bias is counted once too). In a state dict, tensors sharing one storage (same offset, shape, stride
        and dtype) are tied whatever they hold. Otherwise byte-identical tensors of one shape and dtype are: a 16 KiB
        sample at three places rules most out, then BLAKE3 of all the bytes decides. Constant tensors (every
        element the same: all zeros, all ones, a scalar) are left apart unless they share storage: such equality
        comes from initialisation, not from tying."""
        if self._ties is not None:
            return self._ties
        ties = _storage_ties(self.state) if self.state is not None else {}
        ties.update(_content_ties(self.index, self._ref, skip=ties))
        self._ties = ties
        if ties:
            shown = ", ".join(f"{k} = {v}" for k, v in list(ties.items())[:5])
            self.notes.append(f"{len(ties)} byte-identical tensor(s) counted once, as aliases (BLAKE3): {shown}"
                              + (" ..." if len(ties) > 5 else ""))
        return ties

    def layers(self) -> dict[str, Layer]:
        ties = self.ties()
        aliases: dict[str, list[str]] = {}
        for k, canon in ties.items():
            aliases.setdefault(canon, []).append(k)
        out: dict[str, Layer] = {}
        for name, (_, shape, dtype) in self.index.items():
            if len(shape) < 2 or not any(s > 1 for s in shape) or name in ties:
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            found = kinds.guess(name, tuple(shape))  # the kinds read the name and shape (auditor/kinds)
            if found is None:
                continue
            kind_of, m, n, view = found
            kind = kind_of.kind
            out[name] = Layer(name=base, param=name, kind=kind, module_type="tensor", shape=tuple(shape),
                              m=m, n=n, view=view, dtype=dtype.lower().replace("torch.", ""),
                              aliases=aliases.get(name, []))
        return out


def _shards(idx: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files an index names, all inside its folder. Entries that are absolute or lead outside the
    folder (``..``, symlinks) are refused with one line that says nothing about the file outside."""
    try:
        fd = open_regular(idx)
        try:
            raw = b""
            while chunk := os.read(fd, 1 << 20):
                raw += chunk
                if len(raw) > MAX_HEADER:
                    raise ValueError("larger than 100 MB")
        finally:
            os.close(fd)
        doc = json.loads(raw.decode("utf-8"))
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read shard index {idx}: {first_line(exc)}", "Check the index JSON") from None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise AuditError(f"shard index {idx} has no weight_map of tensor names to file names",
                         'Write "weight_map": {"tensor.name": "model-00001-of-00002.safetensors", ...}')
    if not wm:
        raise AuditError(f"shard index {idx} has an empty weight_map", "Write the index that names every tensor")
    folder = idx.parent
    for fname in sorted(set(wm.values())):
        if inside(folder, fname) is None:
            raise AuditError(f"shard index {idx} names {fname!r}, which is not a file inside {folder}",
                             "Shards must sit in the index's folder; give plain file names")
    files = sorted({folder / f for f in wm.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise AuditError(f"shard(s) missing from {idx.parent}: {', '.join(missing)}",
                         "Copy every shard named in model.safetensors.index.json")
    return files, wm


# ---------------------------------------------------------------------------------------------------------------
# Tied tensors of a weights-only checkpoint


def _storage_ties(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Tensors of a state dict that share one storage (same offset, shape, stride and dtype): duplicate name ->
    the first name, whatever they hold."""
    ties: dict[str, str] = {}
    shared: dict[tuple, str] = {}
    for k, t in state.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0 \
                or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in shared:
            ties[k] = shared[key]
        else:
            shared[key] = k
    return ties


def _content_ties(index: dict[str, tuple[Path | None, tuple[int, ...], str]], ref_of: Callable[[str], TensorRef],
                  skip: dict[str, str]) -> dict[str, str]:
    """Byte-identical tensors of one shape and dtype (those in ``skip`` left out): a 16 KiB sample at three places
    rules most out, then BLAKE3 of all the bytes decides; constant tensors are left apart. Duplicate -> first."""
    from blake3 import blake3

    ties: dict[str, str] = {}
    groups: dict[tuple, list[str]] = {}
    for k, (_, shape, dtype) in index.items():
        if k in skip or ref_of(k).layout != "strided" or math.prod(shape) < 2:
            continue  # sparse or other layouts: no bytes to compare (skipped later); a scalar is constant
        groups.setdefault((tuple(shape), dtype), []).append(k)
    for names in groups.values():
        if len(names) < 2:
            continue
        by_sample: dict[bytes, list[str]] = {}
        for k in names:
            by_sample.setdefault(_sample(ref_of(k)), []).append(k)
        for same in by_sample.values():
            if len(same) < 2:
                continue
            by_hash: dict[str, list[str]] = {}
            for k in same:
                raw = ref_of(k).raw_bytes()
                if not raw or _constant(raw, math.prod(index[k][1])):
                    continue
                h = blake3(max_threads=blake3.AUTO if len(raw) > 4 << 20 else 1)
                h.update(raw)
                by_hash.setdefault(h.hexdigest(), []).append(k)
            for dup in by_hash.values():
                for k in dup[1:]:
                    ties[k] = dup[0]
    return ties


def _sample(ref: TensorRef) -> bytes:
    """16 KiB from the start, middle and end of a tensor's bytes."""
    size, n = ref.nbytes, 16 << 10
    spots = sorted({0, max(0, size // 2 - n // 2), max(0, size - n)})
    if ref.path is None:
        raw = ref.raw_bytes()
        return b"".join(bytes(raw[s : s + n]) for s in spots)
    fd = open_regular(ref.path)
    try:
        return b"".join(os.pread(fd, min(n, size - s), ref.offset + s) for s in spots)
    finally:
        os.close(fd)

def _constant(raw: memoryview, numel: int) -> bool:
    """Whether every element of a tensor's bytes is the same value (all zeros, all ones, one number repeated)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    if numel < 1 or a.size % numel:
        return False
    item = a.size // numel
    head = a[: (min(numel, 4096)) * item].reshape(-1, item)
    if not (head == head[0]).all():
        return False  # the common case, decided on the first 4096 elements
    for lo in range(0, numel, 1 << 20):  # in slices: no full-size temporary for a large tensor
        rows = a[lo * item: min(numel, lo + (1 << 20)) * item].reshape(-1, item)
        if not (rows == head[0]).all():
            return False
    return True


_ST_CODES = {torch_name: code for code, (torch_name, _) in DTYPES.items()}
