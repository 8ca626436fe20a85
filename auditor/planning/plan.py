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

from .. import lrmath
from ..config import tomllib
from ..errors import AuditError, no_duplicate_keys
from .groups import escape_glob, plan_globs, toml_string
from ..results import PlanItem, PlanOrigin, PlanReview, PlanVerdict, Verdict

if TYPE_CHECKING:
    from ..results import AuditResult

_INT = re.compile(r"^\s*([0-9]+)\s*$", re.ASCII)
_BE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*be\s*$", re.I | re.ASCII)
_ENERGY = re.compile(r"^\s*energy\s*:\s*([0-9]*\.?[0-9]+)\s*$", re.I | re.ASCII)
MAX_RANK = 2**31 - 1  # no matrix a model holds has more rows; a larger rank is a typo, refused when the plan is read
MAX_PLAN_BYTES = 16 * 2**20  # a plan is a small text file
_SPEC_HINT = "Use a whole number such as 64, a fraction of break-even such as '0.5be', or 'energy:0.95'"


@dataclass
class Plan:
    ranks: dict[str, Any]  # pattern -> spec, in file order
    finetune: str | None = None
    thresholds: dict[str, Any] = field(default_factory=dict)
    source: str = "plan"
    compute_dtype: str | None = None  # the dtype the audit read statistics in ("float32"); factorize reads them so
    ties: tuple[tuple[str, ...], ...] = ()  # groups of layer patterns whose ranks must be equal (planning/ties.py)

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
        """Read a TOML or JSON plan (JSON when the name ends in .json). Every defect is one AuditError: not a
        regular file, too large, not UTF-8, bad syntax, duplicate keys, NaN/Infinity, nesting too deep."""
        path = Path(path)
        if not path.exists():
            raise AuditError(f"plan file {path} does not exist", "Write one with --emit-plan, then edit it")
        if not path.is_file():
            raise AuditError(f"plan {path} is not a regular file", "Pass a .toml or .json plan file")
        try:
            size = path.stat().st_size
            if size > MAX_PLAN_BYTES:
                raise AuditError(f"plan file {path} is {size:,} bytes; a plan is a small text file",
                                 "Pass a plan written by --emit-plan (docs/plan.md)")
            raw = path.read_bytes()
        except OSError as exc:
            raise AuditError(f"cannot read plan file {path}: {exc.strerror or exc}", "Check the path") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AuditError(f"plan file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                             "Save it as UTF-8") from None
        is_json = path.suffix.lower() == ".json"
        kind = "JSON" if is_json else "TOML"
        try:
            data = loads_json(text) if is_json else tomllib.loads(text)
        except RecursionError:
            raise AuditError(f"plan file {path} is nested too deeply to be a plan", "See docs/plan.md") from None
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            detail = " ".join(str(exc).split())[:200]
            raise AuditError(f"plan file {path} is not valid {kind}: {detail}",
                             "Fix the syntax (see docs/plan.md)") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str) -> "Plan":
        """A plan from its parsed form; rank specs are checked here (their syntax), ranks per layer in review."""
        if not isinstance(data, dict):
            raise AuditError(f"plan {source} is {_what(data)}, not a table of ranks",
                             'A plan has a [ranks] table such as "fc1" = 64 (docs/plan.md)')
        unknown = set(map(str, data)) - {"ranks", "finetune", "thresholds", "compute_dtype", "ties"}
        if unknown:
            shown = ", ".join(repr(k) for k in sorted(unknown)[:5]) + (", ..." if len(unknown) > 5 else "")
            raise AuditError(f"plan {source} has unknown key(s) {shown}",
                             "A plan has [ranks], finetune, [thresholds], compute_dtype and ties only (docs/plan.md)")
        ranks = data.get("ranks", {})
        if not isinstance(ranks, dict):
            raise AuditError(f"plan {source}: 'ranks' is {_what(ranks)}, not a table of pattern = rank",
                             'e.g. [ranks] "fc1" = 64')
        for pattern, spec in ranks.items():
            if not isinstance(pattern, str) or not pattern:
                raise AuditError(f"plan {source}: pattern {pattern!r} is not a layer name or glob",
                                 'e.g. "encoder.layer.*.intermediate.dense" = 256')
            check_spec(spec, pattern, source)
        ft = data.get("finetune")
        if ft is not None and not isinstance(ft, str):
            raise AuditError(f"plan {source}: 'finetune' is {_what(ft)}, not text",
                             'e.g. finetune = "1 epoch on the training set, lr 1e-4"')
        thresholds = data.get("thresholds", {})
        if not isinstance(thresholds, dict):
            raise AuditError(f"plan {source}: 'thresholds' is {_what(thresholds)}, not a table",
                             "e.g. [thresholds] energy_floor = 0.9")
        compute = data.get("compute_dtype")
        if compute is not None and compute not in ("model", "float32"):
            raise AuditError(f"plan {source}: 'compute_dtype' is {_what(compute)}, not \"model\" or \"float32\"",
                             'e.g. compute_dtype = "float32" (the dtype its statistics were read in)')
        return cls(dict(ranks), ft, dict(thresholds), source, None if compute in (None, "model") else compute,
                   _ties(data.get("ties", []), source))

    @property
    def has_finetune(self) -> bool:
        if self.finetune is None:
            return False
        text = self.finetune.strip().lower()
        return text not in ("", "0", "none", "no", "false", "0 steps", "0 epochs")


