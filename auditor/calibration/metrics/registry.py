"""The table of metric kinds: by ``Metric.kind`` and by the names --metric accepts."""

from __future__ import annotations

from .base import MetricKind

_BY_KIND: dict[str, MetricKind] = {}
_BY_NAME: dict[str, str] = {}  # --metric NAME (lower case) -> kind


def register(kind: MetricKind) -> MetricKind:
    """Teach the auditor a metric: its ``kind`` name and every name in its ``names``. Registering a kind of the same
    name again replaces it."""
    if not isinstance(kind, MetricKind):
        raise TypeError(f"register needs a MetricKind, got {kind!r}")
    if not kind.kind:
        raise ValueError(f"{kind!r} has no kind name")
    if kind.verified_by_rows and not kind.zero_on_dense:  # the verification judges its interval's upper end
        raise ValueError(f"metric kind {kind.kind!r} is verified row by row, so it must be zero on the dense model "
                         "and lower-is-better")
    old = _BY_KIND.get(kind.kind)
    if old is not None:
        unregister(old)
    _BY_KIND[kind.kind] = kind
    for name in kind.names:
        _BY_NAME[name.lower()] = kind.kind
    return kind


def unregister(kind: MetricKind) -> None:
    """Forget a metric kind and its names."""
    if _BY_KIND.get(kind.kind) is kind:
        del _BY_KIND[kind.kind]
    for name in [n for n, k in _BY_NAME.items() if k == kind.kind and k not in _BY_KIND]:
        del _BY_NAME[name]


def for_kind(kind: str) -> MetricKind:
    """The registered kind named ``kind``; ValueError naming those there are, else."""
    found = _BY_KIND.get(kind)
    if found is None:
        raise ValueError(f"metric kind must be one of {', '.join(_BY_KIND)}, not {kind!r}")
    return found


def for_name(name: str) -> str | None:
    """The kind a --metric NAME means (case and surrounding spaces ignored), None when no metric has that name."""
    return _BY_NAME.get(name.strip().lower())


def kinds() -> tuple[str, ...]:
    """Every registered kind's name, in registration order."""
    return tuple(_BY_KIND)


def names() -> tuple[str, ...]:
    """Every name --metric accepts."""
    return tuple(_BY_NAME)
