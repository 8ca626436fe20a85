"""Compression plans: glob patterns over qualified layer names mapped to rank specs, in TOML or JSON.

A rank spec is an integer (``256``), a fraction of break-even (``"0.5be"``) or an energy target (``"energy:0.95"``).
When several patterns match a layer, the last one in the file wins (later lines refine earlier ones).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import lrmath
from .config import tomllib
from .errors import AuditError
from .results import PlanItem, PlanOrigin, PlanReview, PlanVerdict, Verdict

if TYPE_CHECKING:
    from .results import Audit

_BE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*be\s*$", re.I)
_ENERGY = re.compile(r"^\s*energy\s*:\s*([0-9]*\.?[0-9]+)\s*$", re.I)


@dataclass
class Plan:
    ranks: dict[str, Any]  # pattern -> spec, in file order
    finetune: str | None = None
    thresholds: dict[str, Any] = field(default_factory=dict)
    source: str = "plan"

    @classmethod
    def coerce(cls, value: Any) -> "Plan":
        if isinstance(value, Plan):
            return value
        if isinstance(value, (str, Path)):
            return cls.load(Path(value))
        if isinstance(value, dict):
            return cls.from_dict(value, "plan")
        raise AuditError(f"a plan must be a path or a dict, got {type(value).__name__}", "Pass plan='plan.toml'")

    @classmethod
    def load(cls, path: Path) -> "Plan":
        if not path.is_file():
            raise AuditError(f"plan file {path} does not exist", "Write one with --emit-plan, then edit it")
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise AuditError(f"plan file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}",
                             "Fix the syntax (see docs/plan.md)") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> "Plan":
        unknown = set(data) - {"ranks", "finetune", "thresholds"}
        if unknown:
            raise AuditError(f"plan {source} has unknown key(s) {', '.join(sorted(unknown))}",
                             "A plan has [ranks], finetune and [thresholds] only (docs/plan.md)")
        ranks = data.get("ranks", {})
        if not isinstance(ranks, dict):
            raise AuditError(f"plan {source}: 'ranks' must be a table of pattern = rank", 'e.g. "fc1" = 64')
        ft = data.get("finetune")
        thresholds = data.get("thresholds", {})
        if not isinstance(thresholds, dict):
            raise AuditError(f"plan {source}: 'thresholds' must be a table", "e.g. energy_floor = 0.9")
        return cls(dict(ranks), None if ft is None else str(ft), dict(thresholds), source)

    @property
    def has_finetune(self) -> bool:
        if self.finetune is None:
            return False
        text = self.finetune.strip().lower()
        return text not in ("", "0", "none", "no", "false", "0 steps", "0 epochs")


def _rank(spec: Any, layer_name: str, be: float, pattern: str, spectrum: Any, source: str) -> int:
    where = f"plan {source}, pattern {pattern!r}, layer {layer_name}"
    if isinstance(spec, bool):
        raise AuditError(f"{where}: rank {spec!r} is not an integer", "Use an integer, '0.5be' or 'energy:0.95'")
    if isinstance(spec, float):
        if not spec.is_integer():
            raise AuditError(f"{where}: rank {spec} is not an integer", "Ranks are whole numbers")
        spec = int(spec)
    if isinstance(spec, str):
        s = spec.strip()
        if s.lstrip("-").isdigit():
            spec = int(s)
        elif be_match := _BE.match(s):
            spec = max(1, math.floor(float(be_match.group(1)) * be))
        elif energy_match := _ENERGY.match(s):
            e = float(energy_match.group(1))
            if not 0 < e <= 1:
                raise AuditError(f"{where}: energy {e} is out of (0, 1]", "e.g. 'energy:0.95'")
            if spectrum is None or spectrum.sigma is None:
                raise AuditError(f"{where}: 'energy:' needs the layer's spectrum, which was not computed",
                                 "Give an integer rank, or audit with spectra (no --no-spectra, real weights)")
            spec = spectrum.rank_for(e)
        else:
            raise AuditError(f"{where}: cannot read rank {spec!r}", "Use an integer, '0.5be' or 'energy:0.95'")
    if not isinstance(spec, int):
        raise AuditError(f"{where}: rank {spec!r} is not an integer", "Use an integer, '0.5be' or 'energy:0.95'")
    if spec <= 0:
        raise AuditError(f"{where}: rank {spec} must be positive", "Use a rank of at least 1, or remove the line")
    return spec


def resolve(audit: "Audit", plan: Plan) -> list[tuple[str, int, str, str]]:
    """(layer name, rank, spec text, pattern) per planned layer; errors name the layer or suggest close names."""
    names = [l.name for l in audit.layers]
    chosen: dict[str, tuple[int, str, str]] = {}
    for pattern, spec in plan.ranks.items():
        hits = [l for l in audit.layers if fnmatch.fnmatchcase(l.name, pattern) or fnmatch.fnmatchcase(l.param, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.4)
            hint = f"Closest layer names: {', '.join(close)}" if close else "List layers with --format json"
            raise AuditError(f"plan {plan.source}: pattern {pattern!r} matches no factorizable layer", hint)
        for layer in hits:
            r = _rank(spec, layer.name, layer.break_even, pattern, audit.spectra.get(layer.name), plan.source)
            chosen[layer.name] = (r, str(spec), pattern)
    order = {n: i for i, n in enumerate(names)}
    return [(n, r, s, p) for n, (r, s, p) in sorted(chosen.items(), key=lambda kv: order[kv[0]])]


def review_plan(audit: "Audit", plan: Plan | None) -> PlanReview:
    """Each planned layer's rank, savings and energy kept; without a plan, the suggested ranks."""
    if plan is None:
        entries = [(n, s.rank, f"energy:{audit.settings.target_energy:g}", str(PlanOrigin.SUGGESTED))
                   for n, s in audit.suggestions.items() if s.verdict is Verdict.FACTORIZE and s.rank]
        origin, source, finetune = PlanOrigin.SUGGESTED, str(PlanOrigin.SUGGESTED), None
    else:
        entries = resolve(audit, plan)
        origin, source, finetune = PlanOrigin.GIVEN, plan.source, plan.finetune
    items: list[PlanItem] = []
    for name, r, spec, pattern in entries:
        layer = audit.layer(name)
        spectrum = audit.spectra.get(name)
        kept = spectrum.energy_at(r) if spectrum is not None and spectrum.sigma is not None else None
        saves = lrmath.saves(layer.m, layer.n, r) and r <= layer.max_rank
        items.append(PlanItem(
            layer=name, rank=r, spec=spec, pattern=pattern,
            params_before=layer.params, params_after=layer.params_at(r) if saves else layer.params,
            macs_before=layer.macs, macs_after=(layer.macs_at(r) if saves else layer.macs),
            break_even=layer.break_even, compression=layer.compression(r),
            energy_kept=kept, error_bound=lrmath.relative_error(kept) if kept is not None else None,
            verdict=(PlanVerdict.FACTORIZE if saves else
                     PlanVerdict.ABOVE_MAX_RANK if r > layer.max_rank else PlanVerdict.NO_SAVING),
        ))
    macs_known = audit.macs_known
    return PlanReview(
        origin=origin, source=source, items=items, finetune=finetune,
        params_before=sum(i.params_before for i in items), params_after=sum(i.params_after for i in items),
        macs_before=sum(i.macs_before or 0 for i in items) if macs_known else None,
        macs_after=sum(i.macs_after or 0 for i in items) if macs_known else None,
        total_params=audit.total_params,
    )


