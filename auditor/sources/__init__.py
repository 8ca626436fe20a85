"""Model sources: a Python factory, a Hugging Face config or checkpoint directory, a safetensors file or sharded
checkpoint (weights only), torchvision and timm names. Never uses the network; never unpickles code.

Weights that a source promises but does not hold are an error naming them (``partial=True`` audits anyway, with a
note); a Hugging Face config without weights is built on the meta device (structure only), with a note."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import nn

# Checkpoints and weights-only reading live in auditor.sources.checkpoint (below this module and auditor.sources.hf); the names
# stay importable from here
from .checkpoint import (  # noqa: F401
    CHUNK_BYTES, Checkpoint, Loaded, WeightsOnly, apply_weights, open_checkpoint, safe_torch_load,
)
from ..errors import AuditError, first_line


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
        model = _zoo(lib, name)
        notes = apply_weights(model, open_checkpoint(weights, flag=True), partial) if weights else []
        return Loaded(model, _inputs(input_shape, input_ids), name, spec, notes)
    if weights and (path.suffix in (".safetensors", ".bin", ".pt", ".pth") or spec.endswith(".index.json") or (
            path.is_dir() and not (path / "config.json").is_file())):
        raise AuditError(f"--weights applies to a model built from code or a config; {spec} is already a checkpoint",
                         "Drop --weights, or give the factory or config.json the weights belong to")
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
    if path.suffix == ".safetensors" or spec.endswith(".safetensors.index.json"):
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return _weights_only(WeightsOnly.open(path), path.stem, path)
    if path.suffix in (".bin", ".pt", ".pth") and ":" not in path.name:
        if not path.exists():
            raise AuditError(f"checkpoint {spec} does not exist", "Check the path")
        return _weights_only(WeightsOnly.from_state_dict(path), path.stem, path)
    if ":" in spec:
        return _factory(spec, input_shape, input_ids, weights, partial)
    raise AuditError(f"cannot tell what kind of model source {spec!r} is", SOURCE_HELP)


def _weights_only(w: "WeightsOnly", name: str, path: Path) -> Loaded:
    if not w.index:
        raise AuditError(f"{path} holds no tensors", "Point at the checkpoint that holds the model's weights")
    return Loaded(w, None, name, str(path))


# ---------------------------------------------------------------------------------------------------------------
# Python factories


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While the user's code runs, whatever it prints goes to stderr: stdout carries only the JSON/Markdown report.
    Both Python's ``sys.stdout`` and file descriptor 1 (for prints from C extensions) are redirected."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: int | None = None
    with contextlib.suppress(OSError):
        saved = os.dup(1)
        try:
            os.dup2(2, 1)
        except OSError:
            os.close(saved)
            saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _run_user_code(fn: Callable[[], Any], doing: str, failed: str, fix: str, exit_fix: str = "") -> Any:
    """Call the user's code with stdout kept clean; any exception, ``sys.exit`` or other ``BaseException`` ends in
    an :class:`AuditError` (exit 2), except Ctrl-C, which still interrupts."""
    try:
        with stdout_to_stderr():
            return fn()
    except KeyboardInterrupt:
        raise
    except AuditError:
        raise
    except SystemExit as exc:
        code = repr(exc.code)
        code = code if len(code) <= 60 else code[:57] + "..."
        raise AuditError(f"{doing} called sys.exit({code}) instead of returning", exit_fix or fix) from None
    except BaseException as exc:  # noqa: BLE001 - the user's code failed in any way at all
        raise AuditError(f"{doing} {failed} {first_line(exc)}", fix) from None


def import_user_module(target: str, what: str = "file") -> ModuleType:
    """The module a ``file.py:fn`` or ``package.module:fn`` spec names, imported as a user's code is: a file is
    registered in ``sys.modules`` (dataclasses and pickling look it up there), its folder is on ``sys.path`` while it
    runs, its prints go to stderr, and any exception or exit becomes one :class:`AuditError` line."""
    guard = 'Put the script part of that file under `if __name__ == "__main__":`'
    if target.endswith(".py"):
        file = Path(target)
        if not file.is_file():
            from ..errors import describe_missing

            raise AuditError(f"{what} {target} {describe_missing(file) or 'is not a regular file'}",
                             "Check the path to the Python file")
        mod_name = f"_lowrank_user_{abs(hash(str(file.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(mod_name, file)
        if spec_obj is None or spec_obj.loader is None:
            raise AuditError(f"cannot import {target} as a Python file", "Check that it is a .py file")
        module = importlib.util.module_from_spec(spec_obj)
        loader = spec_obj.loader
        sys.path.insert(0, str(file.parent.resolve()))
        sys.modules[mod_name] = module  # as an import would: @dataclass and pickling look the module up by name
        try:
            _run_user_code(lambda: loader.exec_module(module), f"importing {target}", "failed:",
                           "Fix the error in that file", guard)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        finally:
            sys.path.pop(0)
    else:
        module = _run_user_code(lambda: importlib.import_module(target), f"importing module {target}", "failed:",
                                "Check the module path and that its package is installed", guard)
    return module


def _factory(spec: str, input_shape: Any, input_ids: Any, weights: str | None, partial: bool) -> Loaded:
    target, _, attr = spec.rpartition(":")
    if not target.strip():
        raise AuditError(f"{spec!r} names no file or module before the colon", "Use file.py:factory_function")
    if not attr.isidentifier():
        raise AuditError(f"{spec!r} does not name a factory after the colon", "Use file.py:factory_function")
    module = import_user_module(target)
    fn = getattr(module, attr, None)
    if fn is None:
        raise AuditError(f"{target} has no factory named {attr!r}", _factory_hint(module, attr))
    if not callable(fn):
        raise AuditError(f"{target}:{attr} is not callable", "Name a function that returns an nn.Module")
    out = _run_user_code(fn, f"factory {attr}()", "raised", "Fix the factory so it builds the model",
                         "Return the model from the factory instead of exiting")
    example = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        out, example = out
    if not isinstance(out, nn.Module):
        raise AuditError(f"factory {attr}() returned {type(out).__name__}, not a torch.nn.Module",
                         "Return an nn.Module, or (module, example_inputs)")
    notes = apply_weights(out, open_checkpoint(weights, flag=True), partial) if weights else []
    inputs = _inputs(input_shape, input_ids) if (input_shape or input_ids) else example
    return Loaded(out, inputs, type(out).__name__, spec, notes)


def _factory_hint(module: Any, attr: str, most: int = 10) -> str:
    """Close matches first, then the callables the module itself defines (any case, sorted), at most ``most``."""
    import difflib

    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    own = [n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__]
    names = sorted(own or public, key=lambda n: (n.lower(), n))
    close = difflib.get_close_matches(attr, names, n=3)
    listed = ", ".join(names[:most]) + (f", ... and {len(names) - most} more" if len(names) > most else "")
    there = f"Callables there: {listed}" if names else "It defines no callables"
    return (f"Did you mean {', '.join(close)}? " if close else "") + there


def _inputs(input_shape: Any, input_ids: Any) -> Any:
    """Example inputs for a factory or zoo model: random floats of each shape, or token ids below 1000."""
    gen = torch.Generator().manual_seed(0)
    if input_ids is not None:
        return (torch.randint(0, 1000, tuple(input_ids), generator=gen),)
    if input_shape:
        return tuple(torch.randn(tuple(s), generator=gen) for s in input_shape)
    return None


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
