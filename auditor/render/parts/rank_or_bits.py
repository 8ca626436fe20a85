"""Rank or bits (``--budget-bytes``) as rows every format draws: one row per plan measured (the three families at
each size, then the uniform baselines), and the prose above them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...calresults import BitsPlan, BitsReport, CalibrationReport

FAMILY_WORDS = {"joint": "rank + bits", "bits": "bits only", "rank": "rank only"}


@dataclass(frozen=True)
class BitsRow:
    size: str  # the size planned for, in words: "at 1.53 MiB, the budget", "baselines"
    plan: str  # the family ("rank + bits", "bits only", "rank only", "uniform int4", ...)
    nbytes: str  # the bytes it takes (the whole model's parameters)
    bits: str  # bits per weight of the layers it can rewrite
    value: str  # measured, in the metric's unit
    interval: str  # its interval for an unseen document (the verification rows' where there is none; "" unsplit)
    holds: str  # "holds" | "misses" | "" (not reached)
    choices: str  # "int4 x10, int4 + rank x2, keep x1"


def _bytes(n: int) -> str:
    """Bytes in binary units: 1.50 MiB.

    >>> _bytes(1572864), _bytes(900)
    ('1.50 MiB', '900 B')
    """
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _row(b: "BitsReport", p: "BitsPlan", cal: "CalibrationReport") -> BitsRow:
    plan = FAMILY_WORDS.get(p.family, p.family)
    if not p.reachable:
        return BitsRow(_group(cal, p), plan, "–", "–", "cannot reach this size", "", "", "")
    bits = 8 * (p.nbytes - b.rest_bytes) / b.weights if b.weights else 0.0
    v = p.verification
    u = v.unseen if v is not None else None
    low, high = (u.low, u.high) if u is not None else (v.low, v.high) if v is not None else (None, None)
    interval = f"{cal.value_text(low)} to {cal.value_text(high)}" if low is not None and high is not None else ""
    choices = ", ".join(f"{k} x{n}" for k, n in sorted(p.counts.items(), key=lambda kv: -kv[1]))
    return BitsRow(_group(cal, p), plan, _bytes(p.nbytes), f"{bits:.2f}", cal.value_text(p.value), interval,
                   "holds" if p.ok else "misses", choices)


def rows(cal: "CalibrationReport") -> list[BitsRow]:
    """The families at each size, then the baselines; empty without a byte plan."""
    b = cal.bits
    if b is None:
        return []
    return [_row(b, p, cal) for p in [*b.plans, *b.baselines]]


def intro(cal: "CalibrationReport") -> str | None:
    """The byte plan's prose: what it chose among, how costs were weighted, and the verdict."""
    b = cal.bits
    if b is None:
        return None
    rows_words = ("on the verification rows the search never read" if any(p.verification for p in b.plans)
                  else "on the held-out rows")
    return (f"Rank or bits at {_bytes(b.budget)} ({b.budget:,} bytes; dense {_bytes(b.dense_bytes)}): {b.layers} "
            f"layers ({b.weights:,} weights) each kept, quantized (int8, int4, int3; groups of 128, float16 scales "
            f"counted), quantized with a rank-8 to 64 correction of its error, or factorized, chosen jointly on "
            f"costs weighted by the {b.weighted}; each plan measured all at once {rows_words}, the tensors "
            f"it does not rewrite ({_bytes(b.rest_bytes)}) as they are. {b.verdict}{_written(b)}")


def _written(b: "BitsReport") -> str:
    """The sentence saying which plan was written where, its file's bytes and its header's; empty if not."""
    if not b.written:
        return ""
    from ...calresults import choices_family

    plan = next(p for p in b.at(b.budget) if p.family == b.written_family)
    kind = {"bits": "quantized", "rank": "factorized", "joint": "quantized and factorized",
            "keep": "dense"}[choices_family(plan.choices)]
    return (f" The plan that measured least harm at the budget ({kind}) is written to "
            f"{b.written}: model.safetensors of {b.file_bytes:,} bytes (the plan's {plan.nbytes:,} and a header of "
            f"{b.header_bytes:,}).")


HEADERS = ("planned for", "plan", "bytes", "bits/weight", "measured", "interval (unseen document)", "judged",
           "choices")


def _group(cal: "CalibrationReport", p: "BitsPlan") -> str:
    """What a plan's size is: "at 2,627,696 bytes (2.51 MiB), the budget", "... uniform int4's size"; "baselines"
    (exact bytes: two sizes a few bytes apart are not written alike)."""
    b = cal.bits
    assert b is not None
    if p in b.baselines:
        return "baselines"
    named = [("the budget", b.budget), ("the audit's rank plan's size", b.rank_plan_size),
             *((f"{q.family}'s size", q.size) for q in b.baselines if q.family.startswith("uniform int"))]
    what = [w for w, size in named if size == p.size]
    return f"at {p.size:,} bytes ({_bytes(p.size)}), {' and '.join(what) or 'a size measured'}"
