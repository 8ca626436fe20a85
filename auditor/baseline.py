"""Compare an audit with an earlier audit's JSON: new and fixed findings, layers added or removed, savings delta."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from .errors import AuditError

if TYPE_CHECKING:
    from .results import Audit

BaselineSource = Union[str, Path, dict]  # a JSON report's path, or the report already read


@dataclass(frozen=True)
class BaselineDiff:
    """What changed since the baseline report. Findings are the JSON form of :class:`auditor.results.Finding`
    (the baseline's own come from its file)."""

    new_findings: list[dict[str, Any]] = field(default_factory=list)
    fixed_findings: list[dict[str, Any]] = field(default_factory=list)
    layers_added: list[str] = field(default_factory=list)
    layers_removed: list[str] = field(default_factory=list)
    saved_before: int = 0  # parameters the baseline's reviewed plan saved
    saved_after: int = 0

    @property
    def saved_delta(self) -> int:
        return self.saved_after - self.saved_before

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saved_delta": self.saved_delta}


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AuditError(f"baseline {p} does not exist", "Write one with --format json on the base branch") from None
    except (OSError, ValueError) as exc:
        raise AuditError(f"baseline {p} is not readable JSON: {exc}", "Use a file written by --format json") from None
    if not isinstance(data, dict) or "format_version" not in data or "findings" not in data:
        raise AuditError(f"baseline {p} is not a lowrank-auditor JSON report", "Use a file written by --format json")
    return data


def _key(f: dict[str, Any]) -> tuple:
    return (f["code"], tuple(f.get("layers", [])), f["message"])


def compare(audit: "Audit", base: dict[str, Any]) -> BaselineDiff:
    """``base``: a JSON report as read by :func:`load`."""
    now = [f.to_dict() for f in audit.findings]
    before = base.get("findings", [])
    now_keys = {_key(f) for f in now}
    before_keys = {_key(f) for f in before}
    layers_now = {l.name for l in audit.layers}
    layers_before = {l["name"] for l in base.get("layers", [])}
    return BaselineDiff(
        new_findings=[f for f in now if _key(f) not in before_keys],
        fixed_findings=[f for f in before if _key(f) not in now_keys],
        layers_added=sorted(layers_now - layers_before),
        layers_removed=sorted(layers_before - layers_now),
        saved_before=int((base.get("plan_review") or {}).get("params_saved", 0)),
        saved_after=audit.review.params_saved if audit.review else 0,
    )
