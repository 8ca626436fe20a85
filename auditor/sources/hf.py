"""Hugging Face sources: a ``config.json`` (with its weights, if any) built into a model, offline and without
remote code. A config without weights is built on the meta device (structure only); with weights, the memory
the model needs is estimated on the meta device first and the build refused if it would not fit."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import AuditError, first_line
from . import checkpoint
from .checkpoint import (CHUNK_BYTES, Loaded, apply_weights, covers, open_checkpoint, parameters_on_meta,
                         watch_mapped)
from .factory import float_dtype

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code", "custom_pipelines")
SAFE_ATTENTION = ("eager", "sdpa")  # anything else may fetch a kernel from the Hub (flash_* falls back to one)
DEFAULT_SEQUENCE = 128
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Force Hugging Face offline, whatever the environment says (``HF_HUB_OFFLINE=0`` included), and restore
    the environment afterwards. huggingface_hub reads the variable once at import, so its constant is set too."""
    saved = {k: os.environ.get(k) for k in OFFLINE_VARS}
    for k in OFFLINE_VARS:
        os.environ[k] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    constants: Any = None
    before = None
    try:
        import huggingface_hub.constants as constants

        before = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - transformers always brings huggingface_hub
        constants = None
    try:
        yield
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = before
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def neutralise(raw: Any, where: str = "") -> list[str]:
    """Remove from a config dict (in place, nested configs included) what would fetch or run code: ``auto_map``
    and ``trust_remote_code`` (custom modelling code), and attention or expert implementations naming Hub kernels
    (anything but eager/sdpa for attention; anything with ``/`` or ``:`` otherwise). Returns what was removed."""
    removed: list[str] = []
    if isinstance(raw, dict):
        for key in list(raw):
            value = raw[key]
            name = f"{where}{key}"
            if key in REMOTE_CODE_KEYS:
                del raw[key]
                removed.append(name)
            elif isinstance(key, str) and key.endswith(("_implementation", "_implementation_internal")):
                attention = "attn" in key
                if value is not None and (not isinstance(value, str) or (value not in SAFE_ATTENTION if attention
                                                                         else ("/" in value or ":" in value))):
                    del raw[key]
                    removed.append(f"{name}={value!r}")
            else:
                removed += neutralise(value, f"{name}.")
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            removed += neutralise(value, f"{where}{i}.")
    return removed


