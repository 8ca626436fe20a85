"""The pipeline: named stages, each taking values and returning a new value; none changes what an earlier stage
made. The stages, with their input and output types::

    load_model      spec, LoadOptions                              -> Loaded (nn.Module or WeightsOnly, inputs)
    resolve_settings AuditOptions, Plan | None                     -> Settings
    measure         nn.Module                                      -> Measured (ParamTable, {param: Layer})
    trace_model     nn.Module, inputs, Tracer                      -> Traced (TraceResult, ExampleInputs | None)
    build_graph     Traced, nn.Module, Measured                    -> Graphed (new Layers with uses/MACs, LayerGraph)
    rank_layers     {param: Layer}, total params                   -> [Layer] largest first, with shares
    (module_structure / weights_structure combine the above into a Structure)
    compute_spectra [Layer], loaders, Settings, AuditOptions       -> Spectra ({layer: Spectrum}, stats)
    suggest_ranks   [Layer], {layer: Spectrum}, Settings           -> {layer: Suggestion}
    calibrate       nn.Module, Structure, AuditOptions             -> Calibrated | None, data-aware suggestions
    review          Audit, Plan | None                             -> Audit with .review
    check           Audit, Plan | None                             -> Audit with .findings

:func:`audit` runs them in that order. :func:`factorize_plan` applies a reviewed plan with the data's factors: the
one orchestration of ``auditor.factorize`` and ``lowrank-audit factorize``. Only this module, :mod:`auditor.cli` and
``auditor/__init__`` import the pipeline; the stages below it (sources/, structure/, spectra/, suggest, plan,
rules/, calibration/) never import it.
"""

from __future__ import annotations

import contextlib
import platform
import re
import sys
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

import torch
from torch import nn

from ._version import __version__
from .config import Settings, check_plan_relaxes, validate
from .errors import AuditError
from .options import AuditOptions, LoadOptions, Tracer
from .results import AuditResult, GraphNode, Layer, LayerGraph, Spectrum, Suggestion, TieGroup, TraceMethod

if TYPE_CHECKING:
    import os

    import networkx as nx

    from .calibration.apply import CalibrationGiven, Fit, Spelling
    from .calibration.stage import Calibrated
    from .calibration.statistics.whiten import LossMetric
    from .structure.layers import ParamTable
    from .sources import Loaded, WeightsOnly
    from .planning.plan import Plan
    from .structure.trace import ExampleInputs, TraceResult

    from typing_extensions import Unpack

    from .options import CalibrationInput, OptionFields
    from .progress import Progress

    PlanGiven = Union[AuditResult, Plan, str, "os.PathLike[str]", Mapping[str, Any]]
    """A plan ``factorize`` applies: an audit's result (its review), ``{layer: rank}``, or what :func:`audit` takes."""
    FitCalibration = Union[Calibrated, CalibrationGiven, CalibrationInput]
    """What ``factorize`` fits the factors on: an audit's :class:`Calibrated` (its session and loss metric), a session,
    the rows, input statistics, or data :func:`auditor.calibration.load_calibration` reads (25% held out)."""

Loader = Callable[[], torch.Tensor]


# ---- values passed between stages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """The model's unique tensors and its factorizable weights by module type (no uses or MACs yet)."""

    table: "ParamTable"
    layers: dict[str, Layer]  # canonical tensor name -> Layer, module order


@dataclass(frozen=True)
class Traced:
    result: "TraceResult"
    inputs: "ExampleInputs | None"


@dataclass(frozen=True)
class Graphed:
    """The layers with their uses and MACs filled in from the graph (new objects), and the graph as plain data."""

    layers: dict[str, Layer]
    graph: LayerGraph
    macs_known: bool
    unsupported: dict[str, int]


@dataclass(frozen=True)
class Structure:
    """Everything about the model but its spectra: what the rest of the pipeline needs, for any kind of source."""

    model_name: str
    source: str
    trace_method: TraceMethod
    trace_failures: list[str]
    inputs: str | None
    total_params: int
    layers: list[Layer]  # largest first, shares set
    macs_known: bool
    graph: LayerGraph | None
    unsupported: dict[str, int]
    notes: list[str]
    loaders: dict[str, Loader]  # layer name -> reads its tensor when called
    log: str = ""  # what torch logged while tracing (``Audit.trace_log``, shown with --verbose)


