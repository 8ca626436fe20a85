"""Apply a plan: a new module in which every planned layer is two, initialised by a (whitened) truncated SVD.

- Linear (and transformers' Conv1D) -> Linear(in, r, bias=False) then Linear(r, out, bias as before);
- Conv1d/2d/3d -> the same convolution with r outputs per group (no bias), then a 1x1 convolution to the original
  outputs (groups kept, bias as before);
- Embedding -> Embedding(V, r) then Linear(r, dim, bias=False);
- a kind registered in :mod:`auditor.kinds` -> what its ``replace`` builds (each replacement lives in its kind's
  module). Kinds that say they cannot be factorized (LSTM/GRU/RNN gates, MultiheadAttention's in_proj) are refused.

Each planned layer stores groups * r * (m + n) numbers instead of groups * m * n, so the new module has exactly
``dense - sum(m*n*groups) + sum(r*(m+n)*groups)`` parameters. Without calibration the factors come from the SVD of
the weight; with calibration (a ``Calibration`` or its ``InputStatistics``) from the whitened truncation, which keeps
the layer's outputs on the calibration data as close as any rank-r map can. A recovery fine-tune follows either way.

Only real floating-point weights (float16, bfloat16, float32, float64) are factorized: complex, quantized, integer,
boolean and float8 layers are refused with one line (AuditError), as are tied weights (under either name). Ranks at
or above break-even are allowed here (the full rank reproduces the layer); ``lowrank-audit factorize`` refuses them
unless told otherwise.

``save_factorized`` writes ``model.safetensors`` (the factorized module's weights), ``plan.json`` and the marker
``lowrank-audit-factorized.json``, each staged and renamed into place (a symbolic link at an output's name is
refused, never written through); ``load_factorized(model, dir)`` checks plan.json (UTF-8 JSON object of this format,
positive integer ranks) and the tensors (names, shapes, dtypes, finite values) against the structure it rebuilds
from the original model and the plan, then loads the weights: any mismatch is one AuditError line.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import AuditError, first_line, no_duplicate_keys
from . import kinds
from .structure.layers import ParamTable, collect_layers
from .outputs import TMP_PREFIX, kind_of, strict_json
from .results import Layer

FORMAT = "lowrank-auditor factorized"
FORMAT_VERSION = 1
SUPPORTED = kinds.registry.SUPPORTED  # the kinds with a two-module replacement (a live view of auditor.kinds)


def _tied_use(key: str, layers: dict[str, Layer]) -> Layer | None:
    """The layer whose tensor ``key`` (a parameter name, or its module's path) names under another name."""
    for layer in layers.values():
        for alias in layer.aliases:
            if key in (alias, alias.rpartition(".")[0]):
                return layer
    return None


def tied_message(key: str, layer: Layer, where: str = "plan") -> AuditError:
    """``key`` names a second use of ``layer``'s tensor (a tied weight): say which names share it and what to do."""
    names = ", ".join([layer.param, *layer.aliases])
    return AuditError(f"{where} {key!r} names a tied weight: one tensor with the names {names}, audited as layer "
                      f"{layer.name}; factorizing one use would untie it",
                      f"Leave it out of the plan, or untie the weights in the model first (the audit reviews the "
                      f"tensor as {layer.name!r}, LR006)")


def resolve_plan(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> dict[str, tuple[Layer, int]]:
    """Plan entries (layer or parameter names -> rank) checked against the model: ``Layer.name -> (layer, rank)``."""
    if layers is None:
        layers = collect_layers(model, ParamTable.of(model))
    named = {layer.name: layer for layer in layers.values()}
    by_param = {layer.param: layer for layer in layers.values()}
    out: dict[str, tuple[Layer, int]] = {}
    for key, rank in plan.items():
        layer = named.get(key) or by_param.get(key)
        if layer is None:
            tied = _tied_use(key, layers)
            if tied is not None:
                raise tied_message(key, tied)
            close = difflib.get_close_matches(key, list(named), n=3)
            raise AuditError(f"plan names {key!r}, which is not a factorizable layer of the model",
                             f"Did you mean {', '.join(close)}?" if close else "Check the layer names in the audit")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= int(rank) <= layer.max_rank:
            raise AuditError(f"plan rank {rank!r} for {layer.name} is not an integer in 1..{layer.max_rank}",
                             "Give a positive integer rank no larger than min(m, n)")
        out[layer.name] = (layer, int(rank))
    return out


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # the weights factorize() decomposes


def _dtype_of(layer: Layer, mod: nn.Module | None) -> str:
    w = getattr(mod, "weight", None) if mod is not None else None
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch.")
    return layer.dtype  # a quantized module's weight is a method; the layer table read its packed dtype


def check_dtype(name: str, layer: Layer, mod: nn.Module | None = None) -> None:
    """Refuse a layer whose weights are not real floating point: complex (the imaginary part would be dropped),
    quantized (packed integers and scales), integer, boolean or float8 (no factor could be stored in it)."""
    dtype = _dtype_of(layer, mod)
    quantized = dtype.startswith(("qint", "quint")) or (mod is not None and ".quantized" in type(mod).__module__)
    if dtype in FLOAT_DTYPES and not quantized:
        return
    if dtype.startswith("complex"):
        fix = "Leave it out of the plan: a complex map needs complex factors, which factorize() does not write"
        what = f"{name} has {dtype} (complex) weights; factorize() decomposes real weights only"
    elif quantized:
        fix = "Factorize the floating-point model before quantizing it, or leave the layer out of the plan"
        what = f"{name} is quantized ({dtype}); factorize() decomposes floating-point weights only"
    else:
        fix = "Cast the model to float32 (or float16, bfloat16) first, or leave the layer out of the plan"
        what = (f"{name} has {dtype} weights; factorize() decomposes floating-point weights "
                f"({', '.join(FLOAT_DTYPES)}) only")
    raise AuditError(what, fix)


def check_layers(model: nn.Module, resolved: dict[str, tuple[Layer, int]]) -> None:
    """Every planned layer can be rewritten: a supported module, real floating-point weights, not tied elsewhere."""
    for name, (layer, _) in resolved.items():
        mod = _module(model, layer)
        check_dtype(name, layer, mod)
        kind = kinds.for_kind(layer.kind)
        if mod is None or not kind.accepts(mod):
            why = f": {kind.cannot_factorize}" if kind.cannot_factorize else ""
            raise AuditError(f"factorize() rewrites {kinds.rewritable_labels()} layers; {name} is "
                             f"{layer.module_type} ({layer.kind}){why}", "Leave it out of the plan")
        others = [a for a in layer.aliases if model.get_submodule(a.rpartition(".")[0]) is not mod]
        if others:
            names = ", ".join([layer.param, *layer.aliases])
            raise AuditError(f"{name} shares its weight with {', '.join(others)} (one tensor with the names "
                             f"{names}): factorizing it at one use would untie it",
                             "Leave tied weights out of the plan, or untie them in the model first")


def _module(model: nn.Module, layer: Layer) -> nn.Module | None:
    if not kinds.for_kind(layer.kind).factorizable:
        return None
    try:
        return model.get_submodule(kinds.for_kind(layer.kind).module_path(layer)[0])
    except AttributeError:
        return None


def check_targets(model: nn.Module, patterns: list[str], layers: dict[str, Layer] | None = None) -> None:
    """Before any costly work: every layer a plan pattern matches can be factorized (:func:`check_layers`), and a
    pattern naming only a tied weight's second name says so. Patterns are matched as the plan review matches them
    (fnmatch on the layer or parameter name)."""
    import fnmatch

    if layers is None:
        layers = collect_layers(model, ParamTable.of(model))
    hit: dict[str, tuple[Layer, int]] = {}
    for pattern in patterns:
        matched = [l for l in layers.values()
                   if fnmatch.fnmatchcase(l.name, pattern) or fnmatch.fnmatchcase(l.param, pattern)]
        if not matched:
            tied = [l for l in layers.values() for a in l.aliases
                    if fnmatch.fnmatchcase(a, pattern) or fnmatch.fnmatchcase(a.rpartition(".")[0], pattern)]
            if tied:
                raise tied_message(pattern, tied[0], "plan pattern")
        hit.update((l.name, (l, 1)) for l in matched)
    check_layers(model, hit)


def predicted_params(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> int:
    """The factorized model's parameter count: dense - m*n*groups + r*(m+n)*groups per planned layer."""
    resolved = resolve_plan(model, plan, layers)
    total = ParamTable.of(model).total
    return total - sum(l.params - l.params_at(r) for l, r in resolved.values())


def _paths_of(model: nn.Module, mod: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules(remove_duplicate=False) if m is mod]


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    owner._modules[child] = new


def _two(layer: Layer, mod: nn.Module, r: int, a: np.ndarray | None, b: np.ndarray | None) -> nn.Module:
    """The two-module replacement of ``mod`` at rank r (its kind's); factors a (g, out, r), b (g, r, in) when given."""
    return kinds.for_kind(layer.kind).replace(layer, mod, r, a, b)


def factorize(model: nn.Module, plan: dict[str, int], calibration: Any = None, *, init: bool = True,
              layers: dict[str, Layer] | None = None, reuse: dict[str, Any] | None = None,
              share: bool = False) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two; ``model`` is left
    untouched. ``calibration``: None (plain SVD), a ``CalibrationSession`` (its statistics, read once), a
    ``Calibration`` (input statistics are gathered on ``model``, in eval mode), or ``InputStatistics``. ``init=False`` builds the structure only (for ``load_factorized``). ``reuse``: a dict the
    caller keeps across calls with the same model and calibration, so each layer is decomposed once. ``share``: the
    copy holds ``model``'s own parameters and buffers (only the new factors are allocated): for measuring a plan,
    never for a model that is trained or changed."""
    from .calibration.whiten import Truncator

    resolved = resolve_plan(model, plan, layers)
    check_layers(model, resolved)  # before any statistics are gathered: a complex layer would crash them
    stats = None
    if calibration is not None and init:
        from .calibration.inputs import Calibration
        from .calibration.session import CalibrationSession
        from .calibration.stats import InputStatistics

        if isinstance(calibration, InputStatistics):
            stats = calibration
        elif isinstance(calibration, (Calibration, CalibrationSession)):
            planned = [l for l, _ in resolved.values()]  # the session's statistics when they cover the plan
            stats = CalibrationSession.of(calibration, model, layers=planned).statistics(planned)
        else:
            raise AuditError(f"calibration is a {type(calibration).__name__}",
                             "Pass a CalibrationSession, a Calibration (load_calibration) or InputStatistics")
    new = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())} if share else None)
    for name, (layer, r) in resolved.items():
        path, attr = kinds.for_kind(layer.kind).module_path(layer)
        old = new.get_submodule(path)
        a = b = None
        if init:
            inp = stats.layers.get(name) if stats is not None else None
            trunc = reuse.get(name) if reuse is not None else None
            if trunc is None:
                trunc = Truncator(layer, getattr(old, attr), inp)
                if reuse is not None:
                    reuse[name] = trunc
            a, b = trunc.factors(r)
        replacement = _two(layer, old, r, a, b)
        replacement.train(old.training)
        for path in _paths_of(new, old):  # a module reached by several paths is replaced at each
            _set(new, path, replacement)
    return new


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied tensors once)."""
    return ParamTable.of(model).total


MODEL_FILE = "model.safetensors"
PLAN_FILE = "plan.json"
MARKER = "lowrank-audit-factorized.json"  # written last by save_factorized: the folder is a complete output of it
OUTPUT_FILES = (MODEL_FILE, PLAN_FILE, MARKER)
EXPORT_FILES = ("model.pt2", "model.onnx", "README.md")  # what --export adds (auditor/export.py)
TOOL = "lowrank-auditor"
MAX_PLAN_BYTES = 16 * 2**20  # a plan.json is a few kB; a larger one is not one


def _kind(path: Path) -> str:
    return kind_of(os.lstat(path).st_mode)


def write_factorized(factorized: nn.Module, plan: dict[str, int], folder: Path, source: str = "",
                     extra: dict[str, Any] | None = None) -> None:
    """Create model.safetensors, plan.json and the marker (last) in ``folder``, a new empty folder of the caller's;
    errors (a full disk: OSError, or safetensors' own I/O error) propagate as they come."""
    from safetensors.torch import save_model

    from ._version import __version__

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source,
            "plan": {k: int(v) for k, v in plan.items()}, "params": count_params(factorized),
            "note": "a recovery fine-tune follows factorization"}
    meta.update(extra or {})
    marker = {"tool": TOOL, "version": __version__, "format": FORMAT, "files": [MODEL_FILE, PLAN_FILE]}
    save_model(factorized, str(folder / MODEL_FILE))
    for name, data in ((PLAN_FILE, meta), (MARKER, marker)):
        with open(folder / name, "x", encoding="utf-8") as fh:
            fh.write(strict_json(data, indent=2, sort_keys=True) + "\n")  # read back by read_meta
            fh.flush()
            os.fsync(fh.fileno())
    umask = os.umask(0)
    os.umask(umask)
    for name in OUTPUT_FILES:  # ordinary files, as the user's umask makes them (safetensors creates its file 0600)
        os.chmod(folder / name, 0o666 & ~umask)


def save_factorized(factorized: nn.Module, plan: dict[str, int], directory: str | Path,
                    source: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors``, ``plan.json`` and the marker ``lowrank-audit-factorized.json`` into
    ``directory`` (created); returns the directory.

    Each file is written in a private staging folder inside ``directory`` and renamed into place, so a symbolic link
    (or any other non-regular file) at an output's name is never written through: it is refused, and nothing is
    replaced. The marker comes last: a folder holding it is a complete output (``lowrank-audit factorize --force``
    replaces only such a folder)."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AuditError(f"cannot create {out}: {exc.strerror or exc}", "Choose a folder you can write to") from None
    if not out.is_dir():
        raise AuditError(f"{out} is {_kind(out)}, not a folder", "Save into a folder")
    for name in OUTPUT_FILES:
        dest = out / name
        if os.path.lexists(dest) and not stat.S_ISREG(os.lstat(dest).st_mode):
            raise AuditError(f"{dest} is {_kind(dest)}; refusing to write through it or replace it",
                             "Remove it, or save into another folder")
    try:
        stage = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, suffix=".tmp", dir=out))
    except OSError as exc:
        raise AuditError(f"cannot write in {out}: {exc.strerror or exc}", "Choose a folder you can write to") from None
    try:
        write_factorized(factorized, plan, stage, source, extra)
        for name in OUTPUT_FILES:  # the marker last
            os.replace(stage / name, out / name)  # replaces a name, never follows one
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - a full disk (OSError, or safetensors' own I/O error)
        what = f"{exc.strerror or exc}" if isinstance(exc, OSError) else first_line(exc)
        raise AuditError(f"cannot write the factorized model into {out}: {what}",
                         "Free space, or choose another folder") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def previous_output(directory: str | Path) -> str | None:
    """None when ``directory`` is a complete output of :func:`save_factorized` and nothing else (its marker, and
    only regular files among model.safetensors, plan.json and the marker); otherwise why it is not."""
    d = Path(directory)
    marker = d / MARKER
    if not os.path.lexists(marker):
        return f"has no {MARKER}, so it is not an output of lowrank-audit factorize"
    if not stat.S_ISREG(os.lstat(marker).st_mode):
        return f"has {MARKER} as {_kind(marker)}"
    try:
        with open(marker, "rb") as fh:
            data = json.loads(fh.read(65536).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or data.get("tool") != TOOL or data.get("format") != FORMAT:
        return f"has a {MARKER} that lowrank-audit factorize did not write"
    for entry in sorted(os.listdir(d)):
        if entry not in OUTPUT_FILES and entry not in EXPORT_FILES:
            return f"also holds {entry!r}, which lowrank-audit factorize did not write"
        if not stat.S_ISREG(os.lstat(d / entry).st_mode):
            return f"has {entry} as {_kind(d / entry)}"
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "a list", int: "a number", float: "a number",
            dict: "an object"}.get(type(value), type(value).__name__)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:30]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_meta(directory: str | Path) -> dict[str, Any]:
    """``plan.json`` of a factorized model, checked: a JSON object in UTF-8, of this format, with a ``plan`` of
    layer names to positive integer ranks. Anything else is an AuditError naming the file."""
    path = Path(directory) / PLAN_FILE
    fix = "Point to a directory written by save_factorized (or lowrank-audit factorize)"
    if not os.path.lexists(path):
        raise AuditError(f"{path} does not exist", fix)
    if not path.is_file():
        raise AuditError(f"{path} is {_kind(path)}, not a file", fix)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_PLAN_BYTES + 1)
    except OSError as exc:
        raise AuditError(f"cannot read {path}: {exc.strerror or exc}", fix) from None
    if len(raw) > MAX_PLAN_BYTES:
        raise AuditError(f"{path} is larger than {MAX_PLAN_BYTES // 2**20} MiB, not a factorized-model plan", fix)
    again = "Write it again with save_factorized"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AuditError(f"{path} is not UTF-8 (byte {exc.start})", again) from None
    try:
        meta = json.loads(text, parse_constant=_constant, parse_float=_finite, object_pairs_hook=no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise AuditError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}", again) from None
    except RecursionError:
        raise AuditError(f"{path} is nested too deeply to be a factorized-model plan", again) from None
    except ValueError as exc:
        raise AuditError(f"{path} is not valid JSON: {exc}", again) from None
    if not isinstance(meta, dict):
        raise AuditError(f"{path} holds {_json_kind(meta)}, not a factorized-model plan (a JSON object)", again)
    if meta.get("format") != FORMAT:
        got = "no format" if "format" not in meta else f"format {str(meta['format'])[:60]!r}"
        raise AuditError(f"{path} is not a factorized-model plan: it has {got}, not {FORMAT!r}", fix)
    version = meta.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise AuditError(f"{path} has format_version {str(version)[:30]}; this version reads {FORMAT_VERSION}",
                         "Write it again with this version's save_factorized")
    plan = meta.get("plan")
    if not isinstance(plan, dict):
        got = "no plan" if "plan" not in meta else f"a plan that is {_json_kind(plan)}"
        raise AuditError(f"{path} has {got}, not an object of layer names to ranks", again)
    if not plan:
        raise AuditError(f"{path} plans no layer", again)
    for name, rank in plan.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise AuditError(f"{path}: the rank of {name[:80]!r} is {str(rank)[:30]}, not a positive integer", again)
    return meta


