"""Settings and thresholds, with one precedence path: defaults < [tool.lowrank-auditor] in pyproject.toml < the
plan file < command-line flags."""

from __future__ import annotations

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
        return replace(self, **clean)


def _coerce(name: str, value: Any, default: Any, origin: str) -> Any:
    if isinstance(default, Enum):
        try:
            return type(default)(str(value).strip().lower())
        except ValueError:
            known = ", ".join(str(m.value) for m in type(default))
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}", f"Use one of {known}") from None
    try:
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            items = tuple(type(default[0])(v) if default else str(v) for v in value)
            return items
        if isinstance(default, bool):
            return bool(value)
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                         f"Use a value like {default!r}") from None


def from_pyproject(start: Path | None = None) -> dict[str, Any]:
    """The [tool.lowrank-auditor] table of the nearest pyproject.toml at or above ``start``."""
    here = (start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise AuditError(f"cannot read {candidate}: {exc}", "Fix the TOML syntax") from None
            return dict(data.get("tool", {}).get("lowrank-auditor", {}))
    return {}


def validate(s: Settings) -> Settings:
    for t in (*s.energy_targets, s.target_energy, s.energy_floor):
        if not 0.0 < t <= 1.0:
            raise AuditError(f"energy {t} is out of range", "Energy targets are fractions in (0, 1], e.g. 0.95")
    if s.align < 1:
        raise AuditError(f"align must be at least 1, got {s.align}", "Use --align 8 (or 1 for no rounding)")
    if not isinstance(s.fail_on, FailOn):
        try:
            s = replace(s, fail_on=FailOn(s.fail_on))
        except ValueError:
            raise AuditError(f"fail_on must be error, warning or never, got {s.fail_on!r}",
                             "Use --fail-on error") from None
    return s