def _config_objects(config: Any) -> list[Any]:
    out = [config]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out += _config_objects(sub)
    return out


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of MemAvailable, the cgroup's limit less its usage (the OOM
    killer acts on the cgroup) and the address space RLIMIT_AS leaves; None where none can be read."""
    values: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                values.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                values.append(max(0, int(limit) - int(Path(usage_file).read_text().strip())))
    values += _address_space_left()
    return min(values) if values else None


def _address_space_left() -> list[int]:
    """What RLIMIT_AS (``ulimit -v``, a job's memory cap) still lets this process map, as a one-item list; empty
    where there is no such limit or it cannot be read."""
    import resource

    with contextlib.suppress(OSError, ValueError, IndexError, AttributeError):
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            return []
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return [max(0, soft - int(line.split()[1]) * 1024)]
        return [soft]
    return []


def model_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers take once materialised (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def load_hf(config_file: Path, folder: Path | None, input_shape: Any, input_ids: Any, weights: str | None,
            structure_only: bool, partial: bool, auto_inputs: bool = True) -> Loaded:
    """Build the model a ``config.json`` describes (see :func:`auditor.sources.load_source`), offline, with no code
    from the checkpoint, and load its weights (from ``weights``, else from ``folder``) if there are any."""
    with offline():
        try:
            import transformers
        except ImportError:
            raise AuditError("transformers is not installed", "pip install transformers") from None
        notes: list[str] = []
        config, name = _read_config(transformers, config_file, notes)
        archs = list(getattr(config, "architectures", None) or [])
        cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
        ckpt = None
        if structure_only:
            if weights:
                notes.append(f"Structure only: the weights in {weights} were not read.")
        else:
            ckpt = open_checkpoint(weights, flag=True) if weights else open_checkpoint(folder) if folder else None
        meta = _build(transformers, cls, config, config_file, meta=True)
        name = archs[0] if archs else type(meta).__name__
        if ckpt is None:
            model = meta
            if not structure_only:
                where = f"in {folder}" if folder is not None else f"beside {config_file.name}"
                notes.append(f"No weights {where}: the model was built on the meta device, structure only "
                             "(parameter counts, shapes and MACs; no spectra). Give the checkpoint directory, or "
                             "the config with --weights FILE, to audit the weights.")
        else:
            prefix = getattr(meta, "base_model_prefix", "") or ""
            mapped = (ckpt.mapped and model_bytes(meta) >= checkpoint.MAP_MIN_BYTES  # the file's pages: no copy
                      and covers(meta, ckpt, prefix))
            buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
            need = CHUNK_BYTES + (buffers if mapped else model_bytes(meta))
            have = available_memory()
            if have is not None and need > have:
                params = sum(p.numel() for p in meta.parameters())
                dtypes = sorted({str(p.dtype).replace("torch.", "") for p in meta.parameters()})
                what = ("its buffers and one chunk of tensors; the weights are mapped from the checkpoint" if mapped
                        else f"{params:,} parameters as {'/'.join(dtypes)}")
                raise AuditError(
                    f"building {name} from {config_file} to load its weights needs about {_gib(need)} of memory "
                    f"({what}), but only {_gib(have)} is available",
                    "Audit the weights alone (point at the .safetensors file or files: nothing is built), or pass "
                    "--structure-only for counts and shapes")
            model = _build(transformers, cls, config, config_file, meta=False, mapped=mapped)
            notes += apply_weights(model, ckpt, partial, prefix=prefix,
                                   ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None) or (),
                                   ignore_unexpected=getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
            if mapped:
                watch_mapped(model, ckpt)
        inputs = _inputs(model, meta, config, name, _Asked(input_shape, input_ids, auto_inputs), notes)
    return Loaded(model, inputs, name, str(folder or config_file), notes)


def _read_config(transformers: Any, config_file: Path, notes: list[str]) -> tuple[Any, str]:
    fix = "Give a config.json written by transformers (it needs a model_type)"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot read the Hugging Face config {config_file}: {first_line(exc)}", fix) from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise AuditError(f"cannot read the Hugging Face config {config_file}: no 'model_type' key", fix)
    try:
        removed = neutralise(raw)
    except RecursionError:
        raise AuditError(f"cannot read the Hugging Face config {config_file}: it is nested too deeply", fix) from None
    remote = any(r.split(".")[-1] in REMOTE_CODE_KEYS for r in removed)
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001
        if remote:
            raise AuditError(f"{config_file} describes a model whose code lives on the Hub (auto_map), and the "
                             f"auditor never runs code from a checkpoint ({first_line(exc)})",
                             "Audit the weights alone: point at the .safetensors file or files") from None
        raise AuditError(f"cannot read the Hugging Face config {config_file}: {first_line(exc)}", fix) from None
    for c in _config_objects(config):
        for attr in ("_attn_implementation_internal", "_experts_implementation_internal"):
            value = getattr(c, attr, None)
            if value is not None and neutralise({attr: value}):
                setattr(c, attr, None)
                removed.append(f"{attr}={value!r}")
    if removed:
        notes.append(f"Ignored in {config_file.name} (the auditor never fetches or runs code): {', '.join(removed)}; "
                     "the model was built from transformers' own classes.")
    if hasattr(config, "use_cache"):
        config.use_cache = False
    archs = list(getattr(config, "architectures", None) or [])
    return config, archs[0] if archs else str(raw["model_type"])


def _build(transformers: Any, cls: Any, config: Any, config_file: Path, meta: bool, mapped: bool = False) -> nn.Module:
    """The model ``config`` describes: on the meta device (``meta``), with its parameters alone there for the
    checkpoint's tensors to take their places (``mapped``: :func:`.checkpoint.parameters_on_meta`), or on the CPU."""
    torch.manual_seed(0)  # the same initial values every run, for any tensor a partial checkpoint leaves out
    try:
        with torch.device("meta") if meta else parameters_on_meta() if mapped else contextlib.nullcontext():
            return cls._from_config(config) if cls is not None else transformers.AutoModel.from_config(config)
    except Exception as exc:  # noqa: BLE001
        raise AuditError(f"cannot build a model from {config_file}: {first_line(exc)}",
                         "Check the config's model_type and sizes") from None


def _positions(config: Any) -> int | None:
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def max_positions(config: Any) -> int | None:
    """The positions a Hugging Face config gives its (text) model, if it says (``max_position_embeddings``, ...)."""
    return _positions(_text_config(config)) or _positions(config)


def _text_config(config: Any, decoder: bool = False) -> Any:
    with contextlib.suppress(Exception):
        return config.get_text_config(decoder=True) if decoder else config.get_text_config()
    return config


def _image_shape(config: Any) -> tuple[int, ...]:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None) or 224
    h, w = (size, size) if isinstance(size, int) else (tuple(size) * 2)[:2]
    return (1, int(getattr(vision, "num_channels", None) or 3), int(h), int(w))


