"""Model sources: a Python factory, a Hugging Face config or checkpoint directory, a safetensors file or sharded
checkpoint (weights only), torchvision and timm names. Never uses the network; never unpickles code."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .errors import AuditError, first_line
from .results import Kind, Layer
from .tensorref import DTYPES, MAX_HEADER, TensorRef, inside, open_regular, read_header


@dataclass
class Loaded:
    model: Any  # nn.Module or WeightsOnly
    example_inputs: Any
    name: str
    source: str


def parse_shape(text: str, flag: str) -> tuple[int, ...]:
    tokens = [t.strip() for t in text.replace("x", ",").split(",")]
    dims = tuple(int(t) for t in tokens) if all(t.isdigit() for t in tokens) else ()
    if not dims or any(d <= 0 for d in dims):
        raise AuditError(f"{flag} {text!r} is not a shape", f"Give positive integers separated by commas, e.g. {flag} 1,3,224,224")
    return dims


def load_source(
    spec: str,
    input_shape: list[tuple[int, ...]] | None = None,
    input_ids: tuple[int, ...] | None = None,
    weights: str | None = None,
    structure_only: bool = False,
) -> Loaded:
    """Resolve a source string to a model and example inputs.

    - ``path/to/file.py:factory`` or ``package.module:factory``: a callable returning an ``nn.Module`` or
      ``(module, example_inputs)``;
    - a directory with ``config.json`` (weights loaded if present), or a bare ``config.json``: a Hugging Face model;
    - a ``.safetensors`` file, a directory of safetensors shards, or a ``.bin``/``.pt`` state dict: weights only;
    - ``torchvision:NAME`` or ``timm:NAME``: random init, ``--weights FILE`` loads a state dict.
    """
    path = Path(spec)
    if spec.startswith(("torchvision:", "timm:")):
        lib, name = spec.split(":", 1)
        model = _zoo(lib, name)
        if weights:
            _load_state(model, weights)
        return Loaded(model, _inputs(None, input_shape, input_ids), name, spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf(path / "config.json", path, input_shape, input_ids, structure_only)
        if list(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
            return Loaded(WeightsOnly.open(path), None, path.name, str(path))
        raise AuditError(f"{spec} is a directory without config.json or safetensors files",
                         "Point to a Hugging Face checkpoint directory, a safetensors file, or file.py:factory")
    if path.suffix == ".json" and not spec.endswith(".safetensors.index.json"):
        if not path.is_file():
            raise AuditError(f"config file {spec} does not exist", "Check the path")
        return _hf(path, None, input_shape, input_ids, structure_only)
    if path.suffix == ".safetensors" or spec.endswith(".safetensors.index.json"):
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return Loaded(WeightsOnly.open(path), None, path.stem, str(path))
    if path.suffix in (".bin", ".pt", ".pth") and ":" not in path.name:
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return Loaded(WeightsOnly.from_state_dict(path), None, path.stem, str(path))
    if ":" in spec:
        return _factory(spec, input_shape, input_ids, weights)
    raise AuditError(f"cannot tell what kind of model source {spec!r} is",
                     "Use file.py:factory, package.module:factory, a Hugging Face directory or config.json, "
                     "a .safetensors file, or torchvision:NAME / timm:NAME")


# ---------------------------------------------------------------------------------------------------------------
# Python factories


def _factory(spec: str, input_shape: Any, input_ids: Any, weights: str | None) -> Loaded:
    target, _, attr = spec.rpartition(":")
    if not attr.isidentifier():
        raise AuditError(f"{spec!r} does not name a factory after the colon", "Use file.py:factory_function")
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            raise AuditError(f"file {target} does not exist", "Check the path to the Python file")
        mod_name = f"_lowrank_factory_{abs(hash(str(file.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(mod_name, file)
        assert spec_obj is not None and spec_obj.loader is not None
        module = importlib.util.module_from_spec(spec_obj)
        sys.path.insert(0, str(file.parent.resolve()))
        try:
            spec_obj.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's file failed to import
            raise AuditError(f"importing {target} failed: {first_line(exc)}", "Fix the error in that file") from None
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001
            raise AuditError(f"cannot import module {target}: {first_line(exc)}",
                             "Check the module path and that its package is installed") from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        import difflib

        close = difflib.get_close_matches(attr, names, n=3)
        hint = f"Did you mean {', '.join(close)}?" if close else f"Callables there: {', '.join(names[:8]) or 'none'}"
        raise AuditError(f"{target} has no factory named {attr!r}", hint)
    if not callable(fn):
        raise AuditError(f"{target}:{attr} is not callable", "Name a function that returns an nn.Module")
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"factory {attr}() raised {first_line(exc)}", "Fix the factory so it builds the model") from None
    example = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        out, example = out
    if not isinstance(out, nn.Module):
        raise AuditError(f"factory {attr}() returned {type(out).__name__}, not a torch.nn.Module",
                         "Return an nn.Module, or (module, example_inputs)")
    if weights:
        _load_state(out, weights)
    inputs = _inputs(None, input_shape, input_ids) if (input_shape or input_ids) else example
    return Loaded(out, inputs, type(out).__name__, spec)


def _inputs(config: Any, input_shape: Any, input_ids: Any) -> Any:
    gen = torch.Generator().manual_seed(0)
    if input_ids is not None:
        vocab = getattr(config, "vocab_size", None) or 1000
        ids = torch.randint(0, vocab, tuple(input_ids), generator=gen)
        if config is None:
            return (ids,)
        kw: dict[str, Any] = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            kw["decoder_input_ids"] = torch.randint(0, vocab, tuple(input_ids), generator=gen)
        return kw
    if input_shape:
        tensors = [torch.randn(tuple(s), generator=gen) for s in input_shape]
        if config is not None:
            return {"pixel_values": tensors[0]}
        return tuple(tensors)
    return None


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face


def _hf(config_file: Path, folder: Path | None, input_shape: Any, input_ids: Any, structure_only: bool) -> Loaded:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
    except ImportError:
        raise AuditError("transformers is not installed", "pip install transformers") from None
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ValueError("no 'model_type' key")
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read the Hugging Face config {config_file}: {first_line(exc)}",
                         "Give a config.json written by transformers (it needs a model_type)") from None
    if hasattr(config, "use_cache"):
        config.use_cache = False
    archs = list(getattr(config, "architectures", None) or [])
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    try:
        ctx = torch.device("meta") if structure_only else _nullctx()
        torch.manual_seed(0)  # a config without weights gets the same random init every run: reproducible audits
        with ctx:
            model = cls._from_config(config) if cls is not None else transformers.AutoModel.from_config(config)
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot build a model from {config_file}: {first_line(exc)}",
                         "Check the config's model_type and sizes") from None
    name = archs[0] if archs else type(model).__name__
    if folder is not None and not structure_only:
        state = _folder_state(folder)
        if state is not None:
            _apply_state(model, state, str(folder))
    inputs = _inputs(config, input_shape, input_ids)
    if structure_only and isinstance(inputs, dict):
        # meta inputs for a meta model: torch.export traces shapes only, so MACs come without allocating anything
        inputs = {k: v.to("meta") for k, v in inputs.items()}
    return Loaded(model, inputs, name, str(folder or config_file))


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _folder_state(folder: Path) -> dict[str, torch.Tensor] | None:
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        w = WeightsOnly.open(folder)
        return {n: w.tensor(n) for n in w.index}
    if (folder / "pytorch_model.bin").is_file():
        return safe_torch_load(folder / "pytorch_model.bin")
    return None


def _apply_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    own = dict(model.state_dict())
    for k, v in state.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise AuditError(f"tensor {k} in {where} has shape {tuple(v.shape)} but the config builds "
                             f"{tuple(own[k].shape)}", "Use the config.json that belongs to these weights")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [m for m in missing if m not in tied]
    if unexpected and len(unexpected) == len(state):
        raise AuditError(f"none of the tensors in {where} match the model built from its config",
                         "Use the config.json that belongs to these weights")


def safe_torch_load(path: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only; nothing in the file is executed."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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
    return obj


def _load_state(model: nn.Module, weights: str) -> None:
    p = Path(weights)
    if not p.exists():
        raise AuditError(f"weights file {weights} does not exist", "Check the --weights path")
    if p.suffix == ".safetensors" or p.is_dir():
        w = WeightsOnly.open(p)
        state = {n: w.tensor(n) for n in w.index}
    else:
        state = safe_torch_load(p)
    _apply_state(model, state, weights)


def _zoo(lib: str, name: str) -> nn.Module:
    torch.manual_seed(0)  # reproducible random init
    try:
        if lib == "torchvision":
            import torchvision.models as tvm

            return tvm.get_model(name, weights=None)
        import timm

        return timm.create_model(name, pretrained=False)
    except ImportError as exc:
        raise AuditError(f"{lib} cannot be imported ({first_line(exc)})", f"pip install {lib}") from None
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"{lib} has no model {name!r}: {first_line(exc)}", f"List names with {lib}'s model registry") from None


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
                files, weight_map = cls._shards(idx)
            else:
                files = sorted(path.glob("*.safetensors"))
        elif path.name.endswith(".index.json"):
            files, weight_map = cls._shards(path)
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

    @staticmethod
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
        """Byte-identical matrices: duplicate name -> canonical (first) name. Candidates share shape and dtype; a
        16 KiB sample at three places rules most out, then BLAKE3 of all the bytes decides. All-zero tensors are
        left apart (identical by content, not by tying)."""
        if self._ties is not None:
            return self._ties
        from blake3 import blake3

        groups: dict[tuple, list[str]] = {}
        for k, (_, shape, dtype) in self.index.items():
            if len(shape) >= 2 and any(s > 1 for s in shape):
                groups.setdefault((shape, dtype), []).append(k)
        ties: dict[str, str] = {}
        for names in groups.values():
            if len(names) < 2:
                continue
            by_sample: dict[bytes, list[str]] = {}
            for k in names:
                by_sample.setdefault(self._sample(k), []).append(k)
            for same in by_sample.values():
                if len(same) < 2:
                    continue
                by_hash: dict[str, list[str]] = {}
                for k in same:
                    raw = self._ref(k).raw_bytes()
                    if not raw or not np.frombuffer(raw, dtype=np.uint8).any():
                        continue
                    h = blake3(max_threads=blake3.AUTO if len(raw) > 4 << 20 else 1)
                    h.update(raw)
                    by_hash.setdefault(h.hexdigest(), []).append(k)
                for dup in by_hash.values():
                    for k in dup[1:]:
                        ties[k] = dup[0]
        self._ties = ties
        if ties:
            shown = ", ".join(f"{k} = {v}" for k, v in list(ties.items())[:5])
            self.notes.append(f"{len(ties)} byte-identical tensor(s) counted once, as aliases (BLAKE3): {shown}"
                              + (" ..." if len(ties) > 5 else ""))
        return ties

    def _sample(self, name: str) -> bytes:
        """16 KiB from the start, middle and end of a tensor's bytes."""
        ref = self._ref(name)
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
            low = name.lower()
            if len(shape) == 2:
                m, n = shape
                emb = any(w in low for w in ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings", "shared"))
                kind = Kind.EMBEDDING if emb else Kind.TENSOR
                view = "2-D tensor as stored"
            else:
                m, n = shape[0], math.prod(shape[1:])
                kind = Kind.CONV
                view = f"{len(shape)}-D kernel viewed as dim0 x prod(rest)"
            out[name] = Layer(name=base, param=name, kind=kind, module_type="tensor", shape=tuple(shape),
                              m=m, n=n, view=view, dtype=dtype.lower().replace("torch.", ""),
                              aliases=aliases.get(name, []))
        return out


_ST_CODES = {torch_name: code for code, (torch_name, _) in DTYPES.items()}
