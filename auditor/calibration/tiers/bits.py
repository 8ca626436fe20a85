"""Rank or bits: every rewritable weight kept, quantized, quantized with a low-rank correction of its error, or
factorized, chosen jointly under a byte budget (``--budget-bytes``, ``--bits-per-weight``).

Each layer's options (:class:`LayerBits`), for a Linear (or transformers' Conv1D) F (out x in) of the plan's scope:

- ``keep``: F as it is, ``out * in`` weights in the model's dtype;
- ``int8``, ``int4``, ``int3`` (groups of 128 inputs, symmetric; ``int4``/``int3`` also asymmetric): round to
  nearest (:mod:`auditor.quantize.codes`), codes, float16 scales and zero points counted to the byte;
- ``int4`` / ``int3`` plus a rank-k correction of their error E = F - Q(F) (k in 8, 16, 32, 64), fitted as the
  factors are: the best rank-k C in the metric below (C = L^-T [L^T E S]_k S^-1), its two factors in the model's dtype;
- ``rank r`` (r at 1/20 ... 19/20 of the break-even rank): the loss-aware truncation, r (out + in) weights; and
  ``rank r int8``: the same factors stored as int8 codes.

Every option's cost is the same model-level quadratic form the gradient pass ranks ranks with
(:mod:`.fisher`): ``trace(G D X^T X D^T)`` for the change D = F - F', G the layer's output-gradient moment (shrunk
as the loss-aware truncation shrinks it), X^T X its input Gram (damped as the whitening is). Where the moment is
carried to input space (out > in) or there is none, G is its mean diagonal times I (``isotropic``). Costs of
different layers add (the metric's units up to one constant), so a plan is a multiple-choice knapsack
(:func:`auditor.quantize.knapsack.choose`) on them, measured all at once, on the verification rows with their
interval, as every plan is. Three families at each size (the budget, the audit's rank plan's, uniform int4's and
int8's): ``bits`` (keep or quantize) and ``rank`` (keep or factorize) first, then ``joint`` (every option) on costs
recalibrated by what those two measured (:func:`ratio`: a factorization's predicted cost is fitted to the statistics
that judge it and promises more than it keeps); beside them uniform int8 and int4 round to nearest and uniform
whitened truncation (SVD-LLM) at the budget. ``--write-bits`` writes the plan that measured least harm at the budget.

What is simulated: a plan is measured with each weight replaced by :meth:`auditor.quantize.written.Parts.weight`
(codes dequantized with their scales, plus the factors' product, in float32, cast to the model's dtype), the
function ``load_byte_plan`` rebuilds the written file with. Alive at once: the options' costs (a few floats per
option and layer); one layer's decompositions while its options are costed or its replacement built; one plan's
replacement weights while it is measured. Each built plan redoes the chosen factorizations' decompositions.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from ... import kinds
from ...errors import AuditError
from ...calresults import BitsPlan, BitsReport, label_family
from ...quantize.codes import QuantSpec, quantize
from ...quantize.knapsack import Choice, choose
from ...quantize.written import FACTOR_SPEC, Parts, label_of
from ...results import Kind, Layer
from ..statistics.whiten import DAMP, GRADIENT_DAMP, function_matrices

if TYPE_CHECKING:
    from torch import nn

    from ..references import References
    from ..statistics.stats import LayerInput
    from ..statistics.whiten import LossMetric
    from .pass_context import PassContext, Scope

QUANT = ("int8", "int4", "int4 g128 asym", "int3", "int3 g128 asym")  # the round-to-nearest options
CORRECTED = ("int4", "int3")  # quantized with a low-rank correction of their error
CORRECTION_RANKS = (8, 16, 32, 64)
ISOTROPIC_COSTS = False  # True: options judged with G's mean diagonal instead of G (benchmarks/rank_or_bits.py --costs)
RANK_STEPS = 20  # rank options at k / RANK_STEPS of the break-even rank, k = 1 .. RANK_STEPS - 1
KINDS = (Kind.LINEAR, Kind.CONV1D_HF)


@dataclass(frozen=True)
class Recipe:
    """How one option rewrites F: quantized with ``spec`` (or not), plus a rank-``rank`` part (the correction of the
    quantization error, or the factors alone); ``whitened``: the rank part in the input metric alone (SVD-LLM)."""

    spec: str = ""
    rank: int = 0
    whitened: bool = False
    int8_factors: bool = False  # the factors stored as int8 codes (a factor-only choice)

    @property
    def label(self) -> str:
        return label_of(self.spec, self.rank, FACTOR_SPEC.label if self.int8_factors else "")


class _Metric:
    """The quadratic form of one layer: M = L^T D S (L L^T = G, or G = ``scale`` I where ``low`` is None; S S^T the
    damped input Gram), cost(D) = ||M||_F^2."""

    def __init__(self, gram: np.ndarray, low: np.ndarray | None, scale: float) -> None:
        lam = DAMP * float(np.mean(np.diagonal(gram))) if gram.size and np.mean(np.diagonal(gram)) > 0 else DAMP
        self.s = np.linalg.cholesky(gram + lam * np.eye(gram.shape[0]))
        self.low, self.scale = low, scale

    def forward(self, d: np.ndarray) -> np.ndarray:
        left = self.low.T @ d if self.low is not None else math.sqrt(self.scale) * d
        return left @ self.s

    def back(self, m: np.ndarray) -> np.ndarray:
        """D with forward(D) = m."""
        left = np.linalg.solve(self.low.T, m) if self.low is not None else m / math.sqrt(self.scale)
        return np.linalg.solve(self.s.T, left.T).T

    def cost(self, d: np.ndarray) -> float:
        return float(np.sum(self.forward(d) ** 2))

    def isotropic(self) -> "_Metric":
        """The same input metric with G replaced by its mean diagonal times I (what the options are judged in)."""
        if self.low is None:
            return self
        out = _Metric.__new__(_Metric)
        out.s, out.low, out.scale = self.s, None, float(np.sum(self.low ** 2)) / self.low.shape[0]
        return out

    def svd(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """U, sigma, V^T of forward(f): every rank's truncation in this metric from one decomposition."""
        return np.linalg.svd(self.forward(f), full_matrices=False)

    def tails(self, svd: tuple[np.ndarray, np.ndarray, np.ndarray], judge: "_Metric") -> np.ndarray:
        """tails[r]: the cost in ``judge`` of this metric's best rank-r part (``svd``: :meth:`svd` of F; r = 0 ..
        min(m, n)): sum over i > r of sigma_i^2 times u_i's weight, ||L^-T u_i||^2 scale' in an isotropic judge (1
        in this metric itself)."""
        u, sig, _ = svd
        w = np.ones_like(sig)
        if judge is not self:
            left = np.linalg.solve(self.low.T, u) if self.low is not None else u / math.sqrt(self.scale)
            w = judge.scale * np.sum(left ** 2, axis=0)
        return _tails(sig ** 2 * w)

    def truncated(self, f: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(the best rank-``rank`` part of ``f`` in this metric, the squared singular values of forward(f))."""
        a, b, sig2 = self.factors(self.svd(f), rank)
        return a @ b, sig2

    def factors(self, svd: tuple[np.ndarray, np.ndarray, np.ndarray], rank: int,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A, B) with A B the best rank-``rank`` part in this metric (A = L^-T U_r Sigma_r, B = V_r^T S^-1;
        ``svd``: :meth:`svd` of F), and the squared singular values."""
        u, sig, vt = svd
        left = u[:, :rank] * sig[:rank]
        a = np.linalg.solve(self.low.T, left) if self.low is not None else left / math.sqrt(self.scale)
        b = np.linalg.solve(self.s.T, vt[:rank].T).T
        return a, b, sig ** 2


def output_metric(f: np.ndarray, gram: np.ndarray, moment: "tuple[np.ndarray, bool, int] | None") -> _Metric:
    """The layer's metric: the output-gradient moment G shrunk as :func:`~..statistics.whiten.weighted_bases`
    shrinks it where it is out x out; G = (trace(F^T G F) / trace(F^T F)) I where it is carried (out > in); I without
    a moment."""
    if moment is None:
        return _Metric(gram, None, 1.0)
    h, carried, samples = moment
    h = (h + h.T) / 2
    m = f.shape[0]
    if not np.all(np.isfinite(h)):
        return _Metric(gram, None, 1.0)
    if carried:
        ff = float(np.sum(f * f))
        scale = float(np.trace(h)) / ff if ff > 0 else 0.0
        return _Metric(gram, None, scale if scale > 0 and math.isfinite(scale) else 1.0)
    mean = float(np.trace(h)) / m if m else 0.0
    if not mean > 0 or not math.isfinite(mean):
        return _Metric(gram, None, 1.0)
    shrink = GRADIENT_DAMP + (m / samples if samples > 0 else 0.0)
    return _Metric(gram, np.linalg.cholesky(h + shrink * mean * np.eye(m)), 1.0)


class LayerBits:
    """One layer's options, each with its bytes and its cost (:class:`~auditor.quantize.knapsack.Choice`), and the
    replacement weight of any of them. It holds references (the model's weight, the statistics, the moment), never
    a copy: its float64 matrices are made while an option is costed or built and let go after."""

    def __init__(self, layer: Layer, weight: torch.Tensor, inp: "LayerInput",
                 moment: "tuple[np.ndarray, bool, int] | None") -> None:
        self.layer, self.weight_ref, self.inp, self.moment = layer, weight, inp, moment
        self.recipes: dict[str, Recipe] = {"keep": Recipe()}

    @property
    def out_in(self) -> tuple[int, int]:
        return kinds.for_kind(self.layer.kind).function_shape(self.layer)

    @property
    def dense_bytes(self) -> int:
        return self.weight_ref.numel() * self.weight_ref.element_size()

    def rank_bytes(self, rank: int) -> int:
        return rank * sum(self.out_in) * self.weight_ref.element_size()

    def _f(self) -> np.ndarray:
        return function_matrices(self.layer, self.weight_ref)[0]

    def choices(self) -> list[Choice]:
        """Every option with its bytes and cost."""
        f = self._f()
        metric = output_metric(f, self.inp.gram[0], self.moment)
        judge = metric.isotropic() if ISOTROPIC_COSTS else metric
        out, n = [Choice("keep", self.dense_bytes, 0.0)], min(f.shape)
        be = self.layer.break_even
        decomposed = metric.svd(f)
        tail = metric.tails(decomposed, judge)
        ranks = [r for r in sorted({max(1, math.floor(k * be / RANK_STEPS)) for k in range(1, RANK_STEPS)}) if r < n]
        for r in ranks:
            if self.rank_bytes(r) < self.dense_bytes:
                out.append(self._put(Recipe(rank=r), self.rank_bytes(r), float(tail[r])))
        out += self._int8_factor_choices(f, metric, judge, ranks, decomposed)
        for label in QUANT:
            spec = QuantSpec.parse(label)
            err = f - quantize(torch.from_numpy(f), spec).dequantize(torch.float64).numpy()
            base = spec.nbytes(*f.shape)
            out.append(self._put(Recipe(spec.label), base, judge.cost(err)))
            if label not in CORRECTED:
                continue
            etail = metric.tails(metric.svd(err), judge)
            for k in CORRECTION_RANKS:
                if k < n // 2 and base + self.rank_bytes(k) < self.dense_bytes:
                    out.append(self._put(Recipe(spec.label, k), base + self.rank_bytes(k), float(etail[k])))
        return out

    def _int8_factor_choices(self, f: np.ndarray, metric: _Metric, judge: _Metric, ranks: list[int],
                             decomposed: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[Choice]:
        """``rank r int8`` at each of ``ranks`` whose int8 factors take fewer bytes than the layer: the truncation's
        factors quantized, costed exactly as L^T F S - (L^T Q(A)) (Q(B) S) (one decomposition for every rank)."""
        out: list[Choice] = []
        m, n = f.shape
        top = max(ranks, default=0)
        if not top:
            return out
        a, b, _ = metric.factors(decomposed, top)
        base = judge.forward(f)
        for r in ranks:
            nbytes = FACTOR_SPEC.nbytes(m, r) + FACTOR_SPEC.nbytes(r, n)
            if nbytes >= self.dense_bytes:
                continue
            qa, qb = (quantize(torch.from_numpy(np.ascontiguousarray(x)), FACTOR_SPEC).dequantize(torch.float64).numpy()
                      for x in (a[:, :r], b[:r]))
            left = judge.low.T @ qa if judge.low is not None else math.sqrt(judge.scale) * qa
            cost = float(np.sum((base - left @ (qb @ judge.s)) ** 2))
            out.append(self._put(Recipe(rank=r, int8_factors=True), nbytes, cost))
        return out

    def _put(self, recipe: Recipe, nbytes: int, cost: float) -> Choice:
        self.recipes[recipe.label] = recipe
        return Choice(recipe.label, nbytes, cost)

    def parts(self, recipe: Recipe) -> Parts:
        """``recipe``'s stored parts (codes, scales, zero points, factors in the model's dtype); their
        :meth:`~auditor.quantize.written.Parts.weight` is the replacement the audit measures and the file holds."""
        w, f = self.weight_ref, self._f()
        metric = (_Metric(self.inp.gram[0], None, 1.0) if recipe.whitened
                  else output_metric(f, self.inp.gram[0], self.moment))
        q = quantize(torch.from_numpy(f), QuantSpec.parse(recipe.spec)) if recipe.spec else None
        a = b = None
        transposed = self.layer.kind == Kind.CONV1D_HF
        if recipe.rank:
            rest = f - q.dequantize(torch.float64).numpy() if q is not None else f
            fa, fb, _ = metric.factors(metric.svd(rest), recipe.rank)
            if recipe.int8_factors:
                qa, qb = (quantize(torch.from_numpy(np.ascontiguousarray(x)), FACTOR_SPEC) for x in (fa, fb))
                return Parts(self.layer.param, recipe.label, (f.shape[0], f.shape[1]), transposed, w.dtype, q,
                             qa=qa, qb=qb)
            a, b = torch.from_numpy(fa).to(w.dtype), torch.from_numpy(fb).to(w.dtype)
        return Parts(self.layer.param, recipe.label, (f.shape[0], f.shape[1]), transposed, w.dtype, q, a, b)

    def weight(self, recipe: Recipe) -> torch.Tensor:
        """The replacement weight in the stored layout and dtype (the written file's, bit for bit)."""
        if recipe.label == "keep":
            return self.weight_ref.detach().clone()
        return self.parts(recipe).weight().to(self.weight_ref.device)


def _tails(sig2: np.ndarray) -> np.ndarray:
    """tails[r] = sum of sig2[r:] (the cost of keeping the first r directions), tails[len] = 0."""
    return np.concatenate([np.cumsum(sig2[::-1])[::-1], [0.0]])


def bits_layers(layers: list[Layer]) -> list[Layer]:
    """The layers a byte plan rewrites: the scope's Linears and Conv1Ds (one group)."""
    return [l for l in layers if l.kind in KINDS and l.groups == 1]


def _weight(model: "nn.Module", layer: Layer) -> torch.Tensor:
    path, attr = kinds.for_kind(layer.kind).module_path(layer)
    return getattr(model.get_submodule(path), attr)


@contextlib.contextmanager
def swapped(model: "nn.Module", weights: dict[str, torch.Tensor], layers: dict[str, Layer]) -> Iterator[None]:
    """``model`` with the named layers' weights holding ``weights`` while the block runs, restored after (the
    parameters' storage is swapped, never written)."""
    old: dict[str, torch.Tensor] = {}
    try:
        for name, w in weights.items():
            p = _weight(model, layers[name])
            old[name] = p.data
            p.data = w
        yield
    finally:
        for name, data in old.items():
            _weight(model, layers[name]).data = data


@dataclass
class Costed:
    """The byte plan's inputs: each rewritable layer's options, and the bytes of everything else."""

    layers: dict[str, LayerBits]
    options: dict[str, list[Choice]]
    rest_bytes: int  # every other tensor the model saves (parameters, persistent buffers), tied tensors once
    weighted: str  # how the costs are weighted: "output gradients" or "input statistics"
    seconds: float = 0.0

    @property
    def dense_bytes(self) -> int:
        return self.rest_bytes + sum(l.dense_bytes for l in self.layers.values())

    @property
    def smallest(self) -> int:
        """The fewest bytes any plan takes: every layer at its smallest option."""
        return self.rest_bytes + sum(min(c.nbytes for c in v) for v in self.options.values())

    def uniform(self, label: str) -> dict[str, Choice]:
        """Every layer at the option ``label`` (kept where it has none)."""
        return {k: next((c for c in v if c.label == label), v[0]) for k, v in self.options.items()}

    def recalibrated(self, rho: float) -> dict[str, list[Choice]]:
        """Every option, a factorization's cost scaled by ``rho`` (:func:`ratio`) and a correction's gain (what it
        takes off its quantization's cost) divided by it: the joint plan's options after the two single-family plans
        were measured."""
        def recosted(c: Choice, quant: dict[str, float]) -> float:
            family = label_family(c.label)
            if family == "rank":
                return c.cost * rho
            if family == "joint":  # "int4 ... + rank r": its quantization's cost less the correction's gain / rho
                alone = quant[c.label.split(" + ")[0]]
                return alone - (alone - c.cost) / rho
            return c.cost

        out: dict[str, list[Choice]] = {}
        for k, v in self.options.items():
            quant = {c.label: c.cost for c in v if label_family(c.label) == "bits"}
            out[k] = [Choice(c.label, c.nbytes, recosted(c, quant)) for c in v]
        return out

    def family(self, which: str) -> dict[str, list[Choice]]:
        """The options of one family: ``bits`` (keep or quantize), ``rank`` (keep or factorize), ``joint``."""
        return {k: [c for c in v if label_family(c.label) in ("keep", which) or which == "joint"]
                for k, v in self.options.items()}


def ratio(rank: BitsPlan, quant: BitsPlan, floor: float = 0.0) -> float:
    """How much more the rank-only plan measured per unit of predicted cost than the bits-only plan at the same
    size (at least 1; 1 where either measured no more than ``floor``, noise: the caller's hundredth of the
    tolerance): a factorization's predicted cost is fitted to the calibration statistics it is judged by, so it can
    promise more than it keeps on rows it never read. For a metric whose value is its harm (lower is better, zero
    on the dense model); the caller gives 1 otherwise."""
    if not (rank.reachable and quant.reachable and rank.value is not None and quant.value is not None):
        return 1.0
    if not (rank.value > floor and quant.value > floor and rank.predicted > 0 and quant.predicted > 0):
        return 1.0
    rho = (rank.value / rank.predicted) / (quant.value / quant.predicted)
    return rho if math.isfinite(rho) and rho > 1.0 else 1.0


def costed(ctx: "PassContext", layers: list[Layer], loss_metric: "LossMetric | None") -> Costed:
    """Every rewritable planned layer with input statistics costed at every option."""
    t = time.perf_counter()
    stats = ctx.session.stats
    model = ctx.model
    out: dict[str, LayerBits] = {}
    options: dict[str, list[Choice]] = {}
    with ctx.progress.phase("rank or bits: options", unit="layer"):
        usable = [l for l in bits_layers(layers) if l.name in stats and not l.aliases]
        for i, layer in enumerate(usable):
            moment = (loss_metric.moments[layer.name] if loss_metric is not None and layer.name in loss_metric.layers
                      else None)
            lb = LayerBits(layer, _weight(model, layer).detach(), stats.layers[layer.name], moment)
            options[layer.name] = lb.choices()
            out[layer.name] = lb
            ctx.progress.update(i + 1, len(usable))
    from ...quantize.written import unique_tensors

    total = sum(t.numel() * t.element_size() for t in unique_tensors(model.state_dict())[0].values())
    rest = total - sum(l.dense_bytes for l in out.values())
    weighted = "output gradients" if loss_metric is not None else "input statistics"
    return Costed(out, options, rest, weighted, time.perf_counter() - t)


def _model_bytes(plan: dict[str, Choice], c: Costed) -> int:
    return c.rest_bytes + sum(ch.nbytes for ch in plan.values())


def _measure(ctx: "PassContext", refs: "References", c: Costed, family: str, size: int,
             plan: dict[str, Choice] | None, recipes: dict[str, Recipe] | None = None) -> BitsPlan:
    """``plan`` built and measured all at once: on the verification rows with their interval in a split session,
    else on the held-out rows."""
    if plan is None:
        return BitsPlan(family, size, reachable=False)
    recipes = recipes or {k: c.layers[k].recipes[ch.label] for k, ch in plan.items()}
    named = {k: c.layers[k].layer for k in plan}
    weights = {k: c.layers[k].weight(r) for k, r in recipes.items() if r.label != "keep"}
    with ctx.session.measuring(), swapped(ctx.model, weights, named):
        if refs.verifier is not None:
            v = refs.verifier.measure(ctx.model)
            value, ok = v.value, v.ok
        else:
            m = refs.evaluator.measure(ctx.model)
            v, value, ok = None, m.value, m.ok
    del weights
    return BitsPlan(family, size, _model_bytes(plan, c), True, value, ok, sum(ch.cost for ch in plan.values()), v,
                    {k: r.label for k, r in recipes.items()})


def _uniform_truncation(c: Costed, size: int) -> tuple[dict[str, Choice], dict[str, Recipe]] | None:
    """SVD-LLM at ``size``: every layer at one share of its break-even rank (input-whitened), the largest share
    whose bytes fit (bisected); a layer whose rank saves nothing stays dense. None when even rank 1 does not fit."""
    from .uniform import ranks_at

    def at(kept: float) -> tuple[dict[str, Choice], dict[str, Recipe]]:
        ranks = ranks_at([lb.layer for lb in c.layers.values()], kept)  # the uniform baseline's own ranks
        plan, recipes = {}, {}
        for k, lb in c.layers.items():
            r = ranks.get(k)
            plan[k] = Choice(f"rank {r}", lb.rank_bytes(r), 0.0) if r else Choice("keep", lb.dense_bytes, 0.0)
            recipes[k] = Recipe(rank=r, whitened=True) if r else Recipe()
        return plan, recipes

    if _model_bytes(at(0.0)[0], c) > size:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _model_bytes(at(mid)[0], c) <= size else (lo, mid)
    return at(lo)


def rank_plan_bytes(ctx: "PassContext", c: Costed, plan: dict[str, int]) -> int | None:
    """The bytes the model takes with the audit's rank plan (each planned weight as its two factors in its dtype);
    None for an empty plan."""
    removed = 0
    for name, r in plan.items():
        layer = ctx.session.layers.get(name)
        if layer is None:
            return None
        removed += (layer.params - layer.params_at(r)) * _weight(ctx.model, layer).element_size()
    return c.dense_bytes - removed if removed > 0 else None


def rank_or_bits(ctx: "PassContext", refs: "References", scope: "Scope", loss_metric: "LossMetric | None",
                 budget_bytes: int | None, bits_per_weight: float | None = None,
                 write_to: str | None = None, rank_plan: dict[str, int] | None = None) -> BitsReport | None:
    """The byte plan at ``budget_bytes`` (the whole model's parameters; or, with ``bits_per_weight``, the other
    parameters as they are and that many bits per weight of the rewritable layers) and at the sizes of uniform int4 and int8:
    the three families each chosen by :func:`~auditor.quantize.knapsack.choose` and measured all at once, beside
    uniform int8 / int4 round to nearest and uniform whitened truncation at the budget. None when no layer can be
    rewritten."""
    t = time.perf_counter()
    c = costed(ctx, scope.planned, loss_metric)
    if not c.layers:
        return None
    weights = sum(lb.weight_ref.numel() for lb in c.layers.values())
    budget = budget_bytes if budget_bytes is not None else c.rest_bytes + math.floor(
        (bits_per_weight or 0.0) * weights / 8)
    if budget < c.smallest:  # asked for what no plan can give: said before anything is measured
        flag = "--budget-bytes" if budget_bytes is not None else f"--bits-per-weight {bits_per_weight:g}"
        raise AuditError(f"{flag}: no byte plan fits {budget:,} bytes; the smallest takes {c.smallest:,} (every "
                         "rewritable layer at its smallest option, the rest as it is)",
                         f"Give --budget-bytes {c.smallest:,} or more")
    uniform = {lab: c.uniform(lab) for lab in ("int8 g128 sym", "int4 g128 sym")}
    at_plan = rank_plan_bytes(ctx, c, rank_plan or {})
    sizes = list(dict.fromkeys([budget, *([at_plan] if at_plan is not None else []),
                                *(_model_bytes(p, c) for p in reversed(list(uniform.values())))]))
    plans: list[BitsPlan] = []
    with ctx.progress.phase("rank or bits: plans", unit="plan"):
        total = 3 * len(sizes) + 3
        for size in sizes:
            one = {fam: _measure(ctx, refs, c, fam, size, choose(c.family(fam), size - c.rest_bytes))
                   for fam in ("bits", "rank")}
            metric = ctx.session.metric
            rho = ratio(one["rank"], one["bits"], metric.tolerance / 100) if not metric.higher_is_better else 1.0
            joint = _measure(ctx, refs, c, "joint", size, choose(c.recalibrated(rho), size - c.rest_bytes))
            joint.rho = rho
            plans += [joint, one["bits"], one["rank"]]
            ctx.progress.update(len(plans), total)
        base = [_measure(ctx, refs, c, "uniform " + lab.split()[0], _model_bytes(p, c), p)
                for lab, p in uniform.items()]
        svd = _uniform_truncation(c, budget)
        base.append(_measure(ctx, refs, c, "uniform truncation", budget, *(svd or (None, None))))
        ctx.progress.update(total, total)
    report = BitsReport(budget, c.dense_bytes, c.rest_bytes, len(c.layers), weights, c.weighted, sizes, plans, base,
                        smallest=c.smallest, rank_plan_size=at_plan)
    here = [p for p in plans if p.size == budget and p.reachable and p.value is not None and math.isfinite(p.value)]
    if write_to is not None and not here:
        raise AuditError(f"--write-bits: no byte plan at {budget:,} bytes measured a finite value; nothing to write",
                         "Check the calibration data and the model's outputs (the report's plans are measured)")
    if write_to is not None:  # the knapsack proposes, the measurement disposes: the plan that measured least harm
        best = (max if ctx.session.metric.higher_is_better else min)(here, key=lambda p: p.value)  # type: ignore
        report.written, report.written_family = str(write_to), best.family  # its choices' words: the renderer
        report.file_bytes, report.header_bytes = write(ctx.model, c, best, write_to)
    report.seconds = time.perf_counter() - t
    return report  # its verdict is written with the report's metric facts


def write(model: "nn.Module", c: Costed, plan: BitsPlan, directory: str) -> tuple[int, int]:
    """``plan`` written into ``directory`` (:func:`~auditor.quantize.written.write_byte_plan`): the kept layers as
    they are, the others as their parts; returns the file's bytes and its header's."""
    from ...quantize.written import MODEL_FILE, write_byte_plan

    parts = {k: c.layers[k].parts(c.layers[k].recipes[label]) for k, label in plan.choices.items() if label != "keep"}
    planned = {c.layers[k].layer.param for k in parts}
    dense = {k: v for k, v in model.state_dict().items() if k not in planned}
    size = write_byte_plan(directory, dense, parts, {"predicted_bytes": plan.nbytes, "choices": plan.choices})
    with open(f"{directory}/{MODEL_FILE}", "rb") as fh:
        return size, 8 + int.from_bytes(fh.read(8), "little")

