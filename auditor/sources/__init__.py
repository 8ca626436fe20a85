"""Model sources: a Python factory, a Hugging Face config or checkpoint directory, a safetensors file or sharded
checkpoint (weights only), torchvision and timm names. Never uses the network; never unpickles code.

Weights that a source promises but does not hold are an error naming them (``partial=True`` audits anyway, with a
note); a Hugging Face config without weights is built on the meta device (structure only), with a note.

This module is the dispatch (:func:`load_source`: which kind of source a string names) and the shape flags; the
sources themselves live beside it: ``factory.py`` (the user's Python factories, torchvision and timm, and running the
user's code with stdout kept clean), ``hf.py`` (Hugging Face configs and directories), ``checkpoint.py``
(:class:`Loaded`, checkpoints copied into a model, :class:`WeightsOnly`), ``tensorref.py`` (picklable references to
one tensor of a safetensors file). The package sits below the pipeline and imports only :mod:`auditor.kinds`, the
plain results and the core modules."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import AuditError
from .checkpoint import Loaded, WeightsOnly, apply_weights, open_checkpoint
from .factory import float_dtype, load_factory, load_zoo, made_inputs

__all__ = ["Loaded", "WeightsOnly", "SOURCE_HELP", "load_source", "parse_shape"]


MAX_INPUT_DIMS = 8
MAX_INPUT_ELEMENTS = 1 << 28  # 268M elements: 1 GiB of float32 for one example input
_DIGITS = re.compile(r"[0-9]{1,12}", re.ASCII)


def parse_shape(text: str, flag: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` or ``"1x128"`` -> a tuple of positive ints; anything else is one clear error line."""
    example = "1,128" if "ids" in flag else "1,3,224,224"
    fix = f"Give positive whole numbers separated by commas, e.g. {flag} {example}"

    def bad(reason: str) -> AuditError:
        return AuditError(f"{flag} {text!r} is not a shape: {reason}", fix)

    if not text.strip():
        raise bad("it is empty")
    tokens = [t.strip() for t in re.split(r"[,xX]", text.strip())]
    if any(not t for t in tokens):
        raise bad("a dimension is missing between separators")
    for t in tokens:
        if not _DIGITS.fullmatch(t):
            what = "too large" if t.isascii() and t.isdigit() else "not a positive whole number"
            raise bad(f"{t!r} is {what}")
    dims = tuple(int(t) for t in tokens)
    if any(d == 0 for d in dims):
        raise bad("a dimension is 0")
    if len(dims) > MAX_INPUT_DIMS:
        raise bad(f"{len(dims)} dimensions, more than {MAX_INPUT_DIMS}")
    if math.prod(dims) > MAX_INPUT_ELEMENTS:
        raise bad(f"{math.prod(dims):,} elements, more than the {MAX_INPUT_ELEMENTS:,} an example input may have")
    return dims


SOURCE_HELP = ("Use file.py:factory, package.module:factory, a Hugging Face directory or config.json, "
               "a .safetensors file, or torchvision:NAME / timm:NAME")


