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

import torch
from torch import nn

from .errors import AuditError, first_line
from .results import Kind, Layer


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
    """A checkpoint with no architecture code: tensors read one at a time through memory mapping."""

    name: str
    source: str
    index: dict[str, tuple[Path | None, tuple[int, ...], str]]  # tensor name -> (file, shape, dtype)
    state: dict[str, torch.Tensor] | None = None  # for .bin state dicts (already memory-mapped by torch.load)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path) -> "WeightsOnly":
        from safetensors import safe_open

        files: list[Path]
        if path.is_dir():
            idx = path / "model.safetensors.index.json"
            if idx.is_file():
                files = cls._shards(idx)
            else:
                files = sorted(path.glob("*.safetensors"))
        elif path.name.endswith(".index.json"):
            files = cls._shards(path)
        else:
            files = [path]
        index: dict[str, tuple[Path | None, tuple[int, ...], str]] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        sl = fh.get_slice(k)
                        index[k] = (f, tuple(sl.get_shape()), str(sl.get_dtype()))
            except Exception as exc:  # noqa: BLE001
                raise AuditError(f"{f} is not a readable safetensors file: {first_line(exc)}",
                                 "The file may be truncated or corrupt; download or write it again") from None
        notes = [f"Read {len(files)} safetensors file(s) through memory mapping, one tensor at a time."]
        return cls(path.stem if path.is_file() else path.name, str(path), index, notes=notes)

    @staticmethod
    def _shards(idx: Path) -> list[Path]:
        try:
            wm = json.loads(idx.read_text(encoding="utf-8"))["weight_map"]
        except Exception as exc:  # noqa: BLE001
            raise AuditError(f"cannot read shard index {idx}: {first_line(exc)}", "Check the index JSON") from None
        files = sorted({idx.parent / f for f in wm.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise AuditError(f"shard(s) missing from {idx.parent}: {', '.join(missing)}",
                             "Copy every shard named in model.safetensors.index.json")
        return files

    @classmethod
    def from_state_dict(cls, path: Path) -> "WeightsOnly":
        state = safe_torch_load(path)
        index = {k: (None, tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in state.items()}
        return cls(path.stem, str(path), index, state=state, notes=["Loaded with torch.load(weights_only=True)."])

    @property
    def total_params(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.index.values())

    def tensor(self, name: str) -> torch.Tensor:
        if self.state is not None:
            return self.state[name]
        from safetensors import safe_open

        f = self.index[name][0]
        with safe_open(str(f), framework="pt") as fh:
            return fh.get_tensor(name)

    def loader(self, layer: Layer) -> Callable[[], torch.Tensor]:
        return lambda: self.tensor(layer.param)

    def layers(self) -> dict[str, Layer]:
        out: dict[str, Layer] = {}
        for name, (_, shape, dtype) in self.index.items():
            if len(shape) < 2 or not any(s > 1 for s in shape):
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
                              m=m, n=n, view=view, dtype=dtype.lower().replace("torch.", ""))
        return out