@dataclass(frozen=True)
class Spectra:
    by_layer: dict[str, Spectrum]
    stats: dict[str, int] = field(default_factory=dict)
    where: str = "local"  # where the spectra were computed, for the report's environment


# ---- stages ----------------------------------------------------------------------------------------------------
def load_model(spec: str, options: LoadOptions) -> "Loaded":
    """A source string -> a model (``nn.Module`` or ``WeightsOnly``), its example inputs, name and source."""
    from .sources import load_source

    shapes = [tuple(s) for s in options.input_shape] if options.input_shape else None
    return load_source(spec, input_shape=shapes, input_ids=options.input_ids, weights=options.weights,
                       structure_only=options.structure_only, partial=options.partial,
                       auto_inputs=options.auto_inputs)


def active_rules(select: tuple[str, ...], ignore: tuple[str, ...]) -> set[str]:
    """The codes of the rules a selection runs (the registry resolves codes, prefixes and slugs)."""
    from .rules.runner import selected

    return {r.code for r in selected(select, ignore)}


def resolve_settings(options: AuditOptions, plan: "Plan | None") -> Settings:
    """The one precedence path: ``options.settings`` < the plan's [thresholds] < ``options.overrides``; besides the
    global settings, those the registered rules declare (each rule's own thresholds, plugins' included)."""
    from .rules import RULES

    declared = RULES.settings()
    settings = options.settings
    if plan is not None and plan.thresholds:
        relaxed = settings.with_overrides(plan.thresholds, plan.source, declared, typed=True)
        if not options.plan_may_relax:  # a plan cannot silence its own review (pyproject.toml may allow it)
            check_plan_relaxes(settings, relaxed, plan.source, active_rules, declared)
        settings = relaxed
    if options.overrides:
        settings = settings.with_overrides(dict(options.overrides), options.overrides_origin, declared)
    return validate(settings, declared)


def measure(model: nn.Module) -> Measured:
    from .structure.layers import ParamTable, collect_layers

    table = ParamTable.of(model)
    return Measured(table, collect_layers(model, table))


def trace_model(model: nn.Module, inputs: Any, tracer: Tracer) -> Traced:
    """Trace with dropout off; the caller's training mode is restored."""
    from .structure.trace import ExampleInputs, trace

    ex = ExampleInputs.of(inputs)
    was_training = model.training
    model.eval()
    try:
        return Traced(trace(model, ex, tracer=str(tracer)), ex)
    finally:
        model.train(was_training)


def layer_graph(g: "nx.DiGraph", method: TraceMethod, chains: list[tuple[str, str]]) -> LayerGraph:
    """A networkx layer graph as plain data; the chained linear pairs (from ``graph.build``) only where the edges
    are data flow."""
    nodes = [GraphNode(str(n), str(d.get("kind", "")), str(d.get("role", "")), int(d.get("calls", 1)))
             for n, d in g.nodes(data=True)]
    chains = [(str(a), str(b)) for a, b in chains] if method.data_flow else []
    return LayerGraph(nodes, [(str(a), str(b)) for a, b in g.edges], method.data_flow, chains)


def build_graph(traced: Traced, model: nn.Module, measured: Measured) -> Graphed:
    """Uses, call counts and MACs per weight from the traced graph, costed with this audit's copy of the op table.
    ``graph.build`` returns new layer records: ``measured`` stays as the measure stage made it."""
    from .structure import graph as graph_mod

    g = graph_mod.build(traced.result, model, measured.table, measured.layers, ops=graph_mod.default_ops())
    method = TraceMethod(traced.result.method)
    return Graphed(g.layers, layer_graph(g.graph, method, g.chains), g.macs_known, dict(g.unsupported))


def natural_key(name: str) -> tuple:
    """layer.2 before layer.10: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def rank_layers(layers: dict[str, Layer], total: int) -> list[Layer]:
    """Largest first, equal sizes in natural name order (encoder.layer.2 before encoder.layer.10), each a new Layer
    with its share of the model's unique parameters."""
    ranked = sorted(layers.values(), key=lambda l: (-l.params, natural_key(l.name)))
    return [replace(l, share=l.params / total if total else 0.0) for l in ranked]


