"""The pipeline: load -> trace -> graph -> measure -> spectra -> suggest -> plan review -> rules = Audit."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import networkx as nx
import torch
from torch import nn

from . import __version__
from .config import Settings, validate
from .errors import AuditError
from .results import Finding, Layer, PlanReview, Spectrum, Suggestion
from .trace import Method

SCHEMA_VERSION = 1


@dataclass
class Audit:
    """The result of an audit: plain data. Renderers read only this."""

    model_name: str
    source: str
    trace_method: str
    trace_failures: list[str]
    inputs: str | None
    total_params: int
    layers: list[Layer]  # factorizable weights, largest first
    macs_known: bool
    settings: Settings
    spectra: dict[str, Spectrum] = field(default_factory=dict)
    suggestions: dict[str, Suggestion] = field(default_factory=dict)
    review: PlanReview | None = None
    findings: list[Finding] = field(default_factory=list)
    unsupported_ops: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    graph: nx.DiGraph | None = None
    environment: dict[str, str] = field(default_factory=dict)
    spectra_stats: dict[str, int] = field(default_factory=dict)

    # ---- derived numbers -------------------------------------------------------------------------------------
    @property
    def factorizable_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def rest_params(self) -> int:
        return self.total_params - self.factorizable_params

    @property
    def rest_share(self) -> float:
        return self.rest_params / self.total_params if self.total_params else 0.0

    @property
    def total_macs(self) -> int | None:
        if not self.macs_known:
            return None
        return sum(layer.macs or 0 for layer in self.layers)

    @property
    def trace_summary(self) -> str:
        text = f"Traced with {self.trace_method}"
        if self.trace_method == Method.WALK:
            text += ": no data-flow graph, edges follow module call order"
        if self.trace_method == Method.WEIGHTS:
            text = "No graph: layers inferred from tensor names and shapes (weights-only audit)"
        if self.trace_failures:
            text += " (" + "; ".join(self.trace_failures) + ")"
        return text + "."

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name or layer.param == name:
                return layer
        raise KeyError(name)

    def cumulative(self) -> list[float]:
        acc, out = 0.0, []
        for layer in self.layers:
            acc += layer.share
            out.append(acc)
        return out

    def layers_holding(self, fraction: float) -> int:
        """How many of the largest layers hold ``fraction`` of all parameters (0 if they never do)."""
        for i, c in enumerate(self.cumulative(), start=1):
            if c + 1e-12 >= fraction:
                return i
        return 0

    def counts_by_severity(self) -> dict[str, int]:
        counts = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            counts[str(f.severity)] += 1
        return counts

    @property
    def verdict_line(self) -> str:
        c = self.counts_by_severity()
        r = self.review
        saving = ""
        if r is not None and r.items:
            saving = (f"; the {'suggested' if r.source == 'suggested' else 'planned'} ranks save "
                      f"{r.params_saved:,} parameters ({100 * r.share_saved:.1f}% of the model)")
        if c["error"]:
            head = f"FAIL: {c['error']} error(s), {c['warning']} warning(s)"
        elif c["warning"]:
            head = f"REVIEW: {c['warning']} warning(s)"
        else:
            head = "PASS: no errors or warnings"
        return head + saving

    def exit_code(self, fail_on: str | None = None) -> int:
        level = fail_on or self.settings.fail_on
        c = self.counts_by_severity()
        if level == "error" and c["error"]:
            return 1
        if level == "warning" and (c["error"] or c["warning"]):
            return 1
        return 0

    # ---- output ----------------------------------------------------------------------------------------------
    def to_dict(self, with_sigma: bool = False) -> dict[str, Any]:
        from .render.jsonout import to_dict

        return to_dict(self, with_sigma=with_sigma)

    def to_json(self, with_sigma: bool = False, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(with_sigma=with_sigma), indent=indent, sort_keys=False)

    def to_markdown(self) -> str:
        from .render.markdown import render

        return render(self)

    def to_text(self, width: int = 120) -> str:
        from .render.terminal import render

        return render(self, width=width)

    def to_html(self, path: str | Path | None = None) -> str:
        from .render.html import render, write

        return write(self, path) if path is not None else render(self)

    def to_pdf(self, path: str | Path) -> Path:
        from .render.pdf import write

        return write(self, path)

    def to_pandas(self):  # type: ignore[no-untyped-def]
        try:
            import pandas as pd
        except ImportError:
            raise AuditError("pandas is not installed", "pip install pandas") from None
        from .render.view import layer_rows

        return pd.DataFrame(layer_rows(self))

    def _repr_html_(self) -> str:
        from .render.html import render_compact

        return render_compact(self)

    def __repr__(self) -> str:
        return (f"<Audit {self.model_name}: {self.total_params:,} params, {len(self.layers)} factorizable layers, "
                f"{len(self.findings)} findings>")


def environment() -> dict[str, str]:
    import numpy

    env = {
        "lowrank-auditor": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "networkx": nx.__version__,
        "platform": platform.platform(terse=True),
    }
    try:
        import sys

        if "transformers" in sys.modules:
            env["transformers"] = sys.modules["transformers"].__version__
    except Exception:  # pragma: no cover
        pass
    return env


def natural_key(name: str) -> tuple:
    """layer.2 before layer.10: digit runs compare as numbers."""
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def finalize_shares(layers: dict[str, Layer], total: int) -> list[Layer]:
    """Largest first; equal sizes in natural name order (encoder.layer.2 before encoder.layer.10)."""
    ranked = sorted(layers.values(), key=lambda l: (-l.params, natural_key(l.name)))
    for layer in ranked:
        layer.share = layer.params / total if total else 0.0
    return ranked


def audit(
    model: nn.Module | Any,
    example_inputs: Any = None,
    *,
    plan: Any = None,
    settings: Settings | None = None,
    overrides: dict[str, Any] | None = None,
    name: str | None = None,
    source: str = "python object",
    spectra: bool = True,
    cache: bool = True,
    cache_dir: Path | None = None,
    progress: bool | None = None,
    tracer: str = "auto",
    jobs: int | None = None,
) -> Audit:
    """Audit a model (an ``nn.Module``, or weights loaded by :func:`auditor.load.load_source`).

    ``example_inputs``: a tensor, a tuple of positional inputs, a dict of keyword inputs, or (args, kwargs).
    ``plan``: a :class:`auditor.plan.Plan`, a path to a TOML/JSON plan, or a dict; without one the suggested ranks
    are reviewed. ``jobs``: layers whose spectra are computed side by side (default: the cores, at most 4).
    """
    from . import graph as graph_mod
    from .layers import ParamTable, collect_layers
    from .load import WeightsOnly
    from .plan import Plan, review_plan
    from .rules import run_rules
    from .spectra import Engine
    from .suggest import suggest
    from .trace import ExampleInputs, trace

    plan_obj = Plan.coerce(plan) if plan is not None else None
    settings = settings or Settings()
    if plan_obj is not None and plan_obj.thresholds:
        settings = settings.with_overrides(plan_obj.thresholds, plan_obj.source)
    if overrides:
        settings = settings.with_overrides(overrides, "the command line")
    settings = validate(settings)
    notes: list[str] = []
    if isinstance(model, WeightsOnly):
        layers_by = model.layers()
        total = model.total_params
        ranked = finalize_shares(layers_by, total)
        loaders: dict[str, Callable[[], torch.Tensor]] = {l.name: model.loader(l) for l in ranked}
        result = Audit(
            model_name=name or model.name, source=model.source, trace_method=Method.WEIGHTS, trace_failures=[],
            inputs=None, total_params=total, layers=ranked, macs_known=False, settings=settings,
            graph=None, environment=environment(),
        )
        notes.append("No graph: weights-only audit; MACs, ties and chained layers cannot be known.")
        notes.extend(model.notes)
    else:
        if not isinstance(model, nn.Module):
            raise AuditError(f"expected a torch.nn.Module, got {type(model).__name__}",
                             "Return an nn.Module (or (module, example_inputs)) from the factory")
        was_training = model.training
        model.eval()  # dropout off while tracing; the caller's mode is restored below
        ex = ExampleInputs.of(example_inputs)
        table = ParamTable.of(model)
        total = table.total
        layers_by = collect_layers(model, table)
        try:
            tr = trace(model, ex, tracer=tracer)
        finally:
            model.train(was_training)
        g = graph_mod.build(tr, model, table, layers_by)
        ranked = finalize_shares(layers_by, total)
        loaders = {l.name: (lambda p=l.param: table.tensor(p)) for l in ranked}
        result = Audit(
            model_name=name or type(model).__name__, source=source, trace_method=tr.method,
            trace_failures=tr.failures, inputs=ex.description if ex else None, total_params=total,
            layers=ranked, macs_known=g.macs_known, settings=settings, unsupported_ops=g.unsupported,
            graph=g.graph, environment=environment(),
        )
        if not g.macs_known:
            notes.append("No example inputs: MACs are left out (pass --input-shape or --input-ids to count them).")
        if any(t.device.type == "meta" for t in table.tensors.values()):
            notes.append("Weights are on the meta device: structure only, no spectra.")
    result.notes = notes

    if spectra:
        engine = Engine(settings.energy_targets, cache_dir=cache_dir, use_cache=cache, workers=jobs,
                        progress=progress)
        result.spectra = engine.run([(l, loaders[l.name]) for l in result.layers])
        result.spectra_stats = dict(vars(engine.stats))
    for layer in result.layers:
        result.suggestions[layer.name] = suggest(layer, result.spectra.get(layer.name), settings)

    result.review = review_plan(result, plan_obj)
    result.findings = run_rules(result, plan_obj)
    return result


def audit_source(spec: str, **kwargs: Any) -> Audit:
    """Load a model from a source string (see :func:`auditor.load.load_source`) and audit it."""
    from .load import load_source

    loaded = load_source(spec, input_shape=kwargs.pop("input_shape", None),
                         input_ids=kwargs.pop("input_ids", None), weights=kwargs.pop("weights", None),
                         structure_only=kwargs.pop("structure_only", False))
    return audit(loaded.model, loaded.example_inputs, name=kwargs.pop("name", None) or loaded.name,
                 source=loaded.source, **kwargs)