def _ties(value: Any, source: str) -> tuple[tuple[str, ...], ...]:
    """A plan's ``ties``: a list of groups, each "q_proj,k_proj,v_proj" or a list of patterns (``--tie``'s forms)."""
    from ..options import tie_specs

    if not isinstance(value, list) or not all(isinstance(g, str) or (isinstance(g, list) and all(
            isinstance(p, str) for p in g)) for g in value):
        raise AuditError(f"plan {source}: 'ties' is {_what(value)}, not a list of tie groups",
                         'e.g. ties = ["q_proj,k_proj,v_proj", "gate_proj,up_proj"]')
    try:
        return tie_specs(value)
    except AuditError as exc:
        raise AuditError(f"plan {source}: ties: {exc.what.removeprefix('--tie ')}", exc.fix) from None


def _what(value: Any) -> str:
    """A value's kind in a user's words: 'a list', 'text', 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"text ({value[:40]!r})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    return {dict: "a table", list: "a list"}.get(type(value), f"a {type(value).__name__}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def loads_json(text: str) -> Any:
    """Strict JSON: duplicate keys and NaN/Infinity are errors (``json.loads`` keeps the last duplicate silently
    and reads NaN); numbers too large for a float are errors too."""
    def big_float(s: str) -> float:
        v = float(s)
        if not math.isfinite(v):
            raise ValueError(f"number {s[:30]} is too large")
        return v

    return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_no_constant, parse_float=big_float)


def check_spec(spec: Any, pattern: str, source: str) -> None:
    """Raise AuditError unless ``spec`` is a rank spec: a whole number 1..MAX_RANK (not a bool, not a float),
    ``"<x>be"`` with x > 0, or ``"energy:<e>"`` with 0 < e <= 1."""
    literal = not any(c in pattern for c in "*?[")
    where = f"plan {source}, layer {pattern}" if literal else f"plan {source}, pattern {pattern!r}"
    if isinstance(spec, dict):
        raise AuditError(f"{where}: is a table, not a rank (an unquoted dotted pattern makes nested tables)",
                         f'Quote the pattern: "{pattern}.…" = 64')
    if isinstance(spec, (bool, float)):
        shown = str(spec).lower() if isinstance(spec, bool) else repr(spec)
        raise AuditError(f"{where}: rank {shown} is not an integer", _SPEC_HINT)
    if not isinstance(spec, (int, str)):
        raise AuditError(f"{where}: rank {_what(spec)} is not a rank spec", _SPEC_HINT)
    if isinstance(spec, str):
        if m := _INT.match(spec):
            spec = int(m.group(1)) if len(m.group(1)) < 20 else MAX_RANK + 1
        elif m := _BE.match(spec):
            if not 0 < float(m.group(1)) <= 1e6:
                raise AuditError(f"{where}: rank {spec!r} must be a fraction above 0 of break-even",
                                 "e.g. '0.5be' (half the break-even rank)")
            return
        elif m := _ENERGY.match(spec):
            if not 0 < float(m.group(1)) <= 1:
                raise AuditError(f"{where}: energy {spec!r} is out of (0, 1]", "e.g. 'energy:0.95'")
            return
        else:
            raise AuditError(f"{where}: cannot read rank {spec[:60]!r}", _SPEC_HINT)
    if spec <= 0:
        raise AuditError(f"{where}: rank {spec} must be positive", "Use a rank of at least 1, or remove the line")
    if spec > MAX_RANK:
        raise AuditError(f"{where}: rank {str(spec)[:30]} is larger than any matrix", _SPEC_HINT)


def _rank(spec: Any, layer_name: str, be: float, pattern: str, spectrum: Any, source: str) -> int:
    """The rank ``spec`` (checked by :func:`check_spec`) asks for at this layer."""
    check_spec(spec, pattern, source)
    where = f"plan {source}, pattern {pattern!r}, layer {layer_name}"
    if isinstance(spec, int):
        return spec
    if m := _INT.match(spec):
        return int(m.group(1))
    if m := _BE.match(spec):
        r = math.floor(float(m.group(1)) * be)
        if r < 1:
            raise AuditError(f"{where}: {spec!r} of break-even {be:.1f} is rank {r}",
                             "Use a larger fraction, or an integer rank of at least 1")
        return r
    m = _ENERGY.match(spec)
    assert m is not None
    if spectrum is None or spectrum.sigma is None:
        raise AuditError(f"{where}: 'energy:' needs the layer's spectrum, which was not computed",
                         "Give an integer rank, or audit with spectra (no --no-spectra, real weights)")
    return int(spectrum.rank_for(float(m.group(1))))


def resolve(audit: "AuditResult", plan: Plan) -> list[tuple[str, int, str, str]]:
    """(layer name, rank, spec text, pattern) per planned layer; errors name the layer or suggest close names."""
    names = [l.name for l in audit.layers]
    chosen: dict[str, tuple[int, str, str]] = {}
    for pattern, spec in plan.ranks.items():
        hits = [l for l in audit.layers if fnmatch.fnmatchcase(l.name, pattern) or fnmatch.fnmatchcase(l.param, pattern)]
        if not hits:
            tied = [l for l in audit.layers for a in l.aliases
                    if fnmatch.fnmatchcase(a, pattern) or fnmatch.fnmatchcase(a.rpartition(".")[0], pattern)]
            if tied:  # a tied weight's other name: one tensor, listed once under its first owner
                t = tied[0]
                raise AuditError(f"plan {plan.source}: pattern {pattern!r} names a tied weight: one tensor with the "
                                 f"names {', '.join([t.param, *t.aliases])}, audited as layer {t.name}",
                                 f"Plan it as {t.name!r} (every use changes at once, LR006; lowrank-audit factorize "
                                 "refuses tied weights), or untie the weights in the model first")
            candidates = list(dict.fromkeys([*names, *(l.param for l in audit.layers)]))
            close = difflib.get_close_matches(pattern, candidates, n=3, cutoff=0.4)
            hint = f"Closest layer names: {', '.join(close)}" if close else "List layers with --format json"
            raise AuditError(f"plan {plan.source}: pattern {pattern!r} matches no factorizable layer", hint)
        for layer in hits:
            r = _rank(spec, layer.name, layer.break_even, pattern, audit.spectra.get(layer.name), plan.source)
            chosen[layer.name] = (r, str(spec), pattern)
    order = {n: i for i, n in enumerate(names)}
    return [(n, r, s, p) for n, (r, s, p) in sorted(chosen.items(), key=lambda kv: order[kv[0]])]


def _narrow(audit: "AuditResult", name: str) -> bool:
    """Whether the audit skips this layer as narrow (the layers table and "Skipped layers" say so)."""
    sg = audit.suggestions.get(name)
    return sg is not None and sg.verdict is Verdict.SKIP_NARROW


def review_plan(audit: "AuditResult", plan: Plan | None) -> PlanReview:
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
            verdict=(PlanVerdict.NARROW if saves and _narrow(audit, name) else
                     PlanVerdict.FACTORIZE if saves else
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


def _comment(text: str) -> str:
    """``text`` safe inside a ``#`` comment line: control, line-separator and bidi characters escaped as ``\\uXXXX``
    (a name can never end the comment and start live TOML), lone surrogates as ``\\udXXX``."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return toml_string(text)[1:-1]