def module_structure(model: nn.Module, inputs: Any, options: AuditOptions,
                     progress: "Progress | None" = None) -> Structure:
    """Measure, trace and build the graph (the "trace" phase). Torch's own logging (FX graph dumps, fake-tensor
    tracebacks, warnings) is captured while tracing: it is kept in ``Structure.log`` (``Audit.trace_log``), and
    attached to an :class:`AuditError` raised while tracing as its ``captured`` attribute (``--verbose`` prints
    it), so a failing trace ends in one line."""
    from .progress import Progress, quiet_torch_logging

    if not isinstance(model, nn.Module):
        raise AuditError(f"expected a torch.nn.Module, got {type(model).__name__}",
                         "Return an nn.Module (or (module, example_inputs)) from the factory")
    progress = progress or Progress(enabled=False)
    with progress.phase("trace"):
        measured = measure(model)
        log = None
        try:
            with quiet_torch_logging() as log:
                traced = trace_model(model, inputs, options.tracer)
                graphed = build_graph(traced, model, measured)
        except AuditError as exc:
            exc.captured = log.text if log is not None else ""  # type: ignore[attr-defined]
            raise
    total = measured.table.total
    from .structure.sites import definition_site

    ranked = [replace(l, defined_at=definition_site(model, l.param)) for l in rank_layers(graphed.layers, total)]
    table = measured.table
    notes = list(table.notes)
    if not graphed.macs_known:
        notes.append("No example inputs: MACs are left out (pass --input-shape or --input-ids to count them).")
    if any(t.device.type == "meta" for t in table.tensors.values()):
        notes.append("Weights are on the meta device: structure only, no spectra.")
    return Structure(
        model_name=options.name or type(model).__name__, source=options.source,
        trace_method=TraceMethod(traced.result.method), trace_failures=list(traced.result.failures),
        inputs=traced.inputs.description if traced.inputs else None, total_params=total, layers=ranked,
        macs_known=graphed.macs_known, graph=graphed.graph, unsupported=graphed.unsupported, notes=notes,
        loaders={l.name: (lambda p=l.param: table.tensor(p)) for l in ranked}, log=log.text if log else "",
    )


def weights_structure(weights: "WeightsOnly", options: AuditOptions) -> Structure:
    """A checkpoint without code: layers from tensor names and shapes, no graph, no MACs."""
    ranked = rank_layers(weights.layers(), weights.total_params)
    return Structure(
        model_name=options.name or weights.name, source=weights.source, trace_method=TraceMethod.WEIGHTS,
        trace_failures=[], inputs=None, total_params=weights.total_params, layers=ranked, macs_known=False,
        graph=None, unsupported={},
        notes=["No graph: weights-only audit; MACs, ties and chained layers cannot be known.", *weights.notes],
        loaders={l.name: weights.loader(l) for l in ranked},
    )




def compute_spectra(layers: list[Layer], loaders: dict[str, Loader], settings: Settings,
                    options: AuditOptions, progress: "Progress | None" = None) -> Spectra:
    """Singular values per layer (the "spectra" phase); ``progress`` moves per finished batch of layers."""
    if not options.spectra:
        return Spectra({})
    from .progress import Progress
    from .spectra import SpectrumCache, ThreadExecutor, backend_for, ref_for
    from .spectra import compute_spectra as run_spectra

    # torch-cuda without CUDA here is one line before any work; on a Dask cluster the workers compute, and a worker
    # without CUDA skips the layer with that reason
    backend = backend_for(options.spectra_backend, here=options.cluster.scheduler is None)
    progress = progress or Progress(enabled=False)
    order = sorted(layers, key=lambda l: -l.params)  # largest first: they are submitted in that order
    refs = [(l.name, ref_for(l, loaders[l.name])) for l in order]
    cache = SpectrumCache(options.cache_dir) if options.cache else None
    with contextlib.ExitStack() as stack:
        if options.cluster.scheduler is not None:  # a Dask cluster (spectra/dask_executor.py); this side writes the cache
            from .spectra.dask_executor import executor_for

            executor: Any = stack.enter_context(executor_for(options.cluster.scheduler, options.cluster.path_map))
        else:
            executor = ThreadExecutor(options.jobs)
        with progress.phase("spectra", total=len(refs)):
            by_layer, stats = run_spectra(refs, targets=settings.energy_targets, backend=backend, executor=executor,
                                          cache=cache, progress=progress.update)
        where = "local" if options.cluster.scheduler is None else executor.where  # asked while the client is open
    return Spectra(by_layer, dict(vars(stats)), where=where)


