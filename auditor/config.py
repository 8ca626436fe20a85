"""Settings and thresholds, with one precedence path: defaults < [tool.lowrank-auditor] in pyproject.toml < the
plan file < command-line flags."""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

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
    UNMEASURED = "unmeasured"  # a warning, an error, or a plan calibration did not measure (status not "pass")
    NEVER = "never"


_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class Bounds(NamedTuple):
    """A numeric setting's range: (low, high, low inclusive, high inclusive)."""

    low: float
    high: float
    low_inclusive: bool = True
    high_inclusive: bool = True

    def holds(self, value: float) -> bool:
        """``value`` is a finite number inside the range (NaN and infinities never are)."""
        lo, hi = self.low, self.high
        return math.isfinite(value) and (lo <= value if self.low_inclusive else lo < value) and (
            value <= hi if self.high_inclusive else value < hi)


_TAIL = ("select", "ignore", "fail_on")  # listed after the rules' settings in reports (as_dict)


@dataclass(frozen=True)
class Setting:
    """A setting a rule declares and owns: its name (the key in ``[tool.lowrank-auditor]``, a plan's
    ``[thresholds]`` and ``overrides``), default, one-line meaning, and for a number its allowed range.

    The default's type is the setting's type: a float, an int, a bool, text, or a tuple of floats or of text.
    Values are read as the global settings are: a number from TOML or from text, never a bool, NaN or infinity,
    then checked against ``low``/``high``.

    >>> floor = Setting("energy_floor", 0.90, "planned ranks keeping less energy are flagged", low=0.0, high=1.0,
    ...                 low_inclusive=False)
    >>> floor.coerce("0.8", "the command line")
    0.8
    >>> floor.coerce(1.5, "plan.toml")
    Traceback (most recent call last):
    ...
    auditor.errors.AuditError: setting energy_floor = 1.5 in plan.toml is out of range (0, 1]. e.g. energy_floor = 0.9.
    """

    name: str
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    example: Any = None  # shown in the error for a bad value (default: the default)
    stricter: str = ""  # "higher" or "lower": the way that flags more (a plan may not move it the other way)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"setting name {self.name!r} must be lowercase words joined by '_', like energy_floor")
        if not self.doc.strip():
            raise ValueError(f"setting {self.name!r} needs a one-line doc (what it does)")
        numeric = isinstance(self.default, (int, float)) and not isinstance(self.default, bool)
        if (self.low is not None or self.high is not None) and not numeric:
            raise ValueError(f"setting {self.name!r}: a range needs a numeric default, got {self.default!r}")
        if numeric:
            if not math.isfinite(self.default):
                raise ValueError(f"setting {self.name!r}: the default {self.default!r} is not a finite number")
            if not self.bounds.holds(self.default):
                raise ValueError(f"setting {self.name!r}: the default {self.default!r} is outside its range")

    @property
    def bounds(self) -> Bounds:
        """(low, high, low inclusive, high inclusive); an open end is +-2**40 (the global settings' cap)."""
        return Bounds(-(2.0**40) if self.low is None else self.low, 2.0**40 if self.high is None else self.high,
                      self.low_inclusive, self.high_inclusive)

    @property
    def range_text(self) -> str:
        """The allowed values in words, as docs/rules.md prints them: ``(0, 1]``, ``at least 1``, ``any``."""
        if not isinstance(self.default, (int, float)) or isinstance(self.default, bool):
            return "true or false" if isinstance(self.default, bool) else "any"
        if self.low is not None and self.high is not None:
            return (f"{'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}"
                    f"{']' if self.high_inclusive else ')'}")
        if self.low is not None:
            return f"{'at least' if self.low_inclusive else 'above'} {self.low:g}"
        if self.high is not None:
            return f"{'at most' if self.high_inclusive else 'below'} {self.high:g}"
        return "any finite number"

    def check(self, value: Any, origin: str = "") -> None:
        """An AuditError naming the setting and an example when a number is missing or out of its range."""
        if isinstance(self.default, (int, float)) and not isinstance(self.default, bool):
            _range_error(self.name, value, origin, self.bounds, self.default if self.example is None else self.example)

    def coerce(self, value: Any, origin: str, typed: bool = False) -> Any:
        """The value read from a config file, a plan or the command line, checked; AuditError when bad. ``typed``:
        from a TOML or JSON file, where a number or a list must be written as one (not as text)."""
        example = self.default if self.example is None else self.example
        if typed:
            _typed(self.name, value, self.default, origin, example)
        out = _coerce(self.name, value, self.default, origin, example)
        self.check(out, origin)
        return out


