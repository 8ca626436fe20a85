"""What a rule is, the ``@rule`` decorator, and the registry: the built-in rules plus those other packages add
through the ``lowrank_auditor.rules`` entry-point group.

A rule is a function ``check(ctx, emit)`` decorated with ``@rule(code, slug, severity, ...)``. The decorator turns
it into a :class:`Rule`; the runner hands the function a bound ``emit`` that writes the code, slug and severity into
every finding, so a rule body says only what it found. A rule declares what it needs (``needs={Need.DATA_FLOW}``)
and the runner skips it, with a note, when the audit lacks that. A rule owns its thresholds
(``settings=[Setting(...)]``): they are read from ``[tool.lowrank-auditor]``, a plan's ``[thresholds]`` and the
command line like the global settings, and the rule reads them with ``ctx.setting(...)``.
"""

from __future__ import annotations

import difflib
import inspect
import re
from dataclasses import dataclass, field, fields, replace
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..config import Setting, Settings
from ..errors import AuditError
from ..results import Finding, Severity, StrEnum

if TYPE_CHECKING:
    from .context import Context

SECTIONS = ("What it flags", "Why it is bad", "Example", "Do instead")
ENTRY_POINT_GROUP = "lowrank_auditor.rules"
BUILTIN_ORIGIN = "lowrank-auditor"
_CODE = re.compile(r"^[A-Z]{2,}[0-9]{3,}$")
_SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class Need(StrEnum):
    """What a rule needs from the audit; without it the rule is not run (and a note says so)."""

    DATA_FLOW = "a data-flow graph"  # symbolic_trace or torch.export; the module walk links layers in call order
    SPECTRA = "spectra"  # singular values were computed (not a structure-only audit)
    PLAN = "a plan file"  # a user's plan, not the suggested ranks


class Scope(StrEnum):
    MODEL = "model"  # the layers and their weights
    GRAPH = "graph"  # how the layers are connected
    PLAN = "plan"  # the planned (or suggested) ranks


class Emit(Protocol):
    def __call__(self, message: str, /, layers: Iterable[str] = (), fix: str = "", **evidence: Any) -> Finding: ...


Check = Callable[["Context", Emit], None]


def _never(finding: Finding) -> bool:
    return False


class RuleDefinitionError(ValueError):
    """A rule is declared wrongly (bad code or slug, missing doc sections)."""


@dataclass(frozen=True)
class Rule:
    """One rule: identity, documentation (the check's docstring, in the fixed :data:`SECTIONS`) and its check."""

    code: str
    slug: str
    severity: Severity
    check: Check = field(repr=False)
    scope: Scope = Scope.MODEL
    needs: frozenset[Need] = frozenset()
    # Which of its findings the command line treats as bad input (exit 2, no report); the library keeps them all.
    input_error: Callable[[Finding], bool] = field(default=_never, repr=False)
    origin: str = BUILTIN_ORIGIN  # the distribution that provides it
    settings: tuple[Setting, ...] = ()  # the thresholds it owns, read like the global settings

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.check) or "").splitlines()[0]

    @property
    def sections(self) -> dict[str, str]:
        doc = inspect.getdoc(self.check) or ""
        out: dict[str, str] = {}
        current = None
        for line in doc.splitlines()[1:]:
            if line.startswith("## "):
                current = line[3:].strip()
                out[current] = ""
            elif current:
                out[current] += line + "\n"
        return {k: v.strip() for k, v in out.items()}

    def finding(self, message: str, layers: Iterable[str] = (), fix: str = "", **evidence: Any) -> Finding:
        """A finding of this rule (its code, slug and severity filled in)."""
        return Finding(self.code, self.slug, self.severity, message, list(layers), dict(evidence), fix)


_GLOBAL = frozenset(f.name for f in fields(Settings))


def rule(code: str, slug: str, severity: Severity | str, *, scope: Scope | str = Scope.MODEL,
         needs: Iterable[Need | str] = (), input_error: Callable[[Finding], bool] | None = None,
         settings: Iterable[Setting] = ()) -> Callable[[Check], Rule]:
    """Declare a rule. The decorated function ``check(ctx, emit)`` becomes a :class:`Rule`. ``settings``: the
    thresholds it owns (:class:`~auditor.config.Setting`); it reads them with ``ctx.setting(SETTING)``.

    >>> from auditor.rules import rule, Severity
    >>> @rule("XY001", "always-quiet", Severity.INFO)
    ... def quiet(ctx, emit):
    ...     '''Never flags anything.
    ...
    ...     ## What it flags
    ...     Nothing.
    ...
    ...     ## Why it is bad
    ...     It is not.
    ...
    ...     ## Example
    ...     Any model.
    ...
    ...     ## Do instead
    ...     Nothing to do.
    ...     '''
    >>> quiet.code, quiet.slug, str(quiet.severity)
    ('XY001', 'always-quiet', 'info')
    """

    def deco(fn: Check) -> Rule:
        where = f"rule {code!r} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')})"
        if not _CODE.match(code):
            raise RuleDefinitionError(f"{where}: the code must be capital letters then 3+ digits, like LR001")
        if not _SLUG.match(slug):
            raise RuleDefinitionError(f"{where}: the slug {slug!r} must be lowercase words joined by '-'")
        own = tuple(settings)
        bad = next((s for s in own if not isinstance(s, Setting)), None)
        if bad is not None:
            raise RuleDefinitionError(f"{where}: settings must be auditor.config.Setting objects, got {bad!r}")
        names = [s.name for s in own]
        twice = sorted({n for n in names if names.count(n) > 1})
        taken = sorted(set(names) & _GLOBAL)
        if twice or taken:
            raise RuleDefinitionError(f"{where}: the setting {(twice or taken)[0]!r} is "
                                      + ("declared twice" if twice else "a global setting; give yours another name"))
        try:
            r = Rule(code, slug, Severity(severity), fn, Scope(scope), frozenset(Need(n) for n in needs),
                     input_error or _never, settings=own)
        except ValueError as exc:
            raise RuleDefinitionError(f"{where}: {exc}") from None
        missing = [s for s in SECTIONS if s not in r.sections]
        if not r.summary or missing:
            raise RuleDefinitionError(f"{where}: the docstring needs a summary line and the sections "
                                      f"{', '.join(SECTIONS)} (missing: {', '.join(missing) or 'summary'})")
        return r

    return deco