def tie_groups(st: Structure, options: AuditOptions, plan: "Plan | None",
               ) -> tuple[AuditOptions, tuple[TieGroup, ...]]:
    """The tie groups (``--tie``, else the plan's ``ties``) over the audit's layers, and the options with the ties
    the calibration honours; one AuditError line for a tie that does not resolve."""
    from .planning.ties import resolve_ties

    specs = options.tiers.ties or (plan.ties if plan is not None else ())
    if not specs:
        return options, ()
    ties = resolve_ties(st.layers, specs)
    if not ties:
        st.notes.append("--tie auto: no tie group of a family the tool knows (q/k/v, gate/up; auditor/planning/"
                        "ties.py) is in this model; ranks are chosen per layer")
    return replace(options, tiers=replace(options.tiers, ties=specs)), ties


def suggest_ranks(layers: list[Layer], spectra: dict[str, Spectrum], settings: Settings) -> dict[str, Suggestion]:
    from .planning.suggest import suggest

    return {l.name: suggest(l, spectra.get(l.name), settings) for l in layers}


def calibrate(model: Any, st: Structure, spectra: Spectra, suggestions: dict[str, Suggestion], settings: Settings,
              options: AuditOptions, progress: "Progress | None" = None,
              ) -> "tuple[Calibrated | None, dict[str, Suggestion]]":
    """The calibration stage (``auditor/calibration/stage.py``): tiers 1-3 as plain data, and the suggestions with
    the data-aware rank. (None, suggestions) without calibration data. ``progress`` draws each of its phases
    (default: none drawn)."""
    if options.calibration_data.source is None:
        return None, suggestions
    if not isinstance(model, nn.Module):
        raise AuditError("calibration needs the model's code; a weights-only checkpoint cannot run a forward pass",
                         "Audit a factory (file.py:fn) or a Hugging Face directory to use --calibration")
    from .calibration.stage import calibrate as run_tiers, suggest_with

    calibrated = run_tiers(model, st.layers, settings, options, progress=progress)
    return calibrated, suggest_with(st.layers, spectra.by_layer, suggestions, calibrated.report, settings)


def review(audit: AuditResult, plan: "Plan | None") -> AuditResult:
    """The plan (or, without one, the suggested ranks) reviewed against the audit."""
    from .planning.plan import review_plan

    return replace(audit, review=review_plan(audit, plan))


def check(audit: AuditResult, plan: "Plan | None") -> AuditResult:
    """The rules' findings, sorted by severity; a rule that cannot run here (no data flow, no spectra) is said in a
    note."""
    from .rules import evaluate

    run = evaluate(audit, plan)
    return replace(audit, findings=run.findings, notes=[*audit.notes, *run.notes])


def environment() -> dict[str, str]:
    import networkx
    import numpy

    env = {
        "lowrank-auditor": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "networkx": networkx.__version__,
        "platform": platform.platform(terse=True),
    }
    if "transformers" in sys.modules:
        env["transformers"] = str(getattr(sys.modules["transformers"], "__version__", "?"))
    return env


# ---- entry points ----------------------------------------------------------------------------------------------
def audit(model: Any, inputs: Any = None, *, plan: Any = None, options: AuditOptions | None = None,
          **shortcuts: "Unpack[OptionFields]") -> AuditResult:
    """Audit a model: an ``nn.Module``, or a weights-only checkpoint from :func:`auditor.sources.load_source`.

    ``inputs``: a tensor, a tuple of positional inputs, a dict of keyword inputs, or (args, kwargs); without them
    MACs are not counted. ``plan``: a :class:`auditor.planning.plan.Plan`, a path to a TOML/JSON plan, or a dict; without
    one the suggested ranks are reviewed. ``options``: an :class:`AuditOptions`. Any of its fields may also be
    given as a keyword (``audit(m, x, spectra=False)`` is ``options=AuditOptions(spectra=False)``; a keyword
    replaces that field of ``options``); other keywords raise TypeError.

    >>> import auditor, torch
    >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(64, 32)), torch.zeros(1, 64), spectra=False)
    >>> a.total_params, a.total_macs, str(a.trace_method)
    (2080, 2048, 'torch.fx.symbolic_trace')
    """
    opts = (options or AuditOptions()).with_(**shortcuts) if shortcuts else (options or AuditOptions())
    return audit_session(model, inputs, plan=plan, options=opts)[0]