def shared(layer: Any) -> bool:
    """Whether a layer is tied or shared, as LR006 decides (more than one name, more than one use site, or more
    than one call per forward): the suggested plan never targets one."""
    return bool(layer.tied or layer.calls > 1)


def _key(name: str) -> Any:
    """A ``[ranks]`` key for tomlkit: always a quoted (basic) string, so a pattern with dots is one key and never a
    nested table. tomlkit escapes quotes, backslashes and control characters; a name that also holds a C1,
    line-separator or bidirectional-override character (which TOML allows raw, but which would reorder or hide what
    a reader sees) is written with those as ``\\uXXXX`` escapes too."""
    from tomlkit.items import KeyType, SingleKey

    if any(_hidden_char(c) for c in name):
        return SingleKey(name, KeyType.Basic, original=toml_string(name))
    return SingleKey(name, KeyType.Basic)


def _comment_text(text: str) -> str:
    """Our own text on a ``#`` line: quotes and backslashes as they are, but every control, line-separator, C1 and
    bidi character (which could end the comment or reorder it) and lone surrogate as a visible escape. Names go
    through :func:`_comment` first, which escapes their quotes and backslashes too."""
    out = []
    for c in text:
        if 0xD800 <= ord(c) <= 0xDFFF:
            out.append(f"\\u{ord(c):04x}")
        elif ord(c) < 0x20 or _hidden_char(c):
            out.append(toml_string(c)[1:-1])
        else:
            out.append(c)
    return "".join(out)


