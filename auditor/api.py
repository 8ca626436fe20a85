"""The public entry points: :func:`audit`, :func:`audit_source` and :func:`factorize` (``auditor.audit`` and the
others), and :class:`Audit`, the object they return.

:class:`auditor.results.AuditResult` is the result as plain data, which every stage, rule and reporter takes; this
module's :class:`Audit`, the front object, is the same dataclass with the output methods added (``to_json``, ``to_html``, the notebook
view, ...), each a call into :mod:`auditor.render.report`. The plain result knows no reader; this layer wires them.

Nothing here imports torch at import time (``import auditor`` stays light): the pipeline is imported on first use.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import results
from ._env import scoped
from .errors import AuditError
from .options import AuditOptions, LoadOptions

if TYPE_CHECKING:
    import pandas
    from torch import nn
    from typing_extensions import Unpack

    from .verdict.baseline import BaselineSource
    from .planning.groups import Group
    from .calibration.apply import Fit
    from .options import OptionFields
    from .pipeline import FitCalibration, PlanGiven

__all__ = ["Audit", "AuditOutputs", "audit", "audit_source", "factorize"]


class AuditOutputs:
    """The output methods of :class:`Audit`, each a call into :mod:`auditor.render.report`: the reports as strings,
    files, a DataFrame and the notebook view. A mixin over :class:`auditor.results.AuditResult` (``self`` is the
    result)."""

    def __str__(self) -> str:
        """The terminal table (``print(a)``); ``repr(a)`` stays one line."""
        return self.to_text()

    # ---- output: each is a function of auditor.render.report -------------------------------------------------
    def to_dict(self, with_sigma: bool = False) -> dict[str, Any]:
        """The JSON report as a dict (docs/schema.json); ``with_sigma`` adds every singular value.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), options=auditor.AuditOptions(spectra=False))
        >>> d = a.to_dict()
        >>> d["format_version"], d["totals"]["params"], d["layers"][0]["name"]
        (1, 36, 'Linear')
        """
        from .render import report

        return report.to_dict(self, with_sigma=with_sigma)

    def to_json(self, with_sigma: bool = False, indent: int | None = 2,
                baseline: "BaselineSource | None" = None) -> str:
        """The JSON report; ``baseline`` (an earlier JSON report: path or dict) adds a ``baseline`` block.

        >>> import auditor, json, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), options=auditor.AuditOptions(spectra=False))
        >>> json.loads(a.to_json(baseline=a.to_dict()))["baseline"]["new_findings"]
        []
        """
        from .render import report

        return report.to_json(self, with_sigma=with_sigma, indent=indent, baseline=baseline)

    def to_markdown(self, baseline: "BaselineSource | None" = None) -> str:
        """Markdown for a pull-request comment or a CI summary; ``baseline`` adds "Since the baseline".

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), options=auditor.AuditOptions(spectra=False), name="tiny")
        >>> a.to_markdown().splitlines()[0]
        '## Low-rank audit: tiny'
        """
        from .render import report

        return report.to_markdown(self, baseline)

    def to_text(self, width: int = 120, baseline: "BaselineSource | None" = None) -> str:
        """The terminal table, no line longer than ``width`` (at least 60) characters.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), options=auditor.AuditOptions(spectra=False))
        >>> max(len(line) for line in a.to_text(width=70).splitlines()) <= 70
        True
        """
        from .render import report

        return report.to_text(self, width=width, baseline=baseline)

    def to_html(self, path: str | Path | None = None, baseline: "BaselineSource | None" = None) -> str:
        """One self-contained HTML page (written atomically to ``path`` when given); returns the HTML.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), options=auditor.AuditOptions(spectra=False))
        >>> a.to_html().startswith("<!DOCTYPE html>")
        True
        """
        from .render import report

        return report.to_html(self, path, baseline)

    def to_pdf(self, path: str | Path, baseline: "BaselineSource | None" = None) -> Path:
        """The HTML report printed to PDF with WeasyPrint, written atomically to ``path``; returns the path.

        ``a.to_pdf("audit.pdf")`` needs WeasyPrint and Pango; without them it raises :class:`AuditError` saying
        what to install, and writes nothing. The PDF carries the pages of the largest groups and an appendix
        table of every layer.

        >>> import auditor, torch, tempfile, pathlib
        >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False)
        >>> p = a.to_pdf(pathlib.Path(tempfile.mkdtemp()) / "a.pdf")  # doctest: +SKIP
        >>> p.read_bytes()[:5]  # doctest: +SKIP
        b'%PDF-'
        """
        from .render import report

        return report.to_pdf(self, path, baseline)

    def to_pandas(self) -> "pandas.DataFrame":
        """One row per layer, indexed by the layer's name (the layer table's columns, rank columns named after the
        energy targets); the rank columns, ``suggested`` and ``planned`` are nullable integers (``Int64``: ``<NA>``
        where there is no rank).

        >>> import auditor, torch
        >>> lin = torch.nn.Linear(8, 4)
        >>> _ = torch.nn.init.eye_(lin.weight)  # four equal singular values: E(r) = r / 4
        >>> a = auditor.audit(lin, options=auditor.AuditOptions(cache=False, progress=False,
        ...                                                    overrides={"energy_targets": [0.5, 0.9]}))
        >>> df = a.to_pandas()
        >>> [int(v) for v in df.loc["Linear", ["params", "r50", "r90"]]], str(df["suggested"].dtype)
        ([32, 2, 4], 'Int64')
        """
        from .render import report

        return report.to_pandas(self)

    def _render(self, fmt: str, baseline: "BaselineSource | None" = None) -> str | bytes:
        """One format of :data:`auditor.render.REPORTERS` rendered, nothing written."""
        from .render import report

        return report.render(self, fmt, baseline)

    def _repr_html_(self) -> str:
        """The notebook view: summary, the top layers and the findings, styled inline (no reliance on the
        notebook's CSS).

        >>> import auditor, torch
        >>> "text-align:right" in auditor.audit(torch.nn.Linear(8, 4), spectra=False)._repr_html_()
        True
        """
        from .render import report

        return report.notebook_html(self)


class Audit(AuditOutputs, results.AuditResult):
    """The front object: the result of an audit (:class:`auditor.results.AuditResult`, plain data) with its output
    methods (:class:`AuditOutputs`), its analyses and its verdict.

    ``dataclasses.replace`` keeps the class; :meth:`of` wraps a plain result.

    >>> import auditor, torch
    >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False)
    >>> type(a).__module__, isinstance(a, auditor.results.AuditResult), Audit.of(a.plain()) == a
    ('auditor.api', True, True)
    """

    @classmethod
    def of(cls, result: results.AuditResult) -> "Audit":
        """``result`` with the output methods (itself when it has them already)."""
        if isinstance(result, cls):
            return result
        return cls(**{f.name: getattr(result, f.name) for f in fields(result)})

    def plain(self) -> results.AuditResult:
        """The same result as plain data (:class:`auditor.results.AuditResult`)."""
        return results.AuditResult(**{f.name: getattr(self, f.name) for f in fields(self)})

    # ---- analysis -------------------------------------------------------------------------------------------
    def groups(self) -> "list[Group]":
        """Layers grouped by block: names that differ only in integer components (``h.*.mlp.c_fc`` x 12), largest
        group first; a layer with no siblings is a group of one.

        >>> import auditor, torch
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        >>> g = auditor.audit(m, spectra=False).groups()[0]
        >>> g.label, g.size, g.params
        ('*', 3, 192)
        """
        from .planning.groups import group_layers

        return group_layers(self.layers, self.total_params)

    def emit_plan(self, path: str | Path | None = None) -> str:
        """The suggested plan as an editable TOML file (the same text as ``--emit-plan``), written atomically to
        ``path`` when given; returns the text.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False)
        >>> "[ranks]" in a.emit_plan()
        True
        """
        from .planning.plan import emit_toml

        text = emit_toml(self)
        if path is not None:
            from .render import atomic_write

            with atomic_write(path) as fh:
                fh.write(text)
        return text

    # ---- verdict -------------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """The verdict's word: ``"pass"``, ``"review"``, ``"fail"`` or ``"unmeasured"`` (nothing found, but no
        calibration data measured the plan); the JSON report's ``status``.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False)
        >>> a.status, a.measured, a.exit_code, a.findings
        ('unmeasured', False, 0, [])
        """
        from .verdict.policy import status

        return str(status(self))

    @property
    def measured(self) -> bool:
        """Whether calibration data measured the suggested or reviewed plan (the JSON report's ``measured``)."""
        from .verdict.policy import measured

        return measured(self)

    @property
    def exit_code(self) -> int:
        """The command line's exit code for this audit at its ``fail_on`` setting: 0, or 1 for findings at it."""
        from .verdict.policy import exit_code

        return int(exit_code(self))


@scoped
def audit(model: Any, inputs: Any = None, *, plan: Any = None, options: AuditOptions | None = None,
          **shortcuts: "Unpack[OptionFields]") -> Audit:
    """Audit a model: an ``nn.Module``, or a weights-only checkpoint from :func:`auditor.sources.load_source`.

    ``inputs``: a tensor, a tuple of positional inputs, a dict of keyword inputs, or (args, kwargs); without them
    MACs are not counted. ``plan``: a :class:`auditor.planning.plan.Plan`, a path to a TOML/JSON plan, or a dict; without
    one the suggested ranks are reviewed. ``options``: an :class:`AuditOptions`. Any of its fields may also be
    given as a keyword (``audit(m, x, spectra=False)`` is ``options=AuditOptions(spectra=False)``; a keyword
    replaces that field of ``options``); other keywords raise TypeError. The stages are those of
    :func:`auditor.pipeline.audit`.

    >>> import auditor, torch
    >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(64, 32)), torch.zeros(1, 64), spectra=False)
    >>> a.total_params, a.total_macs, str(a.trace_method)
    (2080, 2048, 'torch.fx.symbolic_trace')
    """
    from . import pipeline

    return Audit.of(pipeline.audit(model, inputs, plan=plan, options=options, **shortcuts))


@scoped
def audit_source(spec: str, *, plan: Any = None, options: AuditOptions | None = None,
                 load: LoadOptions | None = None) -> Audit:
    """Load a model from a source string (see :func:`auditor.sources.load_source`) and audit it; the report's name
    and source come from the loader unless ``options.name`` is set.

    >>> import auditor
    >>> a = auditor.audit_source("sample_models/digits.py:mlp", options=auditor.AuditOptions(spectra=False))
    >>> a.model_name, a.total_params, a.inputs
    ('DigitsMLP', 429834, 'float32[16, 64]')
    """
    from . import pipeline

    return Audit.of(pipeline.audit_source(spec, plan=plan, options=options, load=load))


@scoped
def factorize(model: "nn.Module", plan: "PlanGiven", calibration: "FitCalibration | None" = None, *,
              fit: "Fit | str | None" = None, refit_dense: bool = False, refine: bool = True) -> "nn.Module":
    """A deep copy of ``model`` with each planned layer replaced by two (``model`` is left untouched).

    ``plan``: ``{layer name: rank}``, or anything :func:`audit` accepts as a plan (a TOML/JSON path, a
    :class:`auditor.planning.plan.Plan`, a plan table with ``ranks``), whose patterns and specs (``"0.5be"``,
    ``"energy:0.95"``) are reviewed against the model as the audit reviews them. ``calibration``: None (factors from
    the plain SVD of each weight), an audit's :class:`auditor.calibration.stage.Calibrated` (its session's
    statistics and its gradient pass's loss metric are reused), a ``CalibrationSession`` (its statistics are
    reused), a ``Calibration``, ``InputStatistics``, or any source :func:`auditor.calibration.load_calibration`
    reads (a path, a dict of tensors; its default 25% held out): the factors then come from the calibration part,
    fitted as ``fit`` says. ``fit``: a label below or a :class:`auditor.calibration.apply.Fit`; None (the
    default): the fit ``lowrank-audit factorize`` uses by default and the audit measures its plan with
    (:data:`auditor.calibration.apply.DEFAULT_FIT`, the sequential fit), falling back where the calibration holds no
    rows (``InputStatistics``) to the independent fit (:func:`auditor.calibration.apply.default_fit`); the copy's
    ``lowrank_fit`` attribute names the fit used (``"svd"`` without calibration). ``fit="independent"``: each
    layer whitened alone under the dense model's inputs (SVD-LLM).
    ``fit="loss-aware"``: each layer truncated in the metric the audit's loss gradient puts on its outputs and
    inputs (what the audit measures; one gradient pass, or the one an audit's ``Calibrated`` keeps;
    docs/calibration.md, "Loss-aware truncation"). ``fit="sequential"``: each layer's factors fitted on the inputs
    the factorized layers before it produce, truncated loss-aware where the metric has a gradient (needs calibration
    rows, not statistics; the default; docs/calibration.md, "The sequential fit"). ``refit_dense=True`` (sequential
    fit only): the Linear layers the plan keeps dense are refitted at full rank on the inputs the factorized layers
    give them, anchored to their dense outputs (their weights change, their shapes and the parameter count do not). ``refine=False`` (sequential fit only): the closed-form factors, without
    the block refinement that trains each repeated block's factors together on the block's output
    (docs/calibration.md, "Block refinement"). The review, the refusals and the fit are
    :func:`auditor.pipeline.factorize_plan`'s, which ``lowrank-audit factorize`` runs too.

    >>> import auditor, torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> new = auditor.factorize(m, {"0": 2})
    >>> sum(p.numel() for p in new.parameters()), sum(p.numel() for p in m.parameters())
    (76, 108)
    """
    from . import pipeline

    return pipeline.factorize_plan(model, plan, calibration, fit=fit, refit_dense=refit_dense, refine=refine).model
