"""The calibration stage's result as plain data (no torch, no I/O): what ``Audit.calibration`` holds and what the
renderers and rules read. These are also what the tiers return: tier 2 (``calibration.sweep``) gives a
:class:`LayerFloor` per layer, tier 3 (``calibration.budget``) a :class:`BudgetResult` with its
:class:`FrontierPlan` points; the stage puts them into the report as they are.

A field marked ``WORKING`` is the measuring code's (where a search started, each plan's ranks, every plan tried):
it lives on the object but is not part of the report (:meth:`CalibrationReport.to_dict` leaves it out)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

WORKING = {"report": False}  # dataclass field metadata: kept on the object, left out of the report


def working(default: Any = None, factory: Any = None) -> Any:
    """A field the tiers fill for their callers that the report leaves out."""
    if factory is not None:
        return field(default_factory=factory, metadata=WORKING)
    return field(default=default, metadata=WORKING)


def report_dict(obj: Any) -> Any:
    """``dataclasses.asdict`` without the ``WORKING`` fields (tuples stay tuples, as there)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: report_dict(getattr(obj, f.name)) for f in fields(obj) if f.metadata.get("report", True)}
        if isinstance(obj, UnseenInterval):  # which interval it is, in the report's words
            out["label"] = obj.label
        return out
    if isinstance(obj, dict):
        return {k: report_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(report_dict(v) for v in obj)
    return obj

ERROR_TARGETS = ("0.01", "0.02", "0.05", "0.1")  # keys of LayerCalibration.ranks_for: layer-output error
CURVE_POINTS = 48  # the error curve is subsampled to at most this many ranks (log-spaced, every rank when fewer)


@dataclass
class LayerFloor:
    """Tier 2 for one layer: the measured floor and the points measured on the way (rank, model-level metric)."""

    floor: int | None  # smallest grid rank holding there and at every larger rank tried; None: none held
    metric_at_floor: float | None
    cliff_rank: int | None  # one grid step below the floor
    cliff_metric: float | None
    compression: float | None
    keep_dense: bool  # "keep dense (measured)": no rank below break-even holds
    points: list[tuple[int, float]] = field(default_factory=list)  # (rank, metric), by rank
    reason: str = ""
    layer: str = working("")
    start_rank: int | None = working(None)  # where the search started (the tier-1 rank, aligned)
    top1: dict[int, float] = working(factory=dict)  # rank -> top-1 agreement (built-in metrics)
    init: str = working("whitened")  # "whitened" | "svd" (no input statistics) | "" (not swept)


@dataclass(frozen=True)
class LayerCalibration:
    """Tier 1 (and tier 2 when measured) for one layer: built once, by the calibration stage, from what its passes
    returned."""

    layer: str
    rows: int  # calibration rows the layer saw (tokens, positions, patches, lookups)
    width: int  # its input width n
    ranks_for: dict[str, int]  # layer-output error target ("0.01") -> smallest rank meeting it
    suggested: int | None  # data-aware rank (aligned, below break-even); None: keep dense
    verdict: str  # "factorize" | "keep dense"
    reason: str
    curve: list[tuple[int, float]]  # (rank, layer-output relative error), subsampled
    damping: float = 0.0
    approximate: str = ""  # why the error is an estimate for this layer; empty when exact
    floor: LayerFloor | None = None
    seen: int | None = None  # input directions the calibration saw: ids looked up (embeddings), rank of X^T X
    spans: bool = True  # the calibration saw every input direction (seen == width); else in no plan: kept dense
    probes: list[tuple[int, float]] = field(default_factory=list)  # (rank, metric) measured alone: tier 3's gains
    predicted: list[tuple[int, float]] = field(default_factory=list)  # (rank, metric) alone, predicted from gradients

    @property
    def singular(self) -> bool:
        return self.rows < self.width


@dataclass
class FrontierRecovery:
    """One frontier plan measured again after the recovery fine-tune (``auditor.recover.recover``: distillation
    toward the dense model on the fit rows, from the whitened factors the plan was measured at; held-out rows only
    measured). ``metric``/``ok``/``top1`` are the held-out measurement of the state recovery kept."""

    metric: float
    ok: bool
    top1: float | None
    steps: int  # training steps taken
    rows: int  # fit rows trained on (the rows of every batch stepped, repeats counted)
    tokens: int  # output positions trained on: tokens for a language model, examples for a classifier
    seconds: float  # the training steps and the measurements, for this plan
    kept_step: int  # the step whose state was kept (lowest fit loss; 0: the factorized initialisation)
    stopped: str | None = None  # why the run ended before its steps, or None


@dataclass
class RecoverySetup:
    """How the frontier was measured again after recovery (``--recover STEPS`` with the audit's ``--budget``)."""

    steps: int
    lr: float
    trainable: str  # "factors" | "all"
    objective: str  # "auto" | "kl" | "mse" as asked
    seed: int
    choose_after: bool  # --choose-after-recovery: the suggestion is chosen on the recovered curve
    seconds: float = 0.0  # every plan's recovery together

    def command(self) -> str:
        """The ``lowrank-audit factorize`` flags that repeat this recovery as it was measured (every setting spelled
        out, the learning rate as its exact float), for an emitted plan or a finding to quote.

        >>> RecoverySetup(40, 1e-4, "factors", "mse", 0, True).command()
        'lowrank-audit factorize --recover 40 --recover-lr 0.0001 --recover-trainable factors --recover-objective mse'
        """
        return (f"lowrank-audit factorize --recover {int(self.steps)} --recover-lr {float(self.lr)!r} "
                f"--recover-trainable {self.trainable} --recover-objective {self.objective}")


@dataclass(frozen=True)
class UnseenInterval:
    """The interval for a document the tool never read: whole documents resampled (``kind`` "documents": the
    calibration said which rows belong together) or contiguous blocks of ``block`` rows (``kind`` "blocks": it did
    not), at the verification's confidence. ``groups``: the documents, or the blocks of one draw; ``unit``: what the
    documents are ("files", "documents") or the rows are ("windows", "rows")."""

    low: float
    high: float
    kind: str  # "documents" | "blocks"
    groups: int
    unit: str
    block: int = 0  # rows per block (blocks only)

    @property
    def label(self) -> str:
        """Which interval it is: "documents: 12 files" or "block bootstrap, blocks of 8 windows".

        >>> UnseenInterval(0.1, 0.2, "documents", 12, "files").label
        'documents: 12 files'
        >>> UnseenInterval(0.1, 0.2, "blocks", 21, "windows", 8).label
        'block bootstrap, blocks of 8 windows'
        """
        if self.kind == "documents":
            return f"documents: {self.groups:,} {self.unit}"
        return f"block bootstrap, blocks of {self.block:,} {self.unit}"


@dataclass
class Verification:
    """A plan measured on the verification rows (held out, never read by the search): the value and its bootstrap
    interval over rows at ``confidence`` (None: a user metric, or one row), and beside it ``unseen``, the interval for
    a document the tool never read (whole documents or blocks of rows resampled). ``ok``: the upper end of the
    unseen interval (the row interval's where there is none) is within the tolerance; ``straddles``: that interval
    holds the tolerance inside it (neither a pass nor a miss); ``rows_needed``: verification rows that would resolve
    the tolerance (half-width a quarter of it), None when these do."""

    value: float
    low: float | None
    high: float | None
    confidence: float
    rows: int
    ok: bool
    straddles: bool
    rows_needed: int | None = None
    search_rows: int = 0  # the held-out rows the search measured on
    reference: float | None = None  # the dense model's perplexity on the verification rows (perplexity metrics)
    unseen: UnseenInterval | None = None  # the interval for a document the tool never read
    fit: str = ""  # how the measured model's factors were fitted (apply.Fit.label); "": the search's truncation

    def words(self, tolerance: float, metric: str = "") -> str:
        """"<metric> V (90% interval L to H over N verification rows): within/straddles/misses the tolerance T"."""
        u = self.unseen
        unseen = f"; for an unseen document {u.low:.4g} to {u.high:.4g}, {u.label}" if u is not None else ""
        ci = (f" ({100 * self.confidence:g}% interval {self.low:.4g} to {self.high:.4g} over {self.rows:,} "
              f"verification rows{unseen})" if self.low is not None and self.high is not None
              else f" (on {self.rows:,} verification rows, no interval)")
        value = f"{self.value:.4g}" if not math.isinf(self.value) else "-infinite" if self.value < 0 else "infinite"
        return f"{metric + ' ' if metric else ''}{value}{ci}: {self.judged} {tolerance:g}"

    @property
    def judged(self) -> str:
        """What the interval says of the tolerance: within it, straddling it, or missing it."""
        return ("within the tolerance" if self.ok else "straddles the tolerance" if self.straddles
                else "misses the tolerance")


@dataclass
class UniformBaseline:
    """SVD-LLM's uniform whitened truncation beside a plan: every planned layer kept at one share ``kept`` of its
    break-even rank m*n/(m+n) (rank round(kept * m*n/(m+n)), at least 1; a layer whose rank would save nothing left
    dense), the share chosen so that it removes as close to the plan's parameters as integer ranks allow, its factors
    the whitened truncation of the same statistics, measured all at once on the plan's rows with the plan's metric
    (``rows``: the search rows read; ``verification``: on the verification rows, beside the plan's own)."""

    kept: float  # the share of each layer's break-even rank kept
    layers: int  # layers factorized (the plan's fixed layers included, at their fixed ranks)
    removed: int
    removed_fraction: float
    metric: float
    ok: bool
    rows: int = 0  # the search rows it was measured on (the plan's); 0: the held-out rows of an unsplit session
    verification: "Verification | None" = None
    ranks: dict[str, int] = working(factory=dict)  # the uniform plan's ranks


@dataclass
class FrontierPlan:
    """A plan measured all at once: parameters removed against the model-level metric (before any fine-tune), and
    with ``--recover`` the same plan measured again after the recovery fine-tune (``recovered``)."""

    removed: int
    removed_fraction: float
    metric: float
    ok: bool
    layers: int  # planned layers
    top1: float | None = None
    target: int = working(0)  # parameters the allocation aimed to remove
    plan: dict[str, int] = working(factory=dict)  # the plan's ranks
    predicted_cost: float = working(0.0)  # the summed single-layer costs the allocation predicted
    rows: int = working(0)  # the search rows its metric was measured on (a subsample far from the tolerance)
    recovered: FrontierRecovery | None = None  # after the recovery fine-tune (--recover); None: not recovered
    status: str = ""  # what happened to it (:data:`PLAN_STATUSES`), set once the search and verification are done
    verification: "Verification | None" = None  # the plan on the verification rows, where it was verified
    backstop: bool = working(False)  # measured below the plan found as the verification's fallback
    uniform: UniformBaseline | None = None  # uniform whitened truncation removing the same share, same rows


PLAN_STATUSES = {
    "suggested": "the suggested plan",
    "held": "held on the search rows (not verified)",
    "failed": "failed on the search rows",
    "failed verification": "held on the search rows, failed verification",
    "backstop": "held on the search rows; a fallback below the plan, not needed",
    "dense": "the dense model (nothing removed)",
}


def plan_status(p: FrontierPlan, chosen: dict[str, int]) -> str:
    """What happened to one measured plan (a key of :data:`PLAN_STATUSES`), ``chosen`` the suggested plan's ranks."""
    if p.plan == chosen and chosen:
        return "suggested"
    if not p.plan:
        return "dense"
    if not p.ok:
        return "failed"
    if p.verification is not None and not p.verification.ok:
        return "failed verification"
    return "backstop" if p.backstop else "held"


@dataclass
class TieCost:
    """What the tie groups (``--tie``) cost the plan in removal, on the search's predicted costs: the most the curves
    remove at the chosen plan's predicted cost with every tie (``removed``) and with none (``untied``), and each
    tie's part (``each``: tie -> share of the model's parameters, each measured against the ties before it, so the
    parts add up to the whole); ``dense``: the groups kept dense whole, as no rank saves in every member."""

    removed: int  # parameters the tied curves remove at the plan's predicted cost (the fixed layers' aside)
    untied: int  # the same without the ties
    params: int  # the model's parameters
    groups: int  # tie groups (one per block and tie)
    each: dict[str, float] = field(default_factory=dict)  # tie ("q_proj/k_proj/v_proj") -> share of the model
    dense: list[str] = field(default_factory=list)  # "q_proj/k_proj/v_proj in model.layers.0.self_attn"

    @property
    def cost(self) -> float:
        """The share of the model's parameters the ties cost in removal (0.008: 0.8 points): the parts' sum, which is
        (untied - removed) / params before those two are rounded to whole parameters."""
        return sum(self.each.values())

    def words(self) -> str:
        """"ties cost 0.80 points of removal (q_proj/k_proj/v_proj: 0.50, gate_proj/up_proj: 0.30)"."""
        parts = ", ".join(f"{k}: {100 * v:.2f}" for k, v in self.each.items())
        dense = (f"; {len(self.dense)} group{'s' if len(self.dense) != 1 else ''} kept dense whole (no rank saves "
                 f"in every member: {', '.join(self.dense[:3])}{', ...' if len(self.dense) > 3 else ''})"
                 if self.dense else "")
        return (f"ties cost {100 * self.cost:.2f} points of removal ({parts}), against the same search without "
                f"them at the plan's predicted cost{dense}")

    def to_dict(self) -> dict[str, Any]:
        return {"removed": self.removed, "untied": self.untied, "groups": self.groups, "cost": self.cost,
                "each": dict(self.each), "dense": list(self.dense), "words": self.words()}


LOOSER_TOLERANCES = (0.02, 0.05, 0.10)  # what an empty suggestion shows: the plans measured that hold these


@dataclass
class LooserPlan:
    """What a looser tolerance buys, read from the plans the search measured (nothing measured again): the largest
    plan whose measured value (and verified value, where verified) holds ``tolerance``, with its share removed and
    its values; ``removed`` 0 and ``metric`` None where no plan measured holds it."""

    tolerance: float  # in the metric's units (a relative increase: the same share)
    removed: int
    removed_fraction: float
    metric: float | None  # on the search rows
    layers: int = 0
    verification: "Verification | None" = None  # its interval on the verification rows, where verified


@dataclass
class BudgetResult:
    """Tier 3: the plan chosen over the curves and checked all at once, and the frontier around it."""

    plan: dict[str, int]
    source: str  # "measured" (tier-2 curves) | "tier1"
    budget: float | None  # the fraction asked to remove; None: the largest plan the tolerance allows
    removed: int
    removed_fraction: float
    metric: float
    ok: bool
    top1: float | None
    frontier: list[FrontierPlan] = field(default_factory=list)
    evaluations: int = 0  # distinct plans factorized and measured by the search
    exhausted: bool = False  # the search hit its measurement cap before the bracket closed
    fixed: dict[str, int] = field(default_factory=dict)  # plan_for_budget(fixed=): in every plan; an audit fixes none
    smallest_failing: int | None = None  # parameters removed by the smallest measured plan above it that failed
    recovery: RecoverySetup | None = None  # --recover: every frontier plan measured again after the fine-tune
    chosen_after_recovery: bool = False  # the plan holds only after that fine-tune (metric/ok: before it)
    verification: Verification | None = None  # the plan on the verification rows, with its interval
    params_before: int = working(0)
    params_after: int = working(0)
    predicted_cost: float = working(0.0)
    metric_label: str = working("")
    higher_is_better: bool = working(False)
    reference: float = working(0.0)  # the dense model's metric
    tolerance: float = working(0.0)
    tries: list[FrontierPlan] = working(factory=list)  # every distinct plan measured, in order
    seconds: float = working(0.0)
    plans: list[FrontierPlan] = field(default_factory=list)  # every distinct plan measured, by size, with its status
    uniform: UniformBaseline | None = None  # beside the chosen plan: uniform truncation at its share, its rows
    ties: TieCost | None = None  # --tie: the removal the ties cost (None: no tie)
    looser: list[LooserPlan] = field(default_factory=list)  # no plan holds: what looser tolerances buy, measured

    def settled(self) -> "BudgetResult":
        """This result with ``plans`` (every distinct plan the search measured, fewest parameters removed first, a
        frontier plan's recovery kept) and every plan's ``status`` set: what the reports list."""
        from dataclasses import replace

        def key(p: FrontierPlan) -> tuple[tuple[str, int], ...]:
            return tuple(sorted(p.plan.items()))

        front = {key(p): p for p in self.frontier}
        seen: dict[tuple[tuple[str, int], ...], FrontierPlan] = {}
        for p in [*self.tries, *self.frontier]:
            q = seen.get(key(p)) or p
            seen[key(p)] = replace(q, recovered=front[key(p)].recovered if key(p) in front else q.recovered,
                                   verification=q.verification or p.verification, backstop=q.backstop or p.backstop,
                                   uniform=front[key(p)].uniform if key(p) in front else q.uniform or p.uniform)
        marked = {k: replace(p, status=plan_status(p, self.plan),
                             verification=p.verification or (self.verification if p.plan == self.plan else None),
                             uniform=p.uniform or (self.uniform if p.plan == self.plan else None))
                  for k, p in seen.items()}
        return replace(self, plans=sorted(marked.values(), key=lambda p: (p.removed, -p.ok)),
                       frontier=[marked[key(p)] for p in self.frontier])

    def plan_verified(self, removed: int) -> "FrontierPlan | None":
        """The measured plan removing ``removed`` parameters (the first, when several do), or None."""
        return next((p for p in self.plans if p.removed == removed), None)

    @property
    def nothing_to_plan(self) -> bool:
        """No plan measured removes anything: the model has no layer ``factorize`` rewrites (an identity, a model
        of norms), so the empty plan is the answer, not a failure."""
        return not self.plan and not any(p.removed for p in [*self.frontier, *self.tries])

    @property
    def recovered(self) -> "FrontierRecovery | None":
        """The chosen plan measured after the recovery fine-tune (``--recover``), or None."""
        return next((p.recovered for p in self.frontier if p.removed == self.removed and p.recovered is not None),
                    None)


@dataclass
class PlanCheck:
    """The reviewed plan (or the suggested ranks) applied all at once, fitted as ``factorize`` fits it by default
    (``fit``), and measured."""

    layers: int  # planned layers that were factorized
    left_out: list[str]  # planned layers factorize() cannot rewrite (RNN, attention in-projections, tied weights)
    predicted: float | None  # sqrt(sum e_l^2) of the single-layer errors (default metric only), see ``basis``
    measured: float
    ok: bool
    top1: float | None = None
    removed: int = 0  # parameters removed by the factorized layers
    basis: str = ""  # what the e_l are: tier-1 layer-output errors, or single-layer model errors (tier 2)
    verification: Verification | None = None  # measured on the verification rows, with its interval
    fit: str = ""  # the fit of the model measured (apply.Fit.label): the one factorize writes with default flags


@dataclass
class RoundingFloor:
    """A bfloat16 / float16 model's metric with every plannable layer factorized at full rank (nothing dropped, the
    factors in the model's dtype): what rounding alone costs every plan (``auditor.calibration.tiers.rounding``)."""

    dtype: str  # "bfloat16" | "float16"
    layers: int  # layers factorized at full rank
    metric: float  # the measured metric
    used: float  # how much of the tolerance that is (the metric for built-in kinds; the drop for a user metric)
    tolerance: float
    top1: float | None = None
    ranks: dict[str, int] = working(factory=dict)  # the full-rank plan measured (layer -> min(m, n))

    @property
    def share(self) -> float:
        """The share of the tolerance rounding alone uses (1 or more: nothing can be judged above it)."""
        return self.used / self.tolerance if self.tolerance > 0 else float("inf")


@dataclass
class SensitivityFallback:
    """Planned layers the output gradients (the default sensitivity) could not reach, and what costed them instead:
    ``method`` "truncation probes" (each truncated alone and measured, as ``--probe``), or tier-1 costs (scaled by
    the median gradient ratio of the layers reached, where some were). ``every``: no planned layer was reached, so
    the whole sensitivity is ``method``'s."""

    method: str
    layers: list[str]  # the planned layers no gradient reached
    reason: str  # why, in words: the output needs no gradient, the backward failed, or none reached those outputs
    every: bool = False
    planned: int = 0  # planned layers in all

    def line(self) -> str:
        """The report's one line: which layers, why, and what costs them instead."""
        shown = ", ".join(self.layers[:4]) + (f" and {len(self.layers) - 4} more" if len(self.layers) > 4 else "")
        if self.every:
            return (f"Output gradients reach none of the {self.planned} planned layers ({self.reason}): the "
                    f"sensitivity falls back to {self.method} for every planned layer.")
        return (f"Output gradients do not reach {len(self.layers)} of the {self.planned} planned layers ({shown}: "
                f"{self.reason}): their sensitivity falls back to {self.method}; the others keep gradient-predicted "
                "costs.")


@dataclass
class BitsPlan:
    """One byte plan (``--budget-bytes``) measured all at once: its family (``joint``, ``bits``, ``rank``, or a uniform
    baseline: ``uniform int8``, ``uniform int4``, ``uniform truncation``), the size it was planned for and the bytes it
    takes (the whole model's parameters), each layer's choice (``keep``, ``int4 g128 sym``, ``int3 g128 sym + rank
    16``, ``rank 48``), the summed predicted cost, and the measured value with its interval on the verification
    rows (``verification``; None in an unsplit session, where ``value`` is the held-out rows'). ``reachable``
    False: no choice of this family fits the size (nothing measured)."""

    family: str
    size: int
    nbytes: int = 0
    reachable: bool = True
    value: float | None = None
    ok: bool = False
    predicted: float = 0.0
    verification: "Verification | None" = None
    choices: dict[str, str] = field(default_factory=dict)
    rho: float = 1.0  # the joint plan's: how much its factorizations' costs were scaled (see tiers/bits.ratio)

    @property
    def counts(self) -> dict[str, int]:
        """How many layers take each kind of choice: {"keep": 3, "int4": 10, "int4 + rank": 2, "rank": 5}."""
        out: dict[str, int] = {}
        for label in self.choices.values():
            head = label.split(" g")[0] if not label.startswith("rank") else \
                "rank int8" if label.endswith(" int8") else "rank"
            key = head + (" + rank" if "+" in label else "")
            out[key] = out.get(key, 0) + 1
        return out


def label_family(label: str) -> str:
    """One choice's family: "keep", "rank" (factors alone), "bits" (quantized alone) or "joint" (quantized with a
    correction).

    >>> [label_family(x) for x in ("keep", "rank 8 int8", "int4 g128 sym", "int3 g128 sym + rank 16")]
    ['keep', 'rank', 'bits', 'joint']
    """
    return "keep" if label == "keep" else "rank" if label.startswith("rank ") else "joint" if "+" in label else "bits"


def choices_family(choices: dict[str, str]) -> str:
    """What a byte plan's choices are: "keep" (nothing rewritten), "bits" (quantized only), "rank" (factorized
    only) or "joint" (a correction, or both kinds).

    >>> choices_family({"a": "keep", "b": "int4 g128 sym"}), choices_family({"a": "rank 8", "b": "int8 g128 sym"})
    ('bits', 'joint')
    """
    kinds = {label_family(v) for v in choices.values()} - {"keep"}
    return "keep" if not kinds else kinds.pop() if len(kinds) == 1 else "joint"


@dataclass
class BitsReport:
    """Rank or bits under a byte budget: the layers it could rewrite and the bytes of everything else, how the
    options' costs were weighted, the sizes measured (the user's budget first, then uniform int4's and int8's), the
    three families' plans at each size and the uniform baselines, and one sentence saying which family wins at the
    budget."""

    budget: int  # bytes, the whole model's parameters
    dense_bytes: int
    rest_bytes: int  # every tensor no byte plan rewrites (parameters, persistent buffers), in its dtype
    layers: int
    weights: int  # the weights of the layers it can rewrite
    weighted: str
    sizes: list[int] = field(default_factory=list)
    plans: list[BitsPlan] = field(default_factory=list)
    baselines: list[BitsPlan] = field(default_factory=list)
    verdict: str = ""
    seconds: float = 0.0
    smallest: int = 0  # the fewest bytes any plan takes (every rewritable layer at its smallest option)
    rank_plan_size: int | None = None  # the bytes the audit's rank plan takes (one of ``sizes``); None: no plan
    written: str = ""  # --write-bits: the folder the plan at the budget that measured least harm was written into
    written_family: str = ""  # which family's plan that was (joint, bits or rank)
    file_bytes: int = 0  # its model.safetensors' size (the plan's bytes and the safetensors header)
    header_bytes: int = 0  # of which the header

    def at(self, size: int) -> list[BitsPlan]:
        """The three families' plans at ``size``."""
        return [p for p in self.plans if p.size == size]

    def sentence(self, facts: "MetricFacts") -> str:
        """Which family does least harm at the user's budget, by its measured value, in one sentence: the family
        its choices belong to (a joint plan that took no rank is quantization alone), the others beside."""
        here = [p for p in self.at(self.budget) if p.reachable and p.value is not None]
        if not here:
            return (f"Nothing fits {self.budget:,} bytes: the smallest plan takes {self.smallest:,} (the tensors no "
                    f"byte plan rewrites take {self.rest_bytes:,}).")
        best = (max if facts.higher_is_better else min)(here, key=lambda p: p.value)  # type: ignore[arg-type]
        kind = choices_family(best.choices)
        if kind == "keep":
            return f"At {self.budget:,} bytes nothing needs rewriting: the dense model fits."
        words = {"joint": "rank and bits together", "bits": "quantization alone", "rank": "low rank alone"}
        others = "; ".join(f"{words[p.family]} {facts.words(p.value)}" for p in here
                           if p.choices != best.choices)
        same = [words[p.family] for p in here if p.choices == best.choices and p.family != kind]
        unreached = [words[p.family] for p in self.at(self.budget) if not p.reachable]
        tail = (f" ({' and '.join(same)} chose the same plan)" if same else "") + (f"; {others}" if others else "")
        tail += f"; {' and '.join(unreached)} cannot reach that size" if unreached else ""
        return f"At {self.budget:,} bytes {words[kind]} does least harm: {facts.label} {facts.words(best.value)}{tail}."



@dataclass(frozen=True)
class MetricFacts:
    """The facts of the report's metric that the renderers and the verdict read, in one place, built from what the
    metric kind says of itself (``MetricKind.limit`` / ``display``, carried by the report): whether a value holds,
    how a value, a change from the dense model and the tolerance read, and which side of the tolerance line fails.
    :attr:`CalibrationReport.facts` builds it; no renderer asks the metric's direction itself.

    >>> f = MetricFacts("perplexity increase", False, 0.01, 153.77, 0.01, "percent", "perplexity")
    >>> f.holds(0.009112), f.words(0.009112), f.change(0.009112)
    (True, '+0.911%', 'held-out perplexity 153.77 -> 155.17 (+0.911%, tolerance +1%)')
    """

    label: str  # the metric's label
    higher_is_better: bool
    tolerance: float
    reference: float  # the dense model's value (0 for a metric that is zero on it)
    limit: float  # the value at which it stops holding (the tolerance line)
    display: str  # "percent" (a fraction written as a percentage) | "number" (its own units)
    increase_of: str = ""  # the metric is the relative increase of this dense value ("perplexity")

    def __post_init__(self) -> None:
        if self.display == "percent" and self.higher_is_better:
            raise ValueError("a metric written as a percentage (an error, an increase) is lower-is-better")

    @property
    def fails_above(self) -> bool:
        """Values above :attr:`limit` miss it: lower is better (an error, an increase, a divergence), a damage the
        charts may draw on a log axis; False: higher is better, and values below it miss."""
        return not self.higher_is_better

    @property
    def from_dense(self) -> bool:
        """A value reads as a change from the dense model's own value, shown beside it (a metric where higher is
        better, or a positive dense value such as a perplexity), not as a distance that is zero on the dense model."""
        return self.higher_is_better or self.reference > 0

    def holds(self, value: float) -> bool:
        """``value`` stays within the tolerance: on :attr:`limit` or its holding side (NaN never holds)."""
        return value >= self.limit if self.higher_is_better else value <= self.limit

    def loosened(self, tolerance: float) -> "MetricFacts":
        """These facts at a looser ``tolerance``: the limit moved by the difference, on its failing side."""
        from dataclasses import replace

        step = tolerance - self.tolerance
        return replace(self, tolerance=tolerance,
                       limit=self.limit - step if self.higher_is_better else self.limit + step)

    def shortfall(self, value: float) -> float:
        """How far ``value`` lies on the failing side of :attr:`limit` (positive: it misses; larger: worse)."""
        return self.limit - value if self.higher_is_better else value - self.limit

    def words(self, v: float | None) -> str:
        """One measured value in the metric's one unit, as every format writes it: a fraction the reports show as a
        percentage (``display == "percent"``) with three significant digits, signed for a relative increase
        ("+0.878%", "0.968%"); any other metric with 4 significant digits; ``–`` for None or NaN."""
        if v is None or not math.isfinite(v):
            return "\u2013"
        if self.display != "percent":
            return f"{v:.4g}"
        x = 100 * v
        digits = max(0, 2 - math.floor(math.log10(abs(x)))) if x != 0 else 0
        return ("+" if self.increase_of and v > 0 else "") + f"{x:.{digits}f}%"

    def tolerance_words(self) -> str:
        """The tolerance in the metric's unit: "+1%" for a relative increase, "1%" for the output error, else as is."""
        if self.display != "percent":
            return f"{self.tolerance:g}"
        return f"+{100 * self.tolerance:g}%" if self.increase_of else f"{100 * self.tolerance:g}%"

    def change(self, value: float | None) -> str:
        """A measured value with the dense value and the tolerance, the same words in every format: "held-out
        perplexity 153.77 -> 155.17 (+0.911%, tolerance +1%)" for a relative increase, "held-out accuracy 0.9 ->
        0.88 (tolerance -0.05)" where higher is better, "relative output error 0.994% (tolerance 1%)" otherwise."""
        if value is not None and math.isinf(value):  # a plan that breaks the model: measured, and infinitely bad
            return self._infinite(value)
        if value is None or not math.isfinite(value):
            return f"{self.label}: not measured"
        if self.increase_of and self.reference > 0:
            return (f"held-out {self.increase_of} {self.reference:.2f} -> {self.reference * (1 + value):.2f} "
                    f"({self.words(value)}, tolerance {self.tolerance_words()})")
        if self.higher_is_better:
            return f"held-out {self.label} {self.reference:.4g} -> {value:.4g} (tolerance -{self.tolerance:g})"
        return f"{self.label} {self.words(value)} (tolerance {self.tolerance_words()})"

    def _infinite(self, value: float) -> str:
        """An infinite measurement in words: "held-out perplexity 32.29 -> infinite (perplexity infinite, tolerance
        +1%)" (the loss overflowed a float), "relative output error infinite (tolerance 1%)" otherwise."""
        sign = "-" if value < 0 else ""
        if self.increase_of and self.reference > 0:
            return (f"held-out {self.increase_of} {self.reference:.2f} -> {sign}infinite ({self.increase_of} "
                    f"{sign}infinite, tolerance {self.tolerance_words()})")
        return f"{self.label} {sign}infinite (tolerance {self.tolerance_words()})"

    def judged(self, value: float, ok: bool, tolerance: bool = True) -> str:
        """A measured value against what judges it, as the plan cards write it: "0.58% \u2264 1%" (">" where ``ok``
        is False) for a value held under the limit; "0.88 (dense 0.9, tolerance 0.05)" beside the dense value where
        higher is better (``tolerance`` False leaves the tolerance out there)."""
        if self.fails_above:
            sign = "\u2264" if ok else ">"
            return f"{self.words(value)} {sign} {self.tolerance_words()}"
        tol = f", tolerance {self.tolerance_words()}" if tolerance else ""
        return f"{self.words(value)} (dense {self.words(self.reference)}{tol})"


@dataclass
class CalibrationReport:
    """What calibration data measured: tier 1 always, tier 2 with --measure-floor, tier 3 with --budget."""

    source: str
    holdout: str  # what was held out: a share ("0.25") or a file
    digest: str  # sha256 of every calibration tensor
    fit_rows: int
    holdout_rows: int
    metric: str  # the metric's label
    higher_is_better: bool
    tolerance: float
    reference: float  # the dense model's metric on the held-out part (0 for the relative output error)
    layers: dict[str, LayerCalibration] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # layer -> why it has no statistics (keeps weight energy)
    warnings: list[str] = field(default_factory=list)
    synthetic: bool = False  # the inputs look like uniformly random token ids
    measured_floors: bool = False  # tier 2 ran
    budget: BudgetResult | None = None
    plan_check: PlanCheck | None = None
    suggestions_from: str = "calibration"  # "calibration" (tier 1) | "measured floors" (tier 2)
    statistics_cached: bool = False  # input statistics read from the cache
    compute_dtype: str | None = working(None)  # --compute-dtype the statistics were read in (None: the model's)
    seconds: dict[str, float] = field(default_factory=dict)  # tier -> seconds
    evaluations: int = 0  # model-level metric evaluations (tiers 2 and 3)
    finetune_note: str = "a recovery fine-tune follows factorization"
    rounding_floor: RoundingFloor | None = None  # bf16 / fp16 models only; the JSON leaves it out when None
    sensitivity_fallback: SensitivityFallback | None = None  # planned layers gradients missed; JSON: only when set
    tier1_target: float = working(0.01)  # the layer-output error tier 1 ranked for (the metric's rule)
    increase_of: str = working("")  # the metric is the relative increase of this dense value ("perplexity")
    # what the metric says of itself (calibration.metrics.base.MetricKind.limit / display), read through facts:
    limit: float | None = None  # the value at which it stops holding (the tolerance line)
    display: str = ""  # "percent" (a fraction against the tolerance) | "number" (its units, beside dense)
    bits: BitsReport | None = None  # rank or bits under a byte budget (--budget-bytes); JSON: only when set

    def __post_init__(self) -> None:
        if self.limit is None or not self.display:  # a report made by hand: the rule of the built-in kinds
            higher = self.higher_is_better
            self.limit = self.limit if self.limit is not None else \
                self.reference - self.tolerance if higher else self.tolerance
            self.display = self.display or (
                "percent" if not higher and (self.increase_of or "error" in self.metric) else "number")

    @property
    def facts(self) -> MetricFacts:
        """The metric's facts (:class:`MetricFacts`): what the renderers and the verdict ask of it."""
        assert self.limit is not None
        return MetricFacts(self.metric, self.higher_is_better, self.tolerance, self.reference, self.limit,
                           self.display, self.increase_of)

    def recovery_note(self) -> str:
        """How the suggested plan holds when ``--choose-after-recovery`` chose it on the recovered curve: "holds
        after a 200-step recovery fine-tune (kl 0.0081); before it: 0.0195, misses 0.01"; else empty."""
        b = self.budget
        if b is None or not b.chosen_after_recovery or b.recovery is None:
            return ""
        rec = b.recovered
        after = f" ({self.metric} {self.value_text(rec.metric)})" if rec is not None else ""
        return (f"holds after a {b.recovery.steps}-step recovery fine-tune{after}; before it: "
                f"{self.value_text(b.metric)}, {'holds' if b.ok else 'misses'} {self.tolerance_text()}")

    def value_text(self, v: float | None) -> str:
        """One measured value in the metric's one unit (:meth:`MetricFacts.words`)."""
        return self.facts.words(v)

    def tolerance_text(self) -> str:
        """The tolerance in the metric's unit (:meth:`MetricFacts.tolerance_words`)."""
        return self.facts.tolerance_words()

    def layer(self, name: str) -> LayerCalibration | None:
        return self.layers.get(name)

    def measured_points(self) -> dict[str, list[tuple[int, float]]]:
        """Per layer, the tier-2 (rank, metric) points; empty without --measure-floor."""
        return {k: list(v.floor.points) for k, v in self.layers.items() if v.floor is not None and v.floor.points}

    def to_dict(self) -> dict[str, Any]:
        d = report_dict(self)
        if d.get("rounding_floor") is None:  # float32 / float64 models: not measured, reports unchanged
            d.pop("rounding_floor", None)
        if d.get("sensitivity_fallback") is None:  # the gradients reached every planned layer (or none were read)
            d.pop("sensitivity_fallback", None)
        if d.get("bits") is None:  # no byte plan asked for: the report is as it was
            d.pop("bits", None)
        b = d.get("budget")
        if b is not None and self.budget is not None:  # without --tie the report is as it was
            if self.budget.ties is None:
                b.pop("ties", None)
            else:
                b["ties"] = self.budget.ties.to_dict()
            if not self.budget.looser:  # a plan holds: the report is as it was
                b.pop("looser", None)
        if b is not None and b.get("recovery") is None:  # without --recover the report is as it was
            b.pop("recovery", None)
            b.pop("chosen_after_recovery", None)
            for p in [*b.get("frontier", []), *b.get("plans", [])]:
                p.pop("recovered", None)
        for v in d["layers"].values():
            v["curve"] = [list(p) for p in v["curve"]]
            if v["floor"] is not None:
                v["floor"]["points"] = [list(p) for p in v["floor"]["points"]]
        return d


def looser_plans(budget: BudgetResult, facts: MetricFacts) -> list[LooserPlan]:
    """For each of :data:`LOOSER_TOLERANCES` looser than ``facts``' tolerance, the largest plan the search measured
    (within its budget) whose value on the search rows, and on the verification rows where verified, holds it."""
    limit = budget.budget * budget.params_before if budget.budget is not None else float("inf")
    measured = [p for p in [*budget.plans, *budget.tries, *budget.frontier] if p.plan and p.removed <= limit]
    out = []
    for t in (t for t in LOOSER_TOLERANCES if t > facts.tolerance):
        at = facts.loosened(t)
        held = [p for p in measured if at.holds(p.metric)
                and (p.verification is None or at.holds(p.verification.value))]
        best = max(held, key=lambda p: (p.removed, p.verification is not None), default=None)
        out.append(LooserPlan(t, 0, 0.0, None) if best is None else
                   LooserPlan(t, best.removed, best.removed_fraction, best.metric, best.layers, best.verification))
    return out


def subsample(error: list[float], points: int = CURVE_POINTS) -> list[tuple[int, float]]:
    """(rank, error) at every rank when there are few, else at ``points`` log-spaced ranks (0 and the last kept).

    >>> subsample([1.0, 0.5, 0.0])
    [(0, 1.0), (1, 0.5), (2, 0.0)]
    """
    k = len(error) - 1
    if k + 1 <= points:
        return [(r, float(e)) for r, e in enumerate(error)]
    import math

    ranks = {0, k}
    for i in range(points - 1):
        ranks.add(int(round(math.exp(math.log(k) * i / (points - 2)))))
    return [(r, float(error[r])) for r in sorted(ranks)]