def _hidden_char(c: str) -> bool:
    o = ord(c)
    return 0x7F <= o <= 0x9F or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069 or c in "\u2028\u2029"


def _measured_alone(audit: "AuditResult", members: list[str], rank: int) -> str | None:
    """With calibration, what the layers' ranks were chosen by instead of energy: the largest single-layer error
    measured at this rank (tier 2), else the largest tier-1 layer-output error at it; None without calibration."""
    cal = audit.calibration
    if cal is None or cal.budget is None:
        return None
    measured, tier1 = [], []
    for n in members:
        lc = cal.layers.get(n)
        if lc is None or not lc.spans:
            return None
        pts = dict(lc.floor.points) if lc.floor is not None else {}
        if rank in pts:
            measured.append(pts[rank])
        else:
            curve = dict(lc.curve)
            if rank in curve:
                tier1.append(curve[rank])
    if measured and len(measured) == len(members):
        return f"alone: {_comment(cal.metric)} {max(measured):.3g} (measured)"
    if tier1 and len(tier1) == len(members):
        return f"alone: layer-output error {max(tier1):.3g} (tier 1)"
    return "rank chosen by the all-at-once search"


def plan_basis(audit: "AuditResult") -> list[str]:
    """The header comment lines saying how the emitted ranks were chosen and measured."""
    s = audit.settings
    cal = audit.calibration
    b = cal.budget if cal is not None else None
    if b is None:
        return [f"Ranks keep >= {100 * s.target_energy:g}% spectral energy, rounded up to a multiple of {s.align}."]
    curves = "measured-floor" if cal.measured_floors else "tier-1 (whitened)"
    cap = f" for a budget of {100 * b.budget:g}% of the parameters removed" if b.budget is not None else ""
    pc = cal.plan_check
    measured = (f"Measured all at once on {cal.holdout_rows:,} held-out rows: {_comment(cal.metric)} "
                f"{pc.measured:.4g} against the tolerance {cal.tolerance:g} ({'holds' if pc.ok else 'MISSES'})."
                if pc is not None and pc.layers else "Not measured all at once: no planned layer.")
    if not b.plan and not b.nothing_to_plan:
        held = ", ".join(f"within {cal.facts.loosened(lp.tolerance).tolerance_words()} "
                         + (f"{100 * lp.removed_fraction:.1f}% removed ({cal.value_text(lp.metric)})"
                            if lp.metric is not None else "none") for lp in b.looser)
        measured = (f"Nothing can be removed within the tolerance {cal.tolerance_text()}: none of the plans measured "
                    "holds it, so this plan is empty." + (f" Looser tolerances, the largest plan measured: {held}."
                                                          if held else ""))
    if pc is not None and pc.layers and pc.verification is not None:
        v = pc.verification
        measured = (f"Measured all at once on {v.rows:,} verification rows the search never read (it searched "
                    f"{v.search_rows:,}): {_comment(v.words(cal.tolerance, cal.metric))}.")
    if pc is not None and pc.layers and pc.fit:
        measured += f" The factors fitted {pc.fit}, as lowrank-audit factorize writes them by default."
    import textwrap

    text = (f"Ranks: the largest plan{cap} that holds the tolerance all at once, searched over the {curves} curves "
            f"({b.evaluations} plans factorized and measured); per-layer floors are evidence, not the plan.")
    out = [*textwrap.wrap(text, 112), *textwrap.wrap(measured, 112)]
    note = cal.recovery_note()
    if note:
        rc = b.recovery
        out += textwrap.wrap(f"Chosen after recovery (--choose-after-recovery): the plan {_comment(note)}. Budget "
                             f"that fine-tune before adopting it (distillation toward the dense model, lr "
                             f"{rc.lr:g}, {rc.trainable}, seed {rc.seed}; "
                             f"{rc.command()}).", 112)
    return out


