"""The output folder of a factorized model: ``model.safetensors`` (the factorized module's weights), ``plan.json``
and the marker ``lowrank-audit-factorized.json``, written and read back.

``save_factorized`` writes them, each staged and renamed into place (a symbolic link at an output's name is refused,
never written through); ``load_factorized(model, dir)`` checks plan.json (UTF-8 JSON object of this format,
positive integer ranks) and the tensors (names, shapes, dtypes, finite values) against the structure it rebuilds
from the original model and the plan (:func:`auditor.surgery.apply_plan`), then loads the weights: any mismatch is
one AuditError line. ``auditor.artifacts.export`` adds a program that loads without this tool.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..calibration.apply import FITTED_WITH
from ..errors import AuditError, first_line, no_duplicate_keys
from .outputs import TMP_PREFIX, kind_of, strict_json
from ..surgery import apply_plan, count_params

FORMAT = "lowrank-auditor factorized"
FORMAT_VERSION = 1
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

    from .._version import __version__

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source,
            "plan": {k: int(v) for k, v in plan.items()}, "params": count_params(factorized),
            "note": "a recovery fine-tune follows factorization"}
    fitted = getattr(factorized, FITTED_WITH, None)  # auditor.factorize's copy names its fit, as the command's does
    if isinstance(fitted, str):
        meta["fit"] = fitted
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


def _byte_plan(directory: str | Path) -> bool:
    """``directory``'s plan.json is a byte plan's (:mod:`auditor.quantize.written`)."""
    from ..quantize.written import FORMAT as BYTE_FORMAT

    path = Path(directory) / PLAN_FILE
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or os.path.getsize(path) > MAX_PLAN_BYTES:
            return False
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == BYTE_FORMAT


def load_factorized(model: nn.Module, directory: str | Path) -> nn.Module:
    """Rebuild the factorized module from the original ``model`` (left untouched) and the plan in ``directory``,
    then load its weights (a byte plan that ``--write-bits`` wrote: :func:`auditor.quantize.written.load_byte_plan`). Everything is checked first (:func:`read_meta`, then the tensors' names, shapes, dtypes
    and values); a mismatch is an AuditError, never a silent cast or a partial load."""
    from safetensors.torch import load_file

    if _byte_plan(directory):  # --write-bits wrote it: integer codes, scales and factors
        from ..quantize.written import load_byte_plan

        return load_byte_plan(model, directory)
    plan = read_plan(directory)
    path = Path(directory) / PLAN_FILE
    try:
        new = apply_plan(model, plan)  # the structure only
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
