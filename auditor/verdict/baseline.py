"""Compare an audit with an earlier audit's JSON: new and fixed findings, layers added or removed, savings delta."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ..errors import AuditError

if TYPE_CHECKING:
    from ..results import AuditResult

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


MAX_BASELINE_BYTES = 512 * 2**20


def load(path: str | Path) -> dict[str, Any]:
    """An earlier JSON report, checked for what :func:`compare` reads (one AuditError for anything else)."""
    from ..planning.plan import loads_json

    p = Path(path)
    fix = "Use a file written by --format json"
    if not p.exists():
        raise AuditError(f"baseline {p} does not exist", "Write one with --format json on the base branch")
    if not p.is_file():
        raise AuditError(f"baseline {p} is not a regular file", fix)
    try:
        if p.stat().st_size > MAX_BASELINE_BYTES:
            raise AuditError(f"baseline {p} is larger than {MAX_BASELINE_BYTES >> 20} MiB", fix)
        data = loads_json(p.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise AuditError(f"baseline {p} cannot be read: {exc.strerror or exc}", fix) from None
    except RecursionError:
        raise AuditError(f"baseline {p} is nested too deeply to be a report", fix) from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        detail = " ".join(str(exc).split())[:200]
        raise AuditError(f"baseline {p} is not readable JSON: {detail}", fix) from None
    check(data, str(p))
    return data


def check(data: Any, source: str = "baseline") -> None:
    """Raise AuditError unless ``data`` has the shape of a lowrank-auditor JSON report where compare reads it."""
    def bad(what: str) -> AuditError:
        return AuditError(f"baseline {source} is not a lowrank-auditor JSON report: {what}",
                          "Use a file written by --format json")

    if not isinstance(data, dict):
        raise bad("the top level is not an object")
    for key in ("format_version", "findings"):
        if key not in data:
            raise bad(f"'{key}' is missing")
    findings = data["findings"]
    if not isinstance(findings, list):
        raise bad("'findings' is not a list")
    for i, f in enumerate(findings):
        if not isinstance(f, dict) or not isinstance(f.get("code"), str) or not isinstance(f.get("message"), str):
            raise bad(f"finding {i} has no text 'code' and 'message'")
        if not isinstance(f.get("layers", []), list) or not all(isinstance(n, str) for n in f.get("layers", [])):
            raise bad(f"finding {i}: 'layers' is not a list of names")
    layers = data.get("layers", [])
    if not isinstance(layers, list) or not all(isinstance(l, dict) and isinstance(l.get("name"), str) for l in layers):
        raise bad("'layers' is not a list of layers with names")
    review = data.get("plan_review")
    if review is not None:
        saved = review.get("params_saved", 0) if isinstance(review, dict) else None
        if isinstance(saved, bool) or not isinstance(saved, int):
            raise bad("'plan_review' has no whole 'params_saved'")


def _key(f: dict[str, Any]) -> tuple:
    return (f["code"], tuple(f.get("layers", [])), f["message"])


def compare(audit: "AuditResult", base: dict[str, Any]) -> BaselineDiff:
    """``base``: a JSON report as read by :func:`load` (a dict given directly is checked the same way)."""
    check(base)
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