def audit_session(model: Any, inputs: Any = None, *, plan: Any = None,
                  options: AuditOptions | None = None) -> "tuple[AuditResult, Calibrated | None]":
    """:func:`audit`, and what its calibration stage measured with (None without calibration data): the session
    (the model, the batches, the input statistics and the evaluator with its dense reference) and the gradient
    pass's loss metric, for a caller that goes on to factorize or recover with them (``lowrank-audit factorize``)
    instead of reading and measuring all again."""
    from .sources import WeightsOnly
    from .planning.plan import Plan

    opts = options or AuditOptions()
    progress = _progress(opts)
    plan_obj = Plan.coerce(plan) if plan is not None else None
    if plan_obj is not None and plan_obj.compute_dtype and opts.statistics.compute_dtype is None \
            and opts.calibration_data.source is not None:
        opts = replace(opts, statistics=replace(opts.statistics, compute_dtype=plan_obj.compute_dtype))  # the dtype the plan's ranks were measured in
    settings = resolve_settings(opts, plan_obj)
    if isinstance(model, WeightsOnly):
        st = weights_structure(model, opts)
    else:
        st = module_structure(model, inputs, opts, progress)
    opts, ties = tie_groups(st, opts, plan_obj)  # bad ties are refused before any spectrum is computed
    spectra = compute_spectra(st.layers, st.loaders, settings, opts, progress)
    suggestions = suggest_ranks(st.layers, spectra.by_layer, settings)
    if ties:
        from .planning.ties import tie_suggestions

        suggestions = tie_suggestions(st.layers, spectra.by_layer, suggestions, ties)
    calibrated, suggestions = calibrate(model, st, spectra, suggestions, settings, opts, progress)
    if ties and calibrated is not None:
        from .planning.ties import keep_ties

        suggestions = keep_ties(suggestions, ties)
    result = AuditResult(
        model_name=st.model_name, source=st.source, trace_method=st.trace_method, trace_failures=st.trace_failures,
        inputs=st.inputs, total_params=st.total_params, layers=st.layers, macs_known=st.macs_known,
        settings=settings, spectra=spectra.by_layer, suggestions=suggestions,
        unsupported_ops=st.unsupported, notes=st.notes, graph=st.graph,
        environment={**environment(), **({"spectra": spectra.where} if opts.spectra else {}),
                     **({"sweep": calibrated.sweep} if calibrated is not None and calibrated.sweep else {}),
                     **({"tier1": calibrated.session.decompositions.where}
                        if calibrated and calibrated.session.decompositions.where
                        else {})},
        spectra_stats=spectra.stats, trace_log=st.log,
        calibration=calibrated.report if calibrated is not None else None, ties=ties,
    )
    result = review(result, plan_obj)
    if calibrated is not None:
        from .calibration.stage import check_plan

        with progress.phase("plan check"):
            result = replace(result, calibration=check_plan(calibrated, model, result))
    if opts.speed.measure:
        result = measure_speed(model, inputs, result, opts, progress)
    return check(result, plan_obj), calibrated


def measure_speed(model: Any, inputs: Any, audit: AuditResult, options: AuditOptions,
                  progress: "Progress | None" = None) -> AuditResult:
    """The speed stage (``auditor/speed/speed_stage.py``, only with ``measure_speed``): the reviewed plan's layers and
    the whole model timed dense and factorized, before the rules run (LR020 reads it)."""
    from .progress import Progress
    from .speed.speed_stage import measure_speed as run_speed

    with (progress or Progress(enabled=False)).phase("speed"):
        return replace(audit, speed=run_speed(model, inputs, audit, options))


def _progress(options: AuditOptions) -> "Progress":
    """The one Progress of a run, made before any quiet block redirects stderr: ``options.progress`` None draws
    only when stderr is a terminal."""
    from .progress import Progress

    return Progress(enabled=options.progress)


def render_reports(result: AuditResult, formats: list[str], context: Any,
                   progress: "Progress | None" = None) -> dict[str, str | bytes]:
    """Every format of ``formats`` rendered (the "render" phase), nothing written: the caller writes each file
    atomically once all are rendered.

    >>> import auditor, torch
    >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False, progress=False)
    >>> from auditor.render import RenderContext
    >>> sorted(render_reports(a, ["json", "md"], RenderContext()))
    ['json', 'md']
    """
    from .progress import Progress
    from .render import REPORTERS

    progress = progress or Progress(enabled=False)
    with progress.phase("render", total=len(formats), unit="format"):
        out: dict[str, str | bytes] = {}
        for fmt in formats:
            out[fmt] = REPORTERS[fmt].render(result, context)
            progress.update(len(out), len(formats))
    return out


