"""Settings and thresholds, with one precedence path: defaults < [tool.lowrank-auditor] in pyproject.toml < the
plan file < command-line flags."""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .errors import AuditError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class StrEnum(str, Enum):
    """An enum whose members are their words (``enum.StrEnum`` is Python 3.11+; this package supports 3.10)."""

    def __str__(self) -> str:
        return self.value


class FailOn(StrEnum):
    """The least severe finding that makes the command line exit 1."""

    ERROR = "error"
    WARNING = "warning"
    NEVER = "never"


@dataclass(frozen=True)
class Settings:
    energy_targets: tuple[float, ...] = (0.90, 0.95, 0.99)  # ranks reported for each
    target_energy: float = 0.95  # the suggestion keeps at least this much spectral energy
    align: int = 8  # suggested ranks are rounded up to a multiple of this when that stays below break-even
    min_share: float = 0.0025  # layers holding less of the parameters are "narrow" (LR003, skip narrow)
    min_break_even: float = 16.0  # layers whose break-even rank is below this leave no room (LR003)
    min_compression: float = 1.1  # a suggested rank must compress at least this much, or the layer stays dense
    energy_floor: float = 0.90  # LR004: a planned rank keeping less energy than this
    negligible_share: float = 0.01  # LR008: a plan saving less than this share of the model
    wider_factor: float = 4.0  # LR009: a dense candidate this many times larger than a targeted layer
    tall_ratio: float = 8.0  # LR011: max(m, n) / min(m, n) at or above this is a tall, thin matrix
    tall_min_share: float = 0.05  # LR011: ... and it holds at least this share of the parameters
    select: tuple[str, ...] = ()  # only these rule codes (empty = all)
    ignore: tuple[str, ...] = ()  # never these rule codes
    fail_on: FailOn = FailOn.ERROR

    def with_overrides(self, values: dict[str, Any], origin: str) -> "Settings":
        known = {f.name: f for f in fields(self)}
        clean: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                close = ", ".join(sorted(known))
                raise AuditError(f"unknown setting '{key}' in {origin}", f"Known settings: {close}")
            clean[name] = _coerce(name, value, getattr(self, name), origin)
            _check_range(name, clean[name], origin)
        return replace(self, **clean)


def _number(name: str, value: Any, want_int: bool, origin: str) -> int | float:
    """A finite number from a number or (from the command line) its text; never a bool, never NaN or infinity."""
    bad = AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                     f"Use a {'whole number' if want_int else 'finite number'}, e.g. {_EXAMPLES.get(name, 1)}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    if isinstance(value, str):
        try:
            value = int(value) if want_int else float(value)
        except ValueError:
            raise bad from None
    if isinstance(value, float) and not math.isfinite(value):
        raise bad
    if want_int:
        if isinstance(value, float):
            if not value.is_integer():
                raise bad
            value = int(value)
        return int(value)
    return float(value)


def _coerce(name: str, value: Any, default: Any, origin: str) -> Any:
    if isinstance(default, Enum):
        if not isinstance(value, str):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                             f"Use one of {', '.join(str(m.value) for m in type(default))}")
        try:
            return type(default)(value.strip().lower())
        except ValueError:
            known = [str(m.value) for m in type(default)]
            close = difflib.get_close_matches(value.strip().lower(), known, n=1)
            hint = f"Did you mean {close[0]}? " if close else ""
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                             f"{hint}Use one of {', '.join(known)}") from None
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                             f"Use a list, e.g. {list(default) or ['LR004']}")
        if default and isinstance(default[0], float):
            return tuple(float(_number(name, v, False, origin)) for v in value)
        if not all(isinstance(v, str) for v in value):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                             "Use a list of rule codes, e.g. [\"LR004\"]")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}", "Use true or false")
        return value
    if isinstance(default, (int, float)):
        return _number(name, value, isinstance(default, int), origin)
    if not isinstance(value, str):
        raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}", f"Use text, e.g. {default!r}")
    return value


def from_pyproject(start: Path | None = None) -> dict[str, Any]:
    """The [tool.lowrank-auditor] table of the nearest pyproject.toml at or above ``start``."""
    here = (start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError, tomllib.TOMLDecodeError) as exc:
                detail = " ".join(str(exc).split())[:200]
                raise AuditError(f"cannot read {candidate}: {detail}", "Fix the TOML syntax (UTF-8 text)") from None
            tool = data.get("tool", {})
            table = tool.get("lowrank-auditor", {}) if isinstance(tool, dict) else {}
            if not isinstance(table, dict):
                raise AuditError(f"{candidate}: [tool.lowrank-auditor] is not a table",
                                 "Write it as a [tool.lowrank-auditor] table of settings")
            return dict(table)
    return {}


# (low, high, low inclusive, high inclusive) per numeric setting; NaN and infinities never pass
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "target_energy": (0.0, 1.0, False, True), "energy_floor": (0.0, 1.0, False, True),
    "align": (1, 2.0**40, True, True), "min_share": (0.0, 1.0, True, True),
    "min_break_even": (0.0, 2.0**40, True, True),
    "min_compression": (0.0, 2.0**40, False, True), "negligible_share": (0.0, 1.0, True, True),
    "wider_factor": (0.0, 2.0**40, False, True), "tall_ratio": (1.0, 2.0**40, True, True),
    "tall_min_share": (0.0, 1.0, True, True),
}
_EXAMPLES = {"target_energy": 0.95, "energy_floor": 0.9, "align": 8, "min_share": 0.0025, "min_break_even": 16,
             "min_compression": 1.1, "negligible_share": 0.01, "wider_factor": 4, "tall_ratio": 8,
             "tall_min_share": 0.05, "energy_targets": "0.9,0.95,0.99"}


def _in_range(value: float, lo: float, hi: float, lo_in: bool, hi_in: bool) -> bool:
    return math.isfinite(value) and (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi)


def _check_range(name: str, v: Any, origin: str = "") -> None:
    where = f" in {origin}" if origin else ""
    if name == "energy_targets":
        if not v:
            raise AuditError(f"energy_targets{where} is empty", "Give at least one, e.g. 0.9,0.95,0.99")
        for t in v:
            if not _in_range(t, 0.0, 1.0, False, True):
                raise AuditError(f"energy target {t}{where} is out of range",
                                 "Energy targets are fractions in (0, 1], e.g. 0.95")
    elif name in _RANGES:
        lo, hi, lo_in, hi_in = _RANGES[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _in_range(v, lo, hi, lo_in, hi_in):
            span = (f"out of range {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}" if hi <= 1 else
                    f"not a finite number {'at least' if lo_in else 'above'} {lo:g}")
            raise AuditError(f"setting {name} = {v!r}{where} is {span}", f"e.g. {name} = {_EXAMPLES[name]}")


def validate(s: Settings) -> Settings:
    """Every setting in its range (NaN, infinities and negative thresholds refused), at least one energy target,
    fail_on one of its words; an AuditError names the setting and an example."""
    for name in ("energy_targets", *_RANGES):
        _check_range(name, getattr(s, name))
    if not isinstance(s.fail_on, FailOn):
        try:
            s = replace(s, fail_on=FailOn(s.fail_on))
        except ValueError:
            raise AuditError(f"fail_on must be error, warning or never, got {s.fail_on!r}",
                             "Use --fail-on error") from None
    return s