def read_plan(directory: str | Path) -> dict[str, int]:
    """The plan in ``directory``'s plan.json (checked by :func:`read_meta`)."""
    return dict(read_meta(directory)["plan"])


def _storage_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names of the state dict grouped by shared storage (tied tensors): save_model keeps one name of each."""
    groups: dict[Any, list[str]] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.device) if t.numel() and t.device.type != "meta" else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _shown(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_weights(path: Path, tensors: dict[str, torch.Tensor], new: nn.Module, plan: dict[str, int]) -> None:
    """The file's tensors are exactly the factorized structure's: the same names (one per tied group), shapes and
    dtypes, and every floating-point value finite."""
    fix = "Load it with the original model and the plan.json it was saved with, or save it again"
    state = new.state_dict()
    extra = sorted(set(tensors) - set(state))
    if extra:
        raise AuditError(f"{path} holds tensors the plan does not build: {_shown(extra)}", fix)
    missing = [g[0] for g in _storage_groups(state) if not any(n in tensors for n in g)]
    if missing:
        raise AuditError(f"{path} lacks {_shown(missing)}", fix)
    for name, t in tensors.items():
        want = state[name]
        if tuple(t.shape) != tuple(want.shape):
            layer = next((k for k in plan if name.startswith(k + ".")), None)
            why = f" (plan.json gives {layer} rank {plan[layer]})" if layer is not None else ""
            raise AuditError(f"{path}: {name} is {list(t.shape)} but the plan builds {list(want.shape)}{why}",
                             "The weights and plan.json do not belong together: save them again with save_factorized")
        if t.dtype != want.dtype:
            raise AuditError(f"{path}: {name} is {str(t.dtype).removeprefix('torch.')} but the model's is "
                             f"{str(want.dtype).removeprefix('torch.')}", fix)
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            raise AuditError(f"{path}: {name} holds NaN or infinite values", "Save the factorized model again")


def load_factorized(model: nn.Module, directory: str | Path) -> nn.Module:
    """Rebuild the factorized module from the original ``model`` (left untouched) and the plan in ``directory``,
    then load its weights. Everything is checked first (:func:`read_meta`, then the tensors' names, shapes, dtypes
    and values); a mismatch is an AuditError, never a silent cast or a partial load."""
    from safetensors.torch import load_file

    plan = read_plan(directory)
    path = Path(directory) / PLAN_FILE
    try:
        new = factorize(model, plan, init=False)
    except AuditError as exc:
        raise AuditError(f"{path}: {exc.what}", exc.fix) from None
    weights = Path(directory) / MODEL_FILE
    if not os.path.lexists(weights):
        raise AuditError(f"{weights} does not exist", "Point to a directory written by save_factorized")
    if not weights.is_file():
        raise AuditError(f"{weights} is {_kind(weights)}, not a file", "Point to a directory written by save_factorized")
    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file: safetensors' own error
        raise AuditError(f"{weights} is not a readable safetensors file: {first_line(exc)}",
                         "Save the factorized model again") from None
    _check_weights(weights, tensors, new, plan)
    with torch.no_grad():
        new.load_state_dict(tensors, strict=False)  # names, shapes and dtypes checked; tied names load once
    return new