@dataclass(frozen=True)
class Factorized:
    """What :func:`factorize_plan` made: the reviewed plan's ranks (``{layer name: rank}``) and the factorized copy."""

    ranks: dict[str, int]
    model: nn.Module
    fit: "Fit"  # the fit the factors came from (the default's fallback named; without calibration: the SVD's)
    calibrated: bool = True  # whether calibration was given (False: the plain SVD, whatever ``fit`` says)

    @property
    def fit_label(self) -> str:
        """The fit in words, as plan.json writes it: :attr:`Fit.label`, or ``"svd"`` without calibration."""
        return self.fit.label if self.calibrated else "svd"


def factorize_plan(model: nn.Module, plan: "PlanGiven", calibration: "FitCalibration | None" = None, *,
                   fit: "Fit | str | None" = None, refit_dense: bool = False, refine: bool = True,
                   spelled: "Spelling | None" = None) -> Factorized:
    """The one orchestration of ``auditor.factorize`` and ``lowrank-audit factorize``: the fit resolved (``fit``
    None: :func:`auditor.calibration.apply.default_fit`, the sequential fit wherever the calibration holds rows) and
    its flags checked (before any review or gradient pass is paid for), the plan reviewed (:func:`reviewed_ranks`), the calibration
    resolved (data becomes a session with the metric the audit would pick; an audit's :class:`Calibrated` gives its
    session and its gradient pass's loss metric), the loss-aware and sequential fits' loss metric (the kept one where
    it covers the plan, else one gradient pass), then the plan applied (:func:`auditor.calibration.apply.factorize`)
    in the dtype the session measured in. ``spelled``: how the caller names its options in a refusal (default: the
    library's keywords, :data:`auditor.calibration.apply.LIBRARY`)."""
    from .calibration.apply import FITTED_WITH, LIBRARY, default_fit, factorize, fit_of
    from .calibration.session import CalibrationSession
    from .calibration.stage import computing, session_dtype
    from .calibration.tiers.sensitivity import loss_metric_for
    from .surgery import checked_plan

    spelled = spelled or LIBRARY
    chosen = (default_fit(calibration) if fit is None else fit_of(fit)).with_flags(
        refit_dense, refine, calibration is not None, spelled)
    if not isinstance(model, nn.Module):
        raise AuditError(f"factorize() needs the model as an nn.Module, got {type(model).__name__}",
                         "Load the model's code (a factory or a Hugging Face directory), not only its weights")
    ranks = reviewed_ranks(model, plan, spelled)
    given, kept = _fit_calibration(model, calibration)
    session = given if isinstance(given, CalibrationSession) else None
    with computing(model, session_dtype(session) if session is not None else None):  # as the audit measured
        loss_metric = None if session is None else loss_metric_for(
            session, model, [l for l, _ in checked_plan(model, ranks).values()], chosen, spelled, kept)
        made = Factorized(ranks, factorize(model, ranks, given, fit=chosen, loss_metric=loss_metric), chosen,
                          given is not None)
    setattr(made.model, FITTED_WITH, made.fit_label)
    return made


def reviewed_ranks(model: nn.Module, plan: "PlanGiven", spelled: "Spelling") -> dict[str, int]:
    """The ranks of ``plan``: ``{layer name: rank}`` as given, else the audit's review of it (an audit's result, or
    one run here without calibration), refused in one line (named as ``spelled.plan``) when the review found bad
    input, the plan names no layer, a rank is at or above break-even (LR001; only where ``spelled.no_saving`` names
    the flag that allows it) or the plan breaks a tie (LR021: the fused kernel the ties are for could not run it)."""
    from .planning.ties import broken_words, violations
    from .verdict.policy import input_errors

    if isinstance(plan, Mapping) and "ranks" not in plan and not isinstance(plan, AuditResult):
        return dict(plan)  # {layer or tensor name: rank}, not a plan file's table
    result = plan if isinstance(plan, AuditResult) else audit(model, plan=plan, options=AuditOptions(progress=False))
    for f in input_errors(result):
        raise AuditError(f"{f.code} {f.message}", f.fix)
    ranks = {it.layer: it.rank for it in result.review.items} if result.review is not None else {}
    if not ranks and not result.layers:
        raise AuditError(f"{spelled.plan} factorizes no layer of {result.model_name}: the model has no weight matrix "
                         "factorize can rewrite", "Nothing to factorize: use the model as it is")
    if not ranks:
        raise AuditError(f"{spelled.plan} factorizes no layer of {result.model_name}", "Check the plan's patterns")
    if spelled.no_saving is not None:
        _no_saving(result, ranks, spelled.no_saving)
    broken = violations(ranks, result.ties)
    if broken:
        what, fix = broken_words(broken)
        raise AuditError(f"LR021 {spelled.plan} {what}", f"{fix}; factorize writes no model that breaks a tie")
    return ranks


