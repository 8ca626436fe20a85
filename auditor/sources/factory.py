"""Sources built by the user's code: a ``file.py:factory`` or ``package.module:factory`` callable, and the
torchvision and timm model registries (random init). The user's code runs with its prints sent to stderr
(:func:`stdout_to_stderr`), and any exception or ``sys.exit`` of it becomes one :class:`AuditError` line
(:func:`run_user_code`); calibration's own user callables (batches, metrics) run through the same two."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import AuditError, first_line
from .checkpoint import Loaded, apply_weights, open_checkpoint



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


def run_user_code(fn: Callable[[], Any], doing: str, failed: str, fix: str, exit_fix: str = "") -> Any:
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
        err = AuditError(f"{doing} {failed} {first_line(exc)}{user_frame(exc)}", fix)
        err.captured = user_traceback(exc)  # type: ignore[attr-defined]  # printed by --verbose
        raise err from None


_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the auditor package: frames of the tool, not the user's


def _library(filename: str) -> bool:
    """A frame of Python's own library or of an installed package (torch, transformers), not of the user's code."""
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return filename.startswith("<") or any(filename.startswith(r + os.sep) for r in roots)


def user_frame(exc: BaseException) -> str:
    """`` (at models.py:12)``: where the user's own code raised ``exc`` (its innermost frame outside the tool, Python
    and installed packages; the innermost frame outside the tool when none is the user's); empty when unknown."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" (at {_shown(exc.filename)}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_OURS)]
    own = [f for f in frames if not _library(f.filename)] or frames
    return f" (at {_shown(own[-1].filename)}:{own[-1].lineno})" if own else ""


def _shown(filename: str) -> str:
    """A path relative to the working folder when it lies under it, else as Python recorded it."""
    with contextlib.suppress(ValueError, OSError):
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    return filename


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (and the exceptions it chains) without the tool's own frames: the user's code and
    what it called, as Python would print it had the user called the factory themselves."""
    import traceback

    te = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if not f.filename.startswith(_OURS)])
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format()).rstrip("\n")


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
            run_user_code(lambda: loader.exec_module(module), f"importing {target}", "failed:",
                           "Fix the error in that file", guard)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        finally:
            sys.path.pop(0)
    else:
        module = run_user_code(lambda: importlib.import_module(target), f"importing module {target}", "failed:",
                                "Check the module path and that its package is installed", guard)
    return module


def load_factory(spec: str, input_shape: Any, input_ids: Any, weights: str | None, partial: bool) -> Loaded:
    """A ``file.py:factory`` or ``package.module:factory`` source: the user's callable run (stdout kept clean), its
    model (or ``(model, example_inputs)``) taken, ``weights`` applied, and inputs made from the shape flags if given."""
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
    out = run_user_code(fn, f"factory {attr}()", "raised", "Fix the factory so it builds the model",
                         "Return the model from the factory instead of exiting")
    example = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        out, example = out
    if not isinstance(out, nn.Module):
        raise AuditError(f"factory {attr}() returned {type(out).__name__}, not a torch.nn.Module",
                         "Return an nn.Module, or (module, example_inputs)")
    notes = apply_weights(out, open_checkpoint(weights, flag=True), partial) if weights else []
    inputs = made_inputs(input_shape, input_ids, float_dtype(out)) if (input_shape or input_ids) else example
    return Loaded(out, inputs, type(out).__name__, spec, notes)


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype made-up float inputs take: the model's first floating parameter's (a bf16 model gets bf16 inputs,
    which its forward accepts), float32 without one."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


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


def made_inputs(input_shape: Any, input_ids: Any, dtype: torch.dtype = torch.float32) -> Any:
    """Example inputs for a factory or zoo model: random floats of each shape (in ``dtype``), or token ids below
    1000."""
    gen = torch.Generator().manual_seed(0)
    if input_ids is not None:
        return (torch.randint(0, 1000, tuple(input_ids), generator=gen),)
    if input_shape:
        return tuple(torch.randn(tuple(s), generator=gen).to(dtype) for s in input_shape)
    return None


def load_zoo(lib: str, name: str) -> nn.Module:
    """A ``torchvision:NAME`` or ``timm:NAME`` model with a reproducible random init (never pretrained weights)."""
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
