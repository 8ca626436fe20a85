"""The table of layer kinds: by ``Layer.kind`` and by module type (its most derived registered class wins)."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from torch import nn

from ..results import Kind
from .base import LayerKind, LayerSpec

_BY_KIND: dict[str, LayerKind] = {}
_SPECS: dict[type, LayerSpec] = {}
_OWNER: dict[type, LayerKind] = {}  # module type -> the kind whose ``finds`` holds it
_USER_TYPES: set[type] = set()  # registered by users: traced as leaf modules, so their spec costs each call
_ORDER: list[LayerKind] = []  # registration order; weights-only guesses ask the latest first
_LAZY: list[Callable[[], None]] = []  # registrations that wait for an optional import (transformers' Conv1D)


def register(kind: LayerKind, *, builtin: bool = False) -> LayerKind:
    """Teach the auditor a layer kind: its ``kind`` name and every module type in its ``finds``. Registering a kind
    of the same name again replaces it. Types of a kind registered by a user are leaves for ``torch.fx``."""
    if not isinstance(kind, LayerKind):
        raise TypeError(f"register needs a LayerKind, got {kind!r}")
    if not kind.kind:
        raise ValueError(f"{kind!r} has no kind name")
    for t in kind.finds:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"a layer kind finds nn.Module subclasses, got {t!r}")
    old = _BY_KIND.get(str(kind.kind))
    if old is not None:
        unregister(old)
    _BY_KIND[str(kind.kind)] = kind
    _ORDER.append(kind)
    for t, spec in kind.finds.items():
        add_type(t, spec, kind, user=not builtin)
    return kind


def unregister(kind: LayerKind) -> None:
    """Forget a kind and the module types it finds."""
    if _BY_KIND.get(str(kind.kind)) is kind:
        del _BY_KIND[str(kind.kind)]
    if kind in _ORDER:
        _ORDER.remove(kind)
    for t in [t for t, k in _OWNER.items() if k is kind]:
        remove_type(t)


def add_type(t: type, spec: LayerSpec, owner: LayerKind | None, user: bool) -> None:
    """One module type's spec (``owner`` None: the kind of each weight is what its view says)."""
    _SPECS[t] = spec
    if owner is not None:
        _OWNER[t] = owner
    else:
        _OWNER.pop(t, None)
    (_USER_TYPES.add if user else _USER_TYPES.discard)(t)
    _lookup.cache_clear()


def remove_type(t: type) -> None:
    _SPECS.pop(t, None)
    _OWNER.pop(t, None)
    _USER_TYPES.discard(t)
    _lookup.cache_clear()


def when_imported(fn: Callable[[], None]) -> None:
    """A registration to try before each lookup until it succeeds (it returns without registering until then)."""
    _LAZY.append(fn)


def _run_lazy() -> None:
    for fn in _LAZY:
        fn()


class _Unknown(LayerKind):
    """A kind name nobody registered (a saved record, a worker process): viewed as stored, nothing else."""

    def __init__(self, name: str) -> None:
        self.kind = name


def for_kind(kind: Kind | str) -> LayerKind:
    """The kind of a layer record (``Layer.kind``); a name nobody registered gets a kind that reads the tensor as
    stored and does nothing else (no statistics, no sweep, no replacement)."""
    _run_lazy()
    found = _BY_KIND.get(str(kind))
    return found if found is not None else _Unknown(str(kind))


def is_known(kind: Kind | str) -> bool:
    return str(kind) in _BY_KIND


@lru_cache(maxsize=None)
def _lookup(cls: type) -> type | None:
    for base in cls.__mro__:
        if base in _SPECS:
            return base
    return None


def spec_for_type(cls: type) -> LayerSpec | None:
    """The spec of a module type (or of its nearest registered base class), None if it owns no weights we know."""
    _run_lazy()
    base = _lookup(cls)
    return _SPECS[base] if base is not None else None


def for_type(cls: type) -> LayerKind | None:
    """The kind that finds modules of this type (or of its nearest registered base class)."""
    _run_lazy()
    base = _lookup(cls)
    return _OWNER.get(base) if base is not None else None


def for_module(mod: nn.Module) -> LayerKind | None:
    return for_type(type(mod))


def is_user_leaf(mod: nn.Module) -> bool:
    """Whether the module's type (or a base) was registered by a user."""
    return any(base in _USER_TYPES for base in type(mod).__mro__)


def spec_types() -> tuple[type, ...]:
    """The module types with a spec, built-in and registered."""
    _run_lazy()
    return tuple(_SPECS)


def kinds() -> tuple[LayerKind, ...]:
    """Every registered kind, in registration order."""
    _run_lazy()
    return tuple(_ORDER)


def guess(name: str, shape: tuple[int, ...]) -> tuple[LayerKind, int, int, str] | None:
    """The kind of a weights-only checkpoint's tensor from its name and shape: the latest registered kind whose
    :meth:`LayerKind.guess` claims it (so a user's kind is asked before the built-in catch-alls)."""
    for kind in reversed(kinds()):
        got = kind.guess(name, shape)
        if got is not None:
            return (kind, *got)
    return None


def rewritable_labels() -> str:
    """What factorize rewrites, in words: "Linear, Conv1D, Conv1d/2d/3d and Embedding"."""
    names = [k.label for k in kinds() if k.factorizable and k.label]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


class KindSet:
    """The kind names for which ``test(kind)`` holds, read live from the registry (``Kind.LINEAR in SUPPORTED``):
    a kind registered later is in it without anyone editing a table."""

    def __init__(self, test: Callable[[LayerKind], bool], what: str) -> None:
        self._test, self._what = test, what

    def __contains__(self, kind: object) -> bool:
        return is_known(str(kind)) and self._test(for_kind(str(kind)))

    def __iter__(self):
        return iter([k.kind for k in kinds() if self._test(k)])

    def __repr__(self) -> str:
        return f"<kinds {self._what}: {', '.join(str(k) for k in self)}>"


SUPPORTED = KindSet(lambda k: k.factorizable, "factorize rewrites")
SWEPT = KindSet(lambda k: k.swept and not k.cannot_factorize, "tier 2 sweeps")