def default_header(audit: "AuditResult") -> list[str]:
    """The comment lines at the top of an emitted plan (without their ``# ``): what it is, how the ranks were
    chosen, how to edit and review it."""
    return [
        f"Compression plan suggested by lowrank-auditor for {_comment(audit.model_name)} ({_comment(audit.source)}).",
        *plan_basis(audit),
        "Edit a rank (an integer, \"0.5be\" = half the break-even rank, or \"energy:0.95\"), delete a line to keep",
        "that layer dense, describe the recovery fine-tune, then review it:",
        f"  lowrank-audit {_comment(audit.source)} --plan THIS_FILE",
    ]


def emit_toml(audit: "AuditResult", header: list[str] | None = None) -> str:
    """The suggested plan as an editable TOML file that passes its own review, written with tomlkit: one
    ``pattern = rank`` per layer or group (``model.layers.*.mlp.down_proj`` where every member has one rank), each
    pattern a quoted TOML key that selects exactly its layers (glob characters in names escaped), each with a
    comment saying what the rank keeps. ``header``: the comment lines at the top (default :func:`default_header`).
    Tied or shared weights (LR006) and layers left dense appear only in comments, their names escaped so no name
    can become TOML."""
    import tomlkit

    doc = tomlkit.document()
    for line in (default_header(audit) if header is None else header):
        doc.add(tomlkit.comment(_comment_text(line)))
    doc.add(tomlkit.nl())
    doc.add("finetune", "")
    _note(doc["finetune"], 'the recovery fine-tune budget, e.g. "1 epoch on the training set, lr 1e-4"')
    compute = getattr(audit.calibration, "compute_dtype", None) if audit.calibration is not None else None
    if compute:  # factorize reads the statistics (its whitened initialisation) in the dtype these ranks came from
        doc.add("compute_dtype", compute)
        _note(doc["compute_dtype"], "the dtype calibration statistics were read in; factorize reads them so too")
    if audit.ties:  # the ranks were chosen with these groups equal; the review of the edited plan checks them (LR021)
        doc.add("ties", list(dict.fromkeys(g.label.replace("/", ",") for g in audit.ties)))
        _note(doc["ties"], "layers whose ranks must be equal in each block (--tie), for fused kernels")
    doc.add(tomlkit.nl())
    table = tomlkit.table()
    ranks, tied, unwritable = _emitted_ranks(audit)
    _add_rank_lines(table, audit, ranks)
    _add_tied_comments(table, audit, tied)
    _add_dense_comments(table, audit, unwritable)
    doc.add("ranks", table)
    return tomlkit.dumps(doc)