@dataclass(frozen=True, init=False)
class Settings:
    """The audit's settings. The fields are the global ones; the thresholds rules declare (:class:`Setting`, e.g.
    LR004's ``energy_floor``) live in ``rule_settings`` and read as attributes too (``settings.energy_floor``).
    ``Settings(energy_floor=0.5)`` sets one; unknown names are refused when the audit resolves its settings against
    the registered rules (:func:`validate`)."""

    energy_targets: tuple[float, ...] = (0.90, 0.95, 0.99)  # ranks reported for each
    target_energy: float = 0.95  # the suggestion keeps at least this much spectral energy
    align: int = 8  # suggested ranks are rounded up to a multiple of this when that stays below break-even
    min_share: float = 0.0025  # layers holding less of the parameters are "narrow" (LR003, skip narrow)
    min_break_even: float = 16.0  # layers whose break-even rank is below this leave no room (LR003)
    min_compression: float = 1.1  # a suggested rank must compress at least this much, or the layer stays dense
    select: tuple[str, ...] = ()  # only these rule codes (empty = all)
    ignore: tuple[str, ...] = ()  # never these rule codes
    fail_on: FailOn = FailOn.ERROR
    rule_settings: tuple[tuple[str, Any], ...] = ()  # (name, value) of the settings rules declare

    def __init__(self, **values: Any) -> None:
        own = {f.name: f for f in fields(Settings)}
        rule_values = dict(values.pop("rule_settings", ()) or ())
        for name, f in own.items():
            if name == "rule_settings":
                continue
            if name in values:
                value = values.pop(name)
            else:
                value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            object.__setattr__(self, name, value)
        rule_values.update(values)  # the rest: rule settings, checked against the declared ones by validate()
        object.__setattr__(self, "rule_settings", tuple(rule_values.items()))

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            try:
                pairs = object.__getattribute__(self, "rule_settings")
            except AttributeError:
                pairs = ()
            for key, value in pairs:
                if key == name:
                    return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def value(self, setting: Setting) -> Any:
        """A rule setting's value here, its default when it is not set."""
        for key, value in self.rule_settings:
            if key == setting.name:
                return value
        return setting.default

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name, as reports list them: the global ones, the rules' (in rule order), then select,
        ignore and fail_on."""
        head = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rule_settings"}
        tail = {k: head.pop(k) for k in _TAIL}
        return {**head, **dict(self.rule_settings), **tail}

    def with_overrides(self, values: Mapping[str, Any], origin: str, declared: Iterable[Setting] = (),
                       typed: bool = False) -> "Settings":
        """These settings with ``values`` read over them (from ``origin``, named in errors); ``declared``: the
        settings the registered rules own, accepted besides the global ones. ``typed``: the values come from a
        TOML or JSON file (pyproject.toml, a plan), where a number written as text is the wrong type."""
        known = {f.name: f for f in fields(self) if f.name != "rule_settings"}
        owned = {d.name: d for d in declared}
        clean: dict[str, Any] = {}
        rules = dict(self.rule_settings)
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name in owned:
                rules[name] = owned[name].coerce(value, origin, typed)
            elif name in known:
                if typed:
                    _typed(name, value, getattr(self, name), origin, _EXAMPLES.get(name, 1))
                clean[name] = _coerce(name, value, getattr(self, name), origin, _EXAMPLES.get(name, 1))
                _check_range(name, clean[name], origin)
            else:
                close = ", ".join(sorted([*known, *owned]))
                raise AuditError(f"unknown setting '{key}' in {origin}", f"Known settings: {close}")
        return replace(self, **clean, rule_settings=tuple(rules.items()))


def _typed(name: str, value: Any, default: Any, origin: str, example: Any) -> None:
    """In a TOML or JSON file a setting has its type: a number is a number and a list a list, not text (the command
    line's flags are text; there "8" and "0.9,0.95" are read as numbers)."""
    if isinstance(default, Enum) or isinstance(default, bool):
        return  # fail_on is a word; a bool is checked by _coerce
    if isinstance(default, tuple):
        want = "a list" + (f", e.g. {name} = {list(example) if isinstance(example, tuple) else '[0.9, 0.95]'}"
                           if default and isinstance(default[0], float) else f', e.g. {name} = ["LR004"]')
        if not isinstance(value, (list, tuple)):
            raise AuditError(f"setting '{name}' in {origin} is {_toml_kind(value)} {value!r}, not a list",
                             f"Write it as {want}")
        return
    if isinstance(default, (int, float)) and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return  # not a number at all: _coerce says so
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise AuditError(f"setting '{name}' in {origin} is text {value!r}, not {kind}",
                         f"Write it without quotes, e.g. {name} = {example}")


def _toml_kind(value: Any) -> str:
    return {str: "text", bool: "a boolean", int: "a number", float: "a number", dict: "a table"}.get(
        type(value), type(value).__name__)


def _number(name: str, value: Any, want_int: bool, origin: str, example: Any = 1) -> int | float:
    """A finite number from a number or (from the command line) its text; never a bool, never NaN or infinity."""
    bad = AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                     f"Use a {'whole number' if want_int else 'finite number'}, e.g. {example}")
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


