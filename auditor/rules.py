"""The anti-pattern rules: one registry, each rule with a code, a slug, a severity and documentation in fixed
sections (What it flags / Why it is bad / Example / Do instead). docs/rules.md is generated from these docstrings."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from . import lrmath
from .results import Finding, PlanItem, Severity, Verdict

if TYPE_CHECKING:
    from .results import Audit
    from .plan import Plan

SECTIONS = ("What it flags", "Why it is bad", "Example", "Do instead")


@dataclass
class Context:
    audit: "Audit"
    plan: "Plan | None"

    @property
    def items(self) -> list[PlanItem]:
        return self.audit.review.items if self.audit.review else []

    @property
    def settings(self):  # type: ignore[no-untyped-def]
        return self.audit.settings


@dataclass(frozen=True)
class Rule:
    code: str
    slug: str
    severity: Severity
    check: Callable[[Context], Iterator[Finding]]
    # Which of its findings the command line treats as bad input (exit 2, no report); the library keeps them all.
    input_error: Callable[[Finding], bool] = lambda f: False

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

    def finding(self, message: str, layers: list[str], fix: str, **evidence: object) -> Finding:
        return Finding(self.code, self.slug, self.severity, message, layers, dict(evidence), fix)


RULES: dict[str, Rule] = {}


def rule(code: str, slug: str, severity: Severity,  # type: ignore[no-untyped-def]
         input_error: Callable[[Finding], bool] = lambda f: False):
    def deco(fn: Callable[[Context], Iterator[Finding]]) -> Callable[[Context], Iterator[Finding]]:
        r = Rule(code, slug, severity, fn, input_error)
        missing = [s for s in SECTIONS if s not in r.sections]
        assert not missing, f"{code} docs lack sections {missing}"
        RULES[code] = r
        return fn

    return deco


def _r(code: str) -> Rule:
    return RULES[code]


@rule("LR001", "rank-at-or-above-break-even", Severity.ERROR)
def _lr001(ctx: Context) -> Iterator[Finding]:
    """Planned rank at or above the break-even rank m*n/(m+n).

    ## What it flags
    A planned rank r with r*(m+n) >= m*n for an m x n weight: the factors A (m x r) and B (r x n) store at least as
    many numbers as W itself.

    ## Why it is bad
    Nothing is saved, neither parameters nor multiply-accumulates, and A B is still limited to rank r: the layer
    loses expressivity for no gain. For a 4096 x 4096 layer the break-even rank is 2048; rank 3000 stores
    24,576,000 numbers instead of 16,777,216.

    ## Example
    ```toml
    [ranks]
    "decoder.layers.*.mlp.up_proj" = 3000   # 4096 x 4096: break-even 2048
    ```

    ## Do instead
    Choose a rank well below break-even (a quarter of it gives 4x fewer weights on a square layer), read the energy
    kept at that rank from the report, or keep the layer dense.
    """
    for it in ctx.items:
        layer = ctx.audit.layer(it.layer)
        if it.rank <= layer.max_rank and not lrmath.saves(layer.m, layer.n, it.rank):
            yield _r("LR001").finding(
                f"rank {it.rank} for {it.layer} ({layer.m}x{layer.n}) is at or above the break-even rank "
                f"{layer.break_even:.1f}: {layer.params_at(it.rank):,} weights instead of {layer.params:,}",
                [it.layer],
                f"Use a rank below {layer.break_even:.1f} (e.g. {max(1, math.floor(layer.break_even / 4))}) or keep it dense",
                rank=it.rank, break_even=round(layer.break_even, 1), m=layer.m, n=layer.n,
                params_dense=layer.params, params_factored=layer.params_at(it.rank),
            )


@rule("LR002", "rank-above-matrix-rank", Severity.ERROR, input_error=lambda f: True)
def _lr002(ctx: Context) -> Iterator[Finding]:
    """Planned rank above min(m, n).

    ## What it flags
    A planned rank larger than the smaller side of the weight's matrix view.

    ## Why it is bad
    An m x n matrix has rank at most min(m, n); factors of a larger rank cannot represent anything more, and they
    are always above break-even. The plan is wrong, not just wasteful: usually a typo or a pattern that matched
    the wrong layer.

    ## Example
    ```toml
    [ranks]
    "classifier" = 64   # classifier is 10 x 256: rank at most 10
    ```

    ## Do instead
    Fix the rank or narrow the pattern so that it matches only the layers you meant.
    """
    for it in ctx.items:
        layer = ctx.audit.layer(it.layer)
        if it.rank > layer.max_rank:
            yield _r("LR002").finding(
                f"rank {it.rank} for {it.layer} is above min(m, n) = {layer.max_rank} of its {layer.m}x{layer.n} matrix",
                [it.layer], f"Use a rank below {layer.break_even:.1f}, or narrow the pattern {it.pattern!r}",
                rank=it.rank, max_rank=layer.max_rank, m=layer.m, n=layer.n,
            )


@rule("LR003", "narrow-layer-targeted", Severity.WARNING)
def _lr003(ctx: Context) -> Iterator[Finding]:
    """A narrow layer targeted: a tiny share of the parameters, or a break-even rank that leaves no room.

    ## What it flags
    A planned layer that holds less than `min_share` of the model's parameters (default 0.25%), or whose
    break-even rank is below `min_break_even` (default 16).

    ## Why it is bad
    Almost none of the parameters live there, so the saving is negligible, while every factorized layer adds a
    rank floor to measure, an extra kernel launch and accuracy risk. Narrow layers often also carry information
    bottlenecks (heads, projections to few channels) that do not tolerate truncation.

    ## Example
    ```toml
    [ranks]
    "head" = 8   # 64 x 64 in a 10M-parameter model: 0.04% of the weights
    ```

    ## Do instead
    Target the widest layers first: the layer table is sorted by parameter share and says how many layers hold 80%.
    """
    s = ctx.settings
    for it in ctx.items:
        layer = ctx.audit.layer(it.layer)
        if layer.share < s.min_share or layer.break_even < s.min_break_even:
            why = (f"holds {100 * layer.share:.3f}% of the parameters (threshold {100 * s.min_share:g}%)"
                   if layer.share < s.min_share else
                   f"its break-even rank {layer.break_even:.1f} is below {s.min_break_even:g}")
            yield _r("LR003").finding(
                f"{it.layer} ({layer.m}x{layer.n}) is narrow: {why}", [it.layer],
                "Drop it from the plan and target the widest layers first",
                share=layer.share, break_even=round(layer.break_even, 1), params=layer.params,
            )


@rule("LR004", "energy-below-floor", Severity.WARNING)
def _lr004(ctx: Context) -> Iterator[Finding]:
    """Planned rank keeps less spectral energy than the floor.

    ## What it flags
    A planned rank r whose energy E(r) = sum(sigma_i^2, i <= r) / ||W||_F^2 is below `energy_floor` (default 0.90).

    ## Why it is bad
    The best rank-r approximation has relative error sqrt(1 - E(r)): at 80% energy that is 45% of the weight's
    norm, gone before fine-tuning starts. "Any rank is fine if we fine-tune" is not a plan: recovery is slower and
    less complete the more is cut, and the floor differs per layer.

    ## Example
    ```toml
    [ranks]
    "encoder.layer.*.intermediate.dense" = 16   # keeps 41% of the energy
    ```

    ## Do instead
    Use `"energy:0.95"` or the rank the report lists for 90/95/99% energy, and measure the accuracy after the
    recovery fine-tune.
    """
    floor = ctx.settings.energy_floor
    for it in ctx.items:
        if it.energy_kept is not None and it.energy_kept < floor:
            yield _r("LR004").finding(
                f"rank {it.rank} for {it.layer} keeps {100 * it.energy_kept:.1f}% of the spectral energy, below the "
                f"floor of {100 * floor:g}% (best relative error {it.error_bound:.3f})",
                [it.layer], f"Raise the rank (see the ranks for {100 * floor:g}% in the layer table)",
                rank=it.rank, energy_kept=round(it.energy_kept, 6), floor=floor,
                error_bound=round(it.error_bound or 0.0, 6),
            )


@rule("LR005", "no-finetune-budget", Severity.WARNING)
def _lr005(ctx: Context) -> Iterator[Finding]:
    """The plan budgets no recovery fine-tune.

    ## What it flags
    A plan file without a non-empty `finetune` entry.

    ## Why it is bad
    Truncating a trained weight always moves the model; even at 99% energy the errors of many layers compound.
    A recovery fine-tune is part of every low-rank compression that keeps its accuracy, and it costs compute and
    data that must be planned.

    ## Example
    ```toml
    [ranks]
    "*.mlp.*" = "energy:0.95"
    # no finetune = "..."
    ```

    ## Do instead
    Add `finetune = "1 epoch on the training set, lr 1e-4"` (or whatever you have budgeted) to the plan.
    """
    if ctx.plan is not None and ctx.items and not ctx.plan.has_finetune:
        yield _r("LR005").finding(
            f"plan {ctx.plan.source} budgets no recovery fine-tune", [],
            'Add finetune = "..." describing the recovery fine-tune', finetune=ctx.plan.finetune,
        )


@rule("LR006", "tied-weight-targeted", Severity.WARNING)
def _lr006(ctx: Context) -> Iterator[Finding]:
    """A tied or shared weight targeted.

    ## What it flags
    A planned weight that has more than one name (GPT-2's lm_head is transformer.wte) or is used at more than one
    place or more than once per forward (ALBERT's shared layers).

    ## Why it is bad
    Factorizing it changes every use at once: the embedding and the output head, or all twelve applications of a
    shared layer. The saving counts once, while the error is felt at every use.

    ## Example
    ```toml
    [ranks]
    "transformer.wte" = 128   # also the lm_head
    ```

    ## Do instead
    Check the error at every use, or untie the weight first and decide per use; count the saving once.
    """
    for it in ctx.items:
        layer = ctx.audit.layer(it.layer)
        sites = sorted({u.site for u in layer.uses})
        if layer.aliases or len(sites) > 1 or layer.calls > 1:
            yield _r("LR006").finding(
                f"{it.layer} is tied or shared: names {', '.join([layer.param, *layer.aliases])}; "
                f"{layer.calls} use(s) per forward at {', '.join(sites) or layer.name}",
                [it.layer], "Check the error at every use, or untie the weight before factorizing",
                aliases=layer.aliases, uses=[u.site for u in layer.uses], calls=layer.calls,
            )


@rule("LR007", "chained-linear-maps", Severity.INFO)
def _lr007(ctx: Context) -> Iterator[Finding]:
    """Two linear maps chained with nothing nonlinear between them.

    ## What it flags
    Two weight layers where the first feeds only the second and the second reads only the first, with no
    activation, norm or other nonlinear op between them (reshapes and dropout do not count).

    ## Why it is bad
    A B is one linear map of rank at most min(inner width): the pair adds no depth and cannot represent more than
    a single layer. It is already a low-rank factorization (possibly an accidental one); factorizing either factor
    again compounds the truncation.

    ## Example
    ```python
    nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512))   # one 512 x 512 map of rank <= 64
    ```

    ## Do instead
    Treat the pair as one factorized layer: leave it out of the plan, or merge it into one dense layer and
    factorize that once.
    """
    g = ctx.audit.graph
    if g is None or not g.data_flow:
        return
    by_site = {}
    for layer in ctx.audit.layers:
        for u in layer.uses:
            by_site.setdefault(u.site, layer)
    planned = {it.layer for it in ctx.items}
    for a, b in g.chains:
        la, lb = by_site[a], by_site[b]
        inner = min(la.m, la.n, lb.m, lb.n)
        note = " and the plan factorizes it again" if {la.name, lb.name} & planned else ""
        yield _r("LR007").finding(
            f"{a} ({la.m}x{la.n}) feeds {b} ({lb.m}x{lb.n}) with nothing nonlinear between: one linear map of "
            f"rank <= {inner}{note}",
            [la.name, lb.name], "Treat the pair as one factorized layer; do not factorize it again",
            inner_rank=inner,
        )


@rule("LR008", "negligible-saving", Severity.WARNING)
def _lr008(ctx: Context) -> Iterator[Finding]:
    """The whole plan saves a negligible share of the model.

    ## What it flags
    A plan whose total parameter saving is below `negligible_share` (default 1%) of the model's unique parameters.

    ## Why it is bad
    Every factorized layer costs engineering, a fine-tune and accuracy risk. A plan that saves under 1% of the
    model pays those costs for nothing measurable.

    ## Example
    A plan that factorizes only one 64 x 64 layer of a 10M-parameter model saves 0.02%.

    ## Do instead
    Start from the suggested plan (`--emit-plan`), which targets the layers where the parameters are.
    """
    r = ctx.audit.review
    if r is None or not r.items:
        return
    if r.share_saved < ctx.settings.negligible_share:
        yield _r("LR008").finding(
            f"the plan saves {r.params_saved:,} of {r.total_params:,} parameters ({100 * r.share_saved:.3f}%), "
            f"below {100 * ctx.settings.negligible_share:g}%",
            [], "Target the widest layers (see --emit-plan)",
            params_saved=r.params_saved, share_saved=r.share_saved,
        )


@rule("LR009", "small-before-wide", Severity.INFO)
def _lr009(ctx: Context) -> Iterator[Finding]:
    """Small layers targeted while wider candidates stay dense.

    ## What it flags
    A planned layer while a layer at least `wider_factor` (default 4) times larger, which the spectral audit says
    can be factorized, is left out of the plan.

    ## Why it is bad
    The order of work is backwards: the large layer would save more parameters at the same engineering cost, and
    is usually the one with the most redundancy.

    ## Example
    A plan that factorizes `attn.q_proj` (768 x 768) but not `mlp.fc1` (3072 x 768) whose 95%-energy rank is far
    below break-even.

    ## Do instead
    Add the wider candidates first; the layer table is sorted by parameter share.
    """
    planned = {it.layer for it in ctx.items}
    if not planned:
        return
    smallest = min((ctx.audit.layer(n) for n in planned), key=lambda l: l.params)
    wider = [l for l in ctx.audit.layers if l.name not in planned
             and l.params >= ctx.settings.wider_factor * smallest.params
             and ctx.audit.suggestions.get(l.name) is not None
             and ctx.audit.suggestions[l.name].verdict == Verdict.FACTORIZE]
    if wider:
        names = [l.name for l in wider[:5]]
        yield _r("LR009").finding(
            f"{smallest.name} ({smallest.params:,} params) is planned while {len(wider)} layer(s) at least "
            f"{ctx.settings.wider_factor:g}x larger that factorize well stay dense: {', '.join(names)}",
            [smallest.name, *names], "Factorize the wider layers first",
            smallest=smallest.name, wider=names,
        )


@rule("LR010", "non-finite-or-zero-weight", Severity.ERROR,
      input_error=lambda f: "non-finite" in str(f.evidence.get("reason", "")))  # a dead (all-zero) layer is a finding
def _lr010(ctx: Context) -> Iterator[Finding]:
    """Non-finite or all-zero weights.

    ## What it flags
    A weight with NaN or Inf entries, or one that is exactly zero everywhere.

    ## Why it is bad
    A non-finite weight means the checkpoint is broken (a diverged run, a bad conversion); no spectrum exists and
    any compression decision is meaningless. An all-zero weight is dead: it has rank 0 and should be removed,
    not factorized (or it was never trained, and the audit is looking at the wrong checkpoint).

    ## Example
    A checkpoint saved after a loss spike, with `nan` in `encoder.layer.3.output.dense.weight`.

    ## Do instead
    Audit a healthy checkpoint; remove dead layers.
    """
    for layer in ctx.audit.layers:
        sp = ctx.audit.spectra.get(layer.name)
        if sp is not None and sp.skipped and ("non-finite" in sp.skipped or "all-zero" in sp.skipped):
            yield _r("LR010").finding(f"{layer.name} has {sp.skipped}", [layer.name],
                                      "Audit a healthy checkpoint, or remove the dead layer", reason=sp.skipped)


@rule("LR011", "tall-thin-left-alone", Severity.INFO)
def _lr011(ctx: Context) -> Iterator[Finding]:
    """A tall, thin matrix (embedding table, vocabulary head) that factorizes cheaply, left alone.

    ## What it flags
    A weight with max(m, n) / min(m, n) >= `tall_ratio` (default 8) holding at least `tall_min_share` (default 5%)
    of the parameters, which the spectral audit can factorize below break-even, but which the plan leaves dense.

    ## Why it is bad
    Its break-even rank is close to its short side, so a moderate rank saves most of it: an embedding V x H
    becomes V x E plus E x H (50,000 x 768 at E = 128: 38.4M -> 6.5M weights). Leaving the biggest block alone
    caps what the plan can save. (Lookups stay cheap; the E x H projection adds E*H MACs per token.)

    ## Example
    A plan for a small language model that factorizes every attention projection but not the 30,000 x 768
    embedding that holds a quarter of the weights.

    ## Do instead
    Add the table with a factorized embedding (ALBERT-style E) at a rank from the report.
    """
    planned = {it.layer for it in ctx.items}
    s = ctx.settings
    for layer in ctx.audit.layers:
        ratio = max(layer.m, layer.n) / min(layer.m, layer.n)
        sg = ctx.audit.suggestions.get(layer.name)
        if (layer.name not in planned and ratio >= s.tall_ratio and layer.share >= s.tall_min_share
                and sg is not None and sg.verdict == Verdict.FACTORIZE):
            yield _r("LR011").finding(
                f"{layer.name} ({layer.m}x{layer.n}, {100 * layer.share:.1f}% of the parameters) is tall and thin "
                f"and factorizes at rank {sg.rank} ({sg.compression:.1f}x), but the plan leaves it dense",
                [layer.name], f"Consider factorizing it at rank {sg.rank}",
                ratio=round(ratio, 2), share=layer.share, suggested_rank=sg.rank,
            )


def selected(select: tuple[str, ...] = (), ignore: tuple[str, ...] = ()) -> list[Rule]:
    def match(code: str, prefixes: tuple[str, ...]) -> bool:
        return any(code.startswith(p.upper()) for p in prefixes)

    return [r for c, r in RULES.items() if (not select or match(c, select)) and not match(c, ignore)]


def run_rules(audit: "Audit", plan: "Plan | None") -> list[Finding]:
    ctx = Context(audit, plan)
    out: list[Finding] = []
    for r in selected(audit.settings.select, audit.settings.ignore):
        out.extend(r.check(ctx))
    return sorted(out, key=Finding.sort_key)


def rule_doc(r: Rule) -> str:
    lines = [f"## {r.code} {r.slug}", "", f"*Severity: {r.severity}*. {r.summary}", ""]
    for name, body in r.sections.items():
        lines += [f"### {name}", "", body, ""]
    return "\n".join(lines)


def rules_markdown() -> str:
    head = ["# Rules", "", "Generated from the rule docstrings in `auditor/rules.py` by `lowrank-audit rules --markdown`;",
            "do not edit by hand.", "", "| code | slug | severity | flags |", "|---|---|---|---|"]
    for r in RULES.values():
        head.append(f"| {r.code} | {r.slug} | {r.severity} | {r.summary} |")
    return "\n".join(head) + "\n\n" + "\n".join(rule_doc(r) for r in RULES.values())