def _no_saving(result: AuditResult, plan: dict[str, int], flag: str) -> None:
    """Refuse, as LR001 flags them, planned ranks at or above break-even: the factorized layer would grow (``flag``
    writes them anyway)."""
    import math

    from .lrmath import saves

    for name, r in plan.items():
        layer = result.layer(name)
        if not saves(layer.m, layer.n, r):
            be = layer.break_even
            raise AuditError(
                f"rank {r} for {name} ({layer.m}x{layer.n}) is at or above its break-even rank {be:.1f} (LR001): the "
                f"factors store {layer.params_at(r):,} weights instead of {layer.params:,}",
                f"Use a rank below {be:.1f} (e.g. {max(1, math.floor(be / 4))}), leave {name} out of the plan, or "
                f"pass {flag} to write it anyway")


def _fit_calibration(model: nn.Module, calibration: "FitCalibration | None",
                     ) -> "tuple[CalibrationGiven | None, LossMetric | None]":
    """(what the factors are fitted on, the loss metric kept with it): an audit's :class:`Calibrated` gives its
    session and its gradient pass's loss metric; a session, the rows or statistics are used as given; data is read
    (:func:`auditor.calibration.load_calibration`, 25% held out) into a session with the metric the audit would
    pick for it."""
    from .calibration.data.inputs import Calibration, load_calibration
    from .calibration.session import CalibrationSession, metric_of
    from .calibration.stage import Calibrated
    from .calibration.statistics.stats import InputStatistics
    from .options import TierOptions

    if calibration is None or isinstance(calibration, (CalibrationSession, InputStatistics)):
        return calibration, None
    if isinstance(calibration, Calibrated):
        return calibration.session, calibration.loss_metric
    cal = calibration if isinstance(calibration, Calibration) else load_calibration(calibration, model, 0.25)
    return CalibrationSession.of(cal, model, metric=metric_of(TierOptions(), model, cal)), None


def audit_source(spec: str, *, plan: Any = None, options: AuditOptions | None = None,
                 load: LoadOptions | None = None) -> AuditResult:
    """Load a model from a source string and audit it, as plain data (the public :func:`auditor.api.audit_source`
    wraps it with the output methods)."""
    opts = options or AuditOptions()
    with _progress(opts).phase("load"):
        loaded = load_model(spec, load or LoadOptions())
    opts = replace(opts, name=opts.name or loaded.name, source=loaded.source,
                   cluster=replace(opts.cluster, origin=(spec, load or LoadOptions())))
    data = opts.calibration_data
    if data.source is not None and isinstance(loaded.model, nn.Module):
        from .calibration.data.text import check_text_sources, tokenizer_home

        if data.tokenizer is None:  # a text file is tokenized by the Hugging Face directory's own tokenizer
            data = replace(data, tokenizer=tokenizer_home(loaded.source))
            opts = replace(opts, calibration_data=data)
        check_text_sources([data.source, data.holdout], data.tokenizer, data.max_bytes)  # bad text fails first
        from .speed.estimate import refuse_if_short

        refuse_if_short(loaded, opts)  # one line, exit 2, when the estimated peak exceeds the memory available
    result = audit(loaded.model, loaded.example_inputs, plan=plan, options=opts)
    from .sources.checkpoint import check_mapped

    check_mapped(loaded.model)  # weights read from their file throughout: it must not have changed meanwhile
    if loaded.notes:  # what the loader decided (structure only, inputs made from the config, partial weights)
        result = replace(result, notes=[*loaded.notes, *result.notes])
    return result
