"""A sentence encoder in the sentence-transformers layout: ``modules.json`` lists the modules (the transformer at
the directory itself, a ``sentence_transformers.models.Pooling`` at ``1_Pooling``, optionally ``2_Normalize``), and
the Pooling module's ``config.json`` says how token states become one embedding (``pooling_mode_cls_token``,
``pooling_mode_max_tokens``, ``pooling_mode_mean_tokens``, ...). :func:`sentence_pooling` reads which modes, offline
and without sentence-transformers; anything it cannot read is one line saying what and how to fix it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import AuditError, first_line

MODULES = "modules.json"
POOLING_DIR = "1_Pooling"  # where sentence-transformers writes the Pooling module when modules.json is absent
MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean"}
OTHER_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
FIX = ("Give a 1_Pooling/config.json as sentence-transformers writes it, e.g. {\"pooling_mode_mean_tokens\": true}, "
       "or pick the metric with --metric output-error")


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise AuditError(f"cannot read the sentence-transformers {what} {path}: {first_line(exc)}", FIX) from None


def _inside(directory: Path, rel: object, where: Path) -> Path:
    """``directory / rel``, refused where ``rel`` is not a relative path inside ``directory`` (links resolved)."""
    if not isinstance(rel, str):
        raise AuditError(f"{where} names the Pooling module's path as {rel!r}, not a string", FIX)
    root = directory.resolve()
    path = (root / rel).resolve()
    if Path(rel).is_absolute() or (path != root and root not in path.parents):
        raise AuditError(f"{where} puts the Pooling module at {rel!r}, outside {directory}",
                         "Give a path inside the model directory, e.g. \"1_Pooling\"")
    return path


def _pooling_dir(directory: Path) -> Path | None:
    """The Pooling module's folder that ``modules.json`` names (``1_Pooling`` without one, when it is there); None
    where the directory has no Pooling module."""
    listed = directory / MODULES
    if not listed.is_file():
        return directory / POOLING_DIR if (directory / POOLING_DIR / "config.json").is_file() else None
    modules = _json(listed, "module list")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise AuditError(f"the sentence-transformers module list {listed} is not a list of modules "
                         "({\"type\": ..., \"path\": ...})", FIX)
    for m in modules:
        if str(m.get("type", "")).rsplit(".", 1)[-1] == "Pooling":
            return _inside(directory, m.get("path"), listed)
    return None


def sentence_pooling(directory: str | Path | None) -> tuple[str, ...] | None:
    """The pooling modes ("cls", "max", "mean", in sentence-transformers' order) of the sentence encoder saved in
    ``directory``; None where it is not in the sentence-transformers layout (no Pooling module). A pooling config
    that cannot be read, names no mode, a mode other than these three, or a value other than true / false is one
    line (:class:`AuditError`)."""
    if directory is None or not Path(directory).is_dir():
        return None
    folder = _pooling_dir(Path(directory))
    if folder is None:
        return None
    file = folder / "config.json"
    if not file.is_file():
        raise AuditError(f"the sentence-transformers Pooling module at {folder} has no config.json", FIX)
    raw = _json(file, "pooling config")
    if not isinstance(raw, dict):
        raise AuditError(f"the sentence-transformers pooling config {file} is not a JSON object", FIX)
    modes = []
    for key, value in raw.items():
        if not key.startswith("pooling_mode_"):
            continue
        if not isinstance(value, bool):
            raise AuditError(f"{key} in the sentence-transformers pooling config {file} is {value!r}, not true or "
                             "false", FIX)
        if value and key not in MODE_KEYS:
            what = "a pooling mode the pooled-cosine metric does not pool" if key in OTHER_MODES else \
                "an unknown pooling mode"
            raise AuditError(f"the sentence-transformers pooling config {file} sets {key}, {what} (it pools "
                             "cls_token, max_tokens and mean_tokens)",
                             "Set one of pooling_mode_cls_token, pooling_mode_max_tokens, pooling_mode_mean_tokens, "
                             "or pick the metric with --metric output-error")
        if value:
            modes.append(MODE_KEYS[key])
    if not modes:
        raise AuditError(f"the sentence-transformers pooling config {file} sets no pooling mode", FIX)
    return tuple(m for m in ("cls", "max", "mean") if m in modes)