def _coerce(name: str, value: Any, default: Any, origin: str, example: Any = 1) -> Any:
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
            return tuple(float(_number(name, v, False, origin, example)) for v in value)
        if not all(isinstance(v, str) for v in value):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}",
                             "Use a list of rule codes, e.g. [\"LR004\"]")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}", "Use true or false")
        return value
    if isinstance(default, (int, float)):
        return _number(name, value, isinstance(default, int), origin, example)
    if not isinstance(value, str):
        raise AuditError(f"setting '{name}' in {origin} has a bad value {value!r}", f"Use text, e.g. {default!r}")
    return value


def nearest_pyproject(start: Path | None = None) -> Path | None:
    """The pyproject.toml the settings come from: the nearest at or above ``start`` (default: the working folder)."""
    here = (start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        if _is_file(folder / "pyproject.toml"):
            return folder / "pyproject.toml"
    return None


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where a folder on the way may not be searched (EACCES: a working folder inside
    another user's folder): a pyproject.toml the user cannot read is not the one their settings come from."""
    try:
        return path.is_file()
    except OSError:
        return False


def from_pyproject(start: Path | None = None) -> dict[str, Any]:
    """The [tool.lowrank-auditor] table of the nearest pyproject.toml at or above ``start``."""
    here = (start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        candidate = folder / "pyproject.toml"
        if _is_file(candidate):
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


PLAN_MAY_RELAX = "plan_may_relax_review"  # [tool.lowrank-auditor]: may a plan's [thresholds] relax its own review?
_FAIL_ON_STRICTNESS = {FailOn.NEVER: 0, FailOn.ERROR: 1, FailOn.WARNING: 2, FailOn.UNMEASURED: 3}


def repo_settings(declared: Iterable[Setting] = (), start: Path | None = None) -> tuple["Settings", bool]:
    """The repository's own settings: defaults < ``[tool.lowrank-auditor]`` of the nearest pyproject.toml (every
    value checked: a wrong type is one AuditError naming the key, the type it needs and the file), and whether that
    table lets a plan's ``[thresholds]`` relax the plan's own review (``plan_may_relax_review = true``; default
    false, see :func:`check_plan_relaxes`)."""
    path = nearest_pyproject(start)
    table = from_pyproject(start)
    shown = "pyproject.toml"
    if path is not None:
        try:
            shown = str(path.relative_to(Path.cwd().resolve()))  # pyproject.toml, as run from the repository root
        except ValueError:
            shown = str(path)
    origin = f"{shown} [tool.lowrank-auditor]"
    allow: Any = False
    for key in (PLAN_MAY_RELAX, PLAN_MAY_RELAX.replace("_", "-")):
        if key in table:
            allow = table.pop(key)
            if not isinstance(allow, bool):
                raise AuditError(f"setting '{key}' in {origin} has a bad value {allow!r}: it needs a boolean",
                                 f"Write {PLAN_MAY_RELAX} = true or false")
    return Settings().with_overrides(table, origin, declared, typed=True), allow


def _loosened(before: "Settings", after: "Settings", declared: Iterable[Setting]) -> list[str]:
    """The rule thresholds ``after`` moves the way that flags less (each :class:`Setting`'s ``stricter``)."""
    out = []
    for st in declared:
        b, a = before.value(st), after.value(st)
        if (st.stricter == "higher" and a < b) or (st.stricter == "lower" and a > b):
            out.append(f"loosens {st.name} from {b:g} to {a:g}")
    return out


def check_plan_relaxes(before: "Settings", after: "Settings", plan: str,
                       active: "Callable[[tuple[str, ...], tuple[str, ...]], set[str]] | None" = None,
                       declared: Iterable[Setting] = ()) -> None:
    """A plan's ``[thresholds]`` cannot silence the review of that plan: it may tighten it (more rules, a stricter
    ``fail_on``) and tune the rules' thresholds, but not turn a rule off (``ignore``, a narrower ``select``) or lower
    ``fail_on`` below what the repository's settings give, or loosen a rule threshold that declares which way is
    stricter (``energy_floor = 1e-9`` would silence LR004 on the plan), unless its pyproject.toml allows it
    (``plan_may_relax_review``). ``active(select, ignore)``: the rule codes a selection runs (codes, prefixes and
    slugs resolved by the rule registry); without it the tokens are compared as written."""
    what = []
    if active is not None:
        lost = sorted(active(before.select, before.ignore) - active(after.select, after.ignore))
        if lost:
            what.append(f"turns off {', '.join(lost)}")
    else:
        ignored = [c for c in after.ignore if c not in before.ignore]
        dropped = ([c for c in before.select if c not in after.select] if before.select else
                   (["every rule but " + ", ".join(after.select)] if after.select else []))
        if ignored:
            what.append(f"ignores {', '.join(ignored)}")
        if dropped:
            what.append(f"selects away {', '.join(dropped)}")
    if _FAIL_ON_STRICTNESS[after.fail_on] < _FAIL_ON_STRICTNESS[before.fail_on]:
        what.append(f"lowers fail_on from {before.fail_on} to {after.fail_on}")
    what += _loosened(before, after, declared)
    if what:
        raise AuditError(f"plan {plan}: its [thresholds] {' and '.join(what)}, which would silence the review of "
                         "this very plan",
                         f"Remove that from the plan (pass --ignore, --fail-on or the threshold on the command line "
                         f"instead), or let "
                         f"plans do it with {PLAN_MAY_RELAX} = true in [tool.lowrank-auditor] of pyproject.toml")


# (low, high, low inclusive, high inclusive) per numeric global setting; NaN and infinities never pass. The rules'
# thresholds (energy_floor, ...) are declared with their ranges in their rule's module (auditor/rules/).
_RANGES: dict[str, Bounds] = {
    "target_energy": Bounds(0.0, 1.0, False, True),
    "align": Bounds(1, 2.0**40, True, True), "min_share": Bounds(0.0, 1.0, True, True),
    "min_break_even": Bounds(0.0, 2.0**40, True, True),
    "min_compression": Bounds(0.0, 2.0**40, False, True),
}
_EXAMPLES = {"target_energy": 0.95, "align": 8, "min_share": 0.0025, "min_break_even": 16,
             "min_compression": 1.1, "energy_targets": "0.9,0.95,0.99"}


def _range_error(name: str, v: Any, origin: str, bounds: Bounds, example: Any) -> None:
    """Raise an AuditError when ``v`` is not a number in ``bounds`` (NaN and infinities never are)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not bounds.holds(v):
        lo, hi, lo_in, hi_in = bounds
        where = f" in {origin}" if origin else ""
        if hi <= 1 or (lo > -(2.0**40) and hi < 2.0**40):
            span = f"out of range {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
        elif lo > -(2.0**40):
            span = f"not a finite number {'at least' if lo_in else 'above'} {lo:g}"
        else:
            span = f"not a finite number {'at most' if hi_in else 'below'} {hi:g}"
        raise AuditError(f"setting {name} = {v!r}{where} is {span}", f"e.g. {name} = {example}")


def _check_range(name: str, v: Any, origin: str = "") -> None:
    where = f" in {origin}" if origin else ""
    if name == "energy_targets":
        if not v:
            raise AuditError(f"energy_targets{where} is empty", "Give at least one, e.g. 0.9,0.95,0.99")
        for t in v:
            if not Bounds(0.0, 1.0, False, True).holds(t):
                raise AuditError(f"energy target {t}{where} is out of range",
                                 "Energy targets are fractions in (0, 1], e.g. 0.95")
    elif name in _RANGES:
        _range_error(name, v, origin, _RANGES[name], _EXAMPLES[name])


def validate(s: Settings, declared: Iterable[Setting] = ()) -> Settings:
    """Every setting in its range (NaN, infinities and negative thresholds refused), at least one energy target,
    fail_on one of its words; an AuditError names the setting and an example. ``declared``: the settings the
    registered rules own. Each gets its value or its default, in declaration order (so reports list every one),
    and a rule setting no rule declares is an error naming the known ones."""
    for name in ("energy_targets", *_RANGES):
        _check_range(name, getattr(s, name))
    if not isinstance(s.fail_on, FailOn):
        try:
            s = replace(s, fail_on=FailOn(s.fail_on))
        except ValueError:
            raise AuditError(f"fail_on must be error, warning, unmeasured or never, got {s.fail_on!r}",
                             "Use --fail-on error") from None
    owned = {d.name: d for d in declared}
    given = dict(s.rule_settings)
    unknown = [k for k in given if k not in owned]
    if unknown:
        known = sorted([*(f.name for f in fields(s) if f.name != "rule_settings"), *owned])
        raise AuditError(f"unknown setting '{unknown[0]}'", f"Known settings: {', '.join(known)}")
    for name, value in given.items():
        owned[name].check(value)
    return replace(s, rule_settings=tuple((d.name, given.get(d.name, d.default)) for d in owned.values()))