def _emitted_ranks(audit: "AuditResult") -> tuple[dict[str, int], list[str], list[str]]:
    """The factorized layers' ranks to write, the tied ones (comments only), and those whose name no TOML holds."""
    ranks: dict[str, int] = {}
    tied: list[str] = []
    unwritable: list[str] = []
    for layer in audit.layers:
        sg = audit.suggestions.get(layer.name)
        if sg is None or sg.verdict is not Verdict.FACTORIZE or sg.rank is None:
            continue
        try:
            toml_string(layer.name)
        except ValueError:
            unwritable.append(layer.name)
            continue
        if shared(layer):
            tied.append(layer.name)
        else:
            ranks[layer.name] = sg.rank
    return ranks, tied, unwritable


def _add_rank_lines(table: Any, audit: "AuditResult", ranks: dict[str, int]) -> None:
    """One ``pattern = rank`` line per layer or group, with its comment saying what the rank keeps."""
    names = [l.name for l in audit.layers]
    globs = plan_globs(ranks, names=names, also_matched={l.param: l.name for l in audit.layers})
    for glob, r in globs.items():
        members = [n for n in ranks if fnmatch.fnmatchcase(n, glob)] or [n for n in ranks if escape_glob(n) == glob]
        layer = audit.layer(members[0])
        sgs = [audit.suggestions[n] for n in members]
        energy = min(sg.energy_at_rank or 0 for sg in sgs)
        alone = _measured_alone(audit, members, r)
        if len(members) == 1:
            kept = alone if alone is not None else f"{100 * energy:.1f}% energy"
            note = f"{kept}, {sgs[0].compression:.2f}x, break-even {layer.break_even:.1f}, {layer.m}x{layer.n}"
        elif alone is not None:
            shapes = "/".join(dict.fromkeys(f"{audit.layer(n).m}x{audit.layer(n).n}" for n in members))
            note = f"{len(members)} layers of {shapes}; {alone}"
        else:
            shapes = "/".join(dict.fromkeys(f"{audit.layer(n).m}x{audit.layer(n).n}" for n in members))
            note = f"{len(members)} layers of {shapes}, each keeping >= {100 * energy:.1f}% energy"
        key = _key(glob)
        table.add(key, r)
        _note(table[glob], note)


def _add_tied_comments(table: Any, audit: "AuditResult", tied: list[str]) -> None:
    """Tied or shared weights (LR006): their lines commented out, with every name they go by."""
    import tomlkit

    if not tied:
        return
    table.add(tomlkit.nl())
    table.add(tomlkit.comment("Tied or shared weights are not targeted (LR006): factorizing one changes every "
                              "use at once."))
    table.add(tomlkit.comment("Untie it first, or check the error at every use, then uncomment its line:"))
    for name in tied:
        layer = audit.layer(name)
        also = ", ".join(_comment(a) for a in [layer.param, *layer.aliases])
        line = tomlkit.document()  # the line it would be, rendered by tomlkit, then commented out
        line.add(_key(escape_glob(name)), audit.suggestions[name].rank)
        table.add(tomlkit.comment(_comment_text(f"{line.as_string().strip()}  # names {also}; {layer.calls} "
                                                "use(s) per forward")))


def _add_dense_comments(table: Any, audit: "AuditResult", unwritable: list[str]) -> None:
    """The layers left dense, each with its verdict and reason, and those whose name no TOML file can hold."""
    import tomlkit

    kept_dense = [l for l in audit.layers if audit.suggestions[l.name].verdict is not Verdict.FACTORIZE]
    if not (kept_dense or unwritable):
        return
    table.add(tomlkit.nl())
    table.add(tomlkit.comment("Left dense:"))
    for l in kept_dense:
        sg = audit.suggestions[l.name]
        table.add(tomlkit.comment(f"{_comment(l.name)}: {sg.verdict} ({_comment(sg.reason)})"))
    for name in unwritable:
        table.add(tomlkit.comment(f"{_comment(name)}: its name holds a lone surrogate, which no TOML file can "
                                  "hold"))


def _note(item: Any, text: str) -> None:
    """An inline comment after a value, two spaces before its ``#``."""
    item.comment(_comment_text(text))
    item.trivia.comment_ws = "  "