def load_source(
    spec: str,
    input_shape: list[tuple[int, ...]] | None = None,
    input_ids: tuple[int, ...] | None = None,
    weights: str | None = None,
    structure_only: bool = False,
    partial: bool = False,
    auto_inputs: bool = True,
) -> Loaded:
    """Resolve a source string to a model and example inputs.

    - ``path/to/file.py:factory`` or ``package.module:factory``: a callable returning an ``nn.Module`` or
      ``(module, example_inputs)``;
    - a directory with ``config.json`` (weights loaded if present), or a bare ``config.json``: a Hugging Face model.
      Without weights (or with ``structure_only``) it is built on the meta device: counts, shapes and MACs only.
      Without inputs, token ids (or pixel values) are made from the config;
    - a ``.safetensors`` file, a directory of safetensors shards, or a ``.bin``/``.pt`` state dict: weights only;
    - ``torchvision:NAME`` or ``timm:NAME``: random init, ``weights`` loads a state dict.

    ``weights``: a state dict file or checkpoint directory for a factory, zoo or config source. Every parameter
    the model has must be in it, or :class:`AuditError` names the missing ones; ``partial=True`` loads what is
    there and lists the rest in ``Loaded.notes``. ``auto_inputs=False``: no inputs made from a config (tracing a
    large model with inputs takes seconds to a minute; without, MACs are left out).
    """
    if not spec or not spec.strip():
        raise AuditError("the model source is empty", SOURCE_HELP)
    path = Path(spec)
    if spec.startswith(("torchvision:", "timm:")):
        lib, name = spec.split(":", 1)
        model = load_zoo(lib, name)
        notes = apply_weights(model, open_checkpoint(weights, flag=True), partial) if weights else []
        return Loaded(model, made_inputs(input_shape, input_ids, float_dtype(model)), name, spec, notes)
    if weights:
        _check_weights_target(spec, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            from .hf import load_hf

            return load_hf(path / "config.json", path, input_shape, input_ids, weights, structure_only, partial,
                           auto_inputs)
        if list(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
            return _weights_only(WeightsOnly.open(path), path.name, path)
        raise AuditError(f"{spec} is a directory without config.json or safetensors files",
                         "Point to a Hugging Face checkpoint directory, a safetensors file, or file.py:factory")
    if path.suffix == ".json" and not spec.endswith(".safetensors.index.json"):
        if not path.is_file():
            raise AuditError(f"config file {spec} does not exist", "Check the path")
        from .hf import load_hf

        return load_hf(path, None, input_shape, input_ids, weights, structure_only, partial, auto_inputs)
    checkpoint = _checkpoint_file(spec, path)
    if checkpoint is not None:
        return checkpoint
    if ":" in spec:
        return load_factory(spec, input_shape, input_ids, weights, partial)
    raise _unknown(spec, path)


def _unknown(spec: str, path: Path) -> AuditError:
    """A source of no known kind: a Hub id (``gpt2``, ``owner/name``) is told how to fetch it, anything else gets the
    list of kinds."""
    if _HUB_ID.fullmatch(spec) and not path.exists():
        return AuditError(f"{spec!r} is no file or folder here; it reads as a Hugging Face Hub id, and hub ids are not "
                          "downloaded (the tool never uses the network)",
                          f"Fetch it into a directory first (e.g. huggingface-cli download {spec} --local-dir "
                          f"{spec.rsplit('/', 1)[-1]}), then give that directory")
    return AuditError(f"cannot tell what kind of model source {spec!r} is", SOURCE_HELP)


# a Hub repository id: NAME or OWNER/NAME, letters, digits, "-", "_", "." (no leading "." or "/", no path parts)
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}", re.ASCII)


def _check_weights_target(spec: str, path: Path) -> None:
    """--weights loads into a model built from code or a config, never into a checkpoint source."""
    if path.suffix in (".safetensors", ".bin", ".pt", ".pth") or spec.endswith(".index.json") or (
            path.is_dir() and not (path / "config.json").is_file()):
        raise AuditError(f"--weights applies to a model built from code or a config; {spec} is already a checkpoint",
                         "Drop --weights, or give the factory or config.json the weights belong to")


def _checkpoint_file(spec: str, path: Path) -> Loaded | None:
    """A safetensors file (or its shard index) or a ``.bin``/``.pt`` state dict as a weights-only source; None for
    any other source."""
    if path.suffix == ".safetensors" or spec.endswith(".safetensors.index.json"):
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return _weights_only(WeightsOnly.open(path), path.stem, path)
    if path.suffix in (".bin", ".pt", ".pth") and ":" not in path.name:
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return _weights_only(WeightsOnly.from_state_dict(path), path.stem, path)
    return None


def _weights_only(w: "WeightsOnly", name: str, path: Path) -> Loaded:
    if not w.index:
        raise AuditError(f"{path} holds no tensors", "Point at the checkpoint that holds the model's weights")
    return Loaded(w, None, name, str(path))