def emit_toml(audit: "Audit") -> str:
    """The suggested plan as an editable TOML file: one pattern = rank per line."""
    s = audit.settings
    lines = [
        f"# Compression plan suggested by lowrank-auditor for {audit.model_name} ({audit.source}).",
        f"# Ranks keep >= {100 * s.target_energy:g}% spectral energy, rounded up to a multiple of {s.align}.",
        "# Edit a rank (an integer, \"0.5be\" = half the break-even rank, or \"energy:0.95\"), delete a line to keep",
        "# that layer dense, describe the recovery fine-tune, then review it:",
        f"#   lowrank-audit {audit.source} --plan THIS_FILE",
        "",
        'finetune = ""  # the recovery fine-tune budget, e.g. "1 epoch on the training set, lr 1e-4"',
        "",
        "[ranks]",
    ]
    for layer in audit.layers:
        sg = audit.suggestions.get(layer.name)
        if sg is None or sg.verdict is not Verdict.FACTORIZE or sg.rank is None:
            continue
        lines.append(f"{json.dumps(layer.name)} = {sg.rank}  # {100 * (sg.energy_at_rank or 0):.1f}% energy, "
                     f"{sg.compression:.2f}x, break-even {layer.break_even:.1f}, {layer.m}x{layer.n}")
    kept_dense = [l for l in audit.layers if audit.suggestions[l.name].verdict is not Verdict.FACTORIZE]
    if kept_dense:
        lines += ["", "# Left dense:"]
        for l in kept_dense:
            lines.append(f"# {l.name}: {audit.suggestions[l.name].verdict} ({audit.suggestions[l.name].reason})")
    return "\n".join(lines) + "\n"