@dataclass(frozen=True)
class _Asked:
    """The inputs the caller asked for: float shapes (--input-shape), a token ids' shape (--input-ids), and whether
    to make them from the config when neither is given."""

    shapes: Any = None
    ids: Any = None
    auto: bool = True


def _inputs(model: nn.Module, meta: nn.Module, config: Any, name: str, asked: _Asked,
            notes: list[str]) -> dict[str, torch.Tensor] | None:
    """Keyword inputs for the model's main input (``model.main_input_name``). Without any given, token ids (text)
    or pixel values (vision) of a typical size are made from the config and checked on the meta model first; on
    the meta device nothing is allocated."""
    input_shape, input_ids = asked.shapes, asked.ids
    main = getattr(model, "main_input_name", "input_ids") or "input_ids"
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    device = torch.device("meta" if on_meta else "cpu")
    text = _text_config(config)
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
    positions = _positions(text) or _positions(config)
    if input_shape:
        if main == "input_ids":
            raise AuditError(f"{name} is a text model: it takes token ids (input_ids), not a float tensor of shape "
                             f"{','.join(map(str, input_shape[0]))}", "Pass --input-ids 1,128 instead of --input-shape")
        if len(input_shape) > 1:
            raise AuditError(f"{name} takes one float input ({main}); {len(input_shape)} shapes were given",
                             "Pass one --input-shape")
        return {main: _floats(tuple(input_shape[0]), device, float_dtype(model))}
    if input_ids is not None:
        if main != "input_ids":
            shape = ",".join(map(str, _image_shape(config))) if main == "pixel_values" else "1,..."
            raise AuditError(f"{name} takes {main}, not token ids",
                             f"Pass --input-shape {shape} instead of --input-ids")
        if len(input_ids) != 2:
            raise AuditError(f"token ids for {name} are batch x sequence, not {'x'.join(map(str, input_ids))}",
                             "Pass two numbers, e.g. --input-ids 1,128")
        if positions and input_ids[1] > positions:
            raise AuditError(f"a sequence of {input_ids[1]} tokens is longer than the {positions} positions {name} has",
                             f"Pass --input-ids {input_ids[0]},{min(positions, DEFAULT_SEQUENCE)}")
        return _token_inputs(config, tuple(input_ids), vocab or 1000, device)
    if not asked.auto:
        return None
    # nothing given: make the main input from the config, so MACs and the data-flow graph come by default
    made: dict[str, torch.Tensor] | None = None
    what = hint = ""
    if main == "input_ids" and vocab:
        shape = (1, min(DEFAULT_SEQUENCE, positions or DEFAULT_SEQUENCE))
        made, what = _token_inputs(config, shape, vocab, device), f"token ids of shape {shape[0]} x {shape[1]}"
        hint = "--input-ids B,S picks another shape"
    elif main == "pixel_values":
        shape = _image_shape(config)
        made, what = {main: _floats(shape, device, float_dtype(model))}, f"pixel values of shape {' x '.join(map(str, shape))}"
        hint = "--input-shape picks another shape"
    if made is None:
        return None
    try:  # the meta model runs the inputs without computing anything: a model that needs more gets none
        with torch.no_grad():
            meta(**{k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in made.items()})
    except Exception as exc:  # noqa: BLE001
        if _meta_only(exc):  # the check itself cannot run on the meta device (e.g. .item()): keep the inputs
            notes.append(f"No inputs given: {what} were made from the config; {hint}.")
            return made
        notes.append(f"Inputs made from the config ({what}) do not fit {name} ({first_line(exc)[:160]}): MACs are "
                     "left out; pass the inputs the model needs.")
        return None
    notes.append(f"No inputs given: {what} were made from the config, so MACs and the data-flow graph are "
                 f"counted; {hint}.")
    return made


def _meta_only(exc: Exception) -> bool:
    """Whether a failure comes from running on the meta device (data-dependent ops, missing meta kernels) rather
    than from inputs the model does not accept."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _floats(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, device="meta", dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _token_inputs(config: Any, shape: tuple[int, ...], vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Token ids below the vocabulary size (a decoder's too for encoder-decoder models); on the meta device they
    are never allocated."""
    gen = torch.Generator().manual_seed(0)

    def ids(v: int) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(shape, dtype=torch.long, device="meta")
        return torch.randint(0, v, shape, generator=gen)

    out = {"input_ids": ids(vocab)}
    if getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids(getattr(_text_config(config, decoder=True), "vocab_size", None) or vocab)
    return out