def rules_in(obj: object) -> list[Rule]:
    """The rules an entry point (or a built-in module) provides: a Rule, an iterable of Rules, or a module whose
    own rules (declared in it, not imported into it) are collected in definition order."""
    if isinstance(obj, Rule):
        return [obj]
    if isinstance(obj, ModuleType):
        return [v for v in vars(obj).values()
                if isinstance(v, Rule) and getattr(v.check, "__module__", None) == obj.__name__]
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes, Mapping)):
        items = list(obj)
        if all(isinstance(v, Rule) for v in items):
            return items
    raise TypeError(f"expected a Rule, a list of Rules or a module declaring rules, got {type(obj).__name__}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _plugin_rules(ep: EntryPoint) -> list[Rule]:
    dist = getattr(getattr(ep, "dist", None), "name", None)
    origin = dist or ep.value
    try:
        found = rules_in(ep.load())
        if not found:
            raise TypeError("it declares no rules")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of foreign code is one clear line
        raise AuditError(
            f"rule plugin '{ep.name}' ({ep.value}{f', from {dist}' if dist else ''}) cannot be loaded: "
            f"{_first_line(exc)}",
            f"Fix or uninstall {dist or 'the package that declares it'} (entry-point group {ENTRY_POINT_GROUP})",
        ) from None
    return [replace(r, origin=origin) for r in found]


class RuleRegistry(Mapping[str, Rule]):
    """code -> Rule: the built-in rules, then the plugins' (``lowrank_auditor.rules`` entry points), loaded on
    first use. A plugin that fails to import, or reuses a code or slug, raises one :class:`AuditError` naming it."""

    def __init__(self, builtin: Iterable[Rule], plugins: bool = True) -> None:
        self._builtin = list(builtin)
        self._plugins = plugins
        self._rules: dict[str, Rule] | None = None
        owners: dict[str, Rule] = {}
        for r in self._builtin:
            for s in r.settings:
                if s.name in owners:
                    raise RuleDefinitionError(f"{r.code} and {owners[s.name].code} both declare the setting "
                                              f"{s.name!r}")
                owners[s.name] = r

    def _load(self) -> dict[str, Rule]:
        if self._rules is not None:
            return self._rules
        rules = {r.code: r for r in self._builtin}
        if self._plugins:
            for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
                for r in _plugin_rules(ep):
                    clash = rules.get(r.code) or next((o for o in rules.values() if o.slug == r.slug), None)
                    if clash is not None:
                        raise AuditError(
                            f"rule plugin '{ep.name}' ({ep.value}, from {r.origin}) declares {r.code} {r.slug}, "
                            f"which {clash.origin} already declares as {clash.code} {clash.slug}",
                            f"Give the plugin's rule another code and slug, or uninstall {r.origin}")
                    for s in r.settings:
                        owner = next((o for o in rules.values() if any(t.name == s.name for t in o.settings)), None)
                        if owner is not None:
                            raise AuditError(
                                f"rule plugin '{ep.name}' ({ep.value}, from {r.origin}) declares the setting "
                                f"'{s.name}' for {r.code}, which {owner.origin} already declares for {owner.code} "
                                f"{owner.slug}", f"Give the plugin's setting another name, or uninstall {r.origin}")
                    rules[r.code] = r
        self._rules = rules
        return rules

    def settings(self) -> tuple[Setting, ...]:
        """The settings the registered rules own, in rule order: what config files, plans and flags may set
        besides the global settings."""
        return tuple(s for r in self._load().values() for s in r.settings)

    def reload(self) -> None:
        """Forget the loaded plugins; the next use looks up the entry points again."""
        self._rules = None

    def __getitem__(self, code: str) -> Rule:
        return self._load()[code]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def find(self, code_or_slug: str) -> Rule:
        """The rule with this code (any case) or slug; an :class:`AuditError` naming the closest ones if none."""
        key = code_or_slug.strip()
        rules = self._load()
        if key.upper() in rules:
            return rules[key.upper()]
        for r in rules.values():
            if r.slug == key.lower():
                return r
        names = [*rules, *(r.slug for r in rules.values())]
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hint = f"Did you mean {', '.join(close)}? " if close else ""
        raise AuditError(f"no rule {code_or_slug!r}",
                         f"{hint}Rules: {', '.join(f'{r.code} {r.slug}' for r in rules.values())}")
