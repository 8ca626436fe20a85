"""The audit's data: plain dataclasses with derived numbers as properties. No torch, no networkx, no I/O.

Every stage of :mod:`auditor.pipeline` returns values of these types, the renderers and the rules read only them,
and :class:`AuditResult` is the whole result. Nothing here reads a result: the output methods people call
(``a.to_json()``, ``a.to_html(path)``, the notebook view) belong to :class:`auditor.api.Audit`, the object
:func:`auditor.audit` returns, and each is a function of :mod:`auditor.render.report`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from . import lrmath
from .config import FailOn, Settings, StrEnum

if TYPE_CHECKING:
    from .calresults import CalibrationReport
    from .speedresults import SpeedReport

__all__ = [
    "AuditResult", "FailOn", "Finding", "GraphNode", "Kind", "Layer", "LayerGraph", "PlanItem", "PlanOrigin",
    "PlanReview", "PlanVerdict", "Settings", "Severity", "SeverityCounts", "Spectrum", "SpectrumMethod",
    "StrEnum", "Suggestion", "TraceMethod", "Use", "Verdict",
]


class Kind(StrEnum):
    LINEAR = "linear"
    CONV1D_HF = "hf_conv1d"  # transformers' Conv1D: a linear layer whose weight is stored (in, out)
    CONV = "conv"
    CONV_TRANSPOSE = "conv_transpose"
    EMBEDDING = "embedding"
    RNN = "rnn"  # LSTM / GRU / RNN gate matrices, gates stacked
    MHA_IN_PROJ = "mha_in_proj"
    MATMUL = "matmul"  # a 2-D parameter multiplied in the graph (x @ W) without a module we know
    TENSOR = "tensor"  # weight-only audit: a 2-D tensor found by name, no graph


class Verdict(StrEnum):
    FACTORIZE = "factorize"
    KEEP_DENSE = "keep dense"
    SKIP_NARROW = "skip narrow"
    SKIPPED = "skipped"  # no spectrum: NaN, zero, meta, quantized


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def order(self) -> int:
        """0 for errors, 1 for warnings, 2 for info: the order findings are listed in."""
        return list(Severity).index(self)


class TraceMethod(StrEnum):
    """How the layer graph was obtained (the values are the words the reports print)."""

    SYMBOLIC = "torch.fx.symbolic_trace"
    EXPORT = "torch.export"
    WALK = "module walk"  # forward hooks: module call order, no data flow
    WEIGHTS = "weights only"  # a checkpoint audited with no architecture code

    @property
    def data_flow(self) -> bool:
        """Whether the graph's edges follow the data (an fx or export graph), not just the call order."""
        return self in (TraceMethod.SYMBOLIC, TraceMethod.EXPORT)


class SpectrumMethod(StrEnum):
    GRAM_EIGH = "gram-eigh"  # eigenvalues of the float64 Gram matrix
    SVD_F64 = "svd-f64"  # float64 SVD (the accuracy guard's fall-back)
    CACHE = "cache"  # read from the spectrum cache
    NONE = ""  # skipped: no spectrum


class PlanVerdict(StrEnum):
    FACTORIZE = "factorize"
    NARROW = "factorize (narrow: LR003)"  # saves, but the audit would skip the layer as narrow
    ABOVE_MAX_RANK = "above min(m, n)"
    NO_SAVING = "no saving"


class PlanOrigin(StrEnum):
    """Where a reviewed plan came from: the audit's own suggestions, or a plan the user gave (file or dict)."""

    SUGGESTED = "suggested"
    GIVEN = "given"


@dataclass
class Use:
    """One place in the model that reads the weight: a module (or op) and how often it runs per forward."""

    site: str
    op: str
    calls: int = 1


@dataclass
class Layer:
    """One unique factorizable weight tensor, viewed as ``groups`` matrices of m x n."""

    name: str  # qualified name of the tensor's first owner (module path, or tensor name in a weight-only audit)
    param: str  # qualified name of the tensor
    kind: Kind
    module_type: str
    shape: tuple[int, ...]
    m: int
    n: int
    groups: int = 1
    view: str = ""  # how the stored tensor was reshaped into m x n
    dtype: str = "float32"
    aliases: list[str] = field(default_factory=list)  # other names of the same tensor (tied weights)
    uses: list[Use] = field(default_factory=list)
    macs: int | None = None  # dense MACs per forward for the example inputs; None without inputs
    macs_linear: int = 0  # the part of ``macs`` that multiplies by W
    lookups: int = 0  # embedding rows gathered per forward
    share: float = 0.0  # of the model's unique parameters
    source: str = ""  # file:line of the owning module's class
    defined_at: tuple[str, int] | None = None  # (file, line) where the user's code creates it (SARIF); not in JSON

    @property
    def params(self) -> int:
        return lrmath.params_dense(self.m, self.n, self.groups)

    @property
    def calls(self) -> int:
        return sum(u.calls for u in self.uses)

    @property
    def tied(self) -> bool:
        return bool(self.aliases) or len({u.site for u in self.uses}) > 1

    @property
    def break_even(self) -> float:
        return lrmath.break_even(self.m, self.n)

    @property
    def max_rank(self) -> int:
        return min(self.m, self.n)

    def params_at(self, r: int) -> int:
        return lrmath.params_at_rank(self.m, self.n, r, self.groups)

    def macs_at(self, r: int) -> int | None:
        if self.macs is None:
            return None
        return lrmath.macs_at_rank(self.m, self.n, r, self.macs_linear, self.lookups)

    def compression(self, r: int) -> float:
        return lrmath.compression(self.m, self.n, r)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("defined_at")  # a path on this machine: the JSON report stays the same wherever it is made
        d["kind"] = str(self.kind)
        d["shape"] = list(self.shape)
        d["params"] = self.params
        d["calls"] = self.calls
        d["break_even"] = round(self.break_even, 4)
        return d


@dataclass
class Spectrum:
    """Singular values (float64, descending) of a layer's matrix view; per group for grouped convs."""

    layer: str
    sigma: list[list[float]] | None  # groups x min(m, n); None when skipped
    method: SpectrumMethod = SpectrumMethod.NONE
    skipped: str = ""  # why there is no spectrum
    frob2: float | None = 0.0  # None when ||W||_F^2 overflows float64 (|w| above about 1e154)
    stable_rank: float = 0.0
    effective_rank: float = 0.0
    numerical_rank: int = 0
    energy: list[float] = field(default_factory=list)  # cumulative energy E(r) for r = 1..min(m, n)

    def __post_init__(self) -> None:
        self.method = SpectrumMethod(self.method)  # producers may pass the plain word

    @property
    def computed(self) -> bool:
        """Whether singular values were computed (False: skipped, see ``skipped``)."""
        return self.sigma is not None

    @property
    def values(self) -> list[float] | None:
        """The singular values as one flat list for an ungrouped layer (``sigma`` stays ``groups x k`` as the JSON
        schema has it); for a grouped convolution, every group's values in group order. None when skipped.

        >>> Spectrum("fc", [[3.0, 1.0]]).values, Spectrum("conv", [[2.0], [1.0]]).values
        ([3.0, 1.0], [2.0, 1.0])
        """
        if self.sigma is None:
            return None
        return list(self.sigma[0]) if len(self.sigma) == 1 else [v for g in self.sigma for v in g]

    def energy_at(self, r: int) -> float:
        """E(r): the share of ||W||_F^2 the best rank-r approximation keeps (0 for r <= 0, 1 past the end).

        >>> Spectrum("fc", [[2.0, 1.0]], energy=[0.8, 1.0]).energy_at(1)
        0.8
        """
        if not self.energy or r <= 0:
            return 0.0
        return self.energy[min(r, len(self.energy)) - 1]

    def rank_for(self, target: float) -> int:
        """The smallest rank keeping ``target`` of the energy.

        >>> Spectrum("fc", [[2.0, 1.0]], energy=[0.8, 1.0]).rank_for(0.9)
        2
        """
        return lrmath.energy_rank(self.energy, target)

    def to_dict(self, with_sigma: bool = True) -> dict[str, Any]:
        d = asdict(self)
        d["method"] = str(self.method)
        if not with_sigma:
            d.pop("sigma")
        return d


@dataclass
class Suggestion:
    layer: str
    verdict: Verdict
    rank: int | None
    reason: str
    ranks_for: dict[str, int] = field(default_factory=dict)  # energy target -> rank
    energy_at_rank: float | None = None
    energy_at_break_even: float | None = None
    error_bound: float | None = None
    params_after: int | None = None
    macs_after: int | None = None
    compression: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = str(self.verdict)
        return d


@dataclass
class Finding:
    code: str
    slug: str
    severity: Severity
    message: str
    layers: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""

    def __post_init__(self) -> None:
        self.severity = Severity(self.severity)

    def sort_key(self) -> tuple:
        return (self.severity.order, self.code, tuple(self.layers), self.message)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = str(self.severity)
        return d


@dataclass
class PlanItem:
    layer: str
    rank: int
    spec: str  # what the plan said: "256", "0.5be", "energy:0.95"
    pattern: str
    params_before: int
    params_after: int
    macs_before: int | None
    macs_after: int | None
    break_even: float
    compression: float
    energy_kept: float | None
    error_bound: float | None
    verdict: PlanVerdict

    def __post_init__(self) -> None:
        self.verdict = PlanVerdict(self.verdict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = str(self.verdict)
        return d


@dataclass
class PlanReview:
    origin: PlanOrigin
    source: str  # the plan file's path ("plan" for a dict), or "suggested"
    items: list[PlanItem]
    finetune: str | None
    params_before: int
    params_after: int
    macs_before: int | None
    macs_after: int | None
    total_params: int

    @property
    def suggested(self) -> bool:
        return self.origin is PlanOrigin.SUGGESTED

    @property
    def params_saved(self) -> int:
        return self.params_before - self.params_after

    @property
    def share_saved(self) -> float:
        return self.params_saved / self.total_params if self.total_params else 0.0

    @property
    def model_params_after(self) -> int:
        return self.total_params - self.params_saved

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "finetune": self.finetune,
            "params_before": self.params_before,
            "params_after": self.params_after,
            "params_saved": self.params_saved,
            "share_saved": self.share_saved,
            "macs_before": self.macs_before,
            "macs_after": self.macs_after,
            "model_params_after": self.model_params_after,
            "items": [i.to_dict() for i in self.items],
        }



@dataclass(frozen=True)
class SeverityCounts:
    """How many findings of each severity: ``counts.error``, ``counts.warning``, ``counts.info``."""

    error: int = 0
    warning: int = 0
    info: int = 0

    @classmethod
    def of(cls, findings: list[Finding]) -> "SeverityCounts":
        sev = [f.severity for f in findings]
        return cls(sev.count(Severity.ERROR), sev.count(Severity.WARNING), sev.count(Severity.INFO))

    def at_least(self, level: Severity) -> int:
        """Findings at ``level`` or more severe."""
        return self.error + (self.warning if level is not Severity.ERROR else 0) + (
            self.info if level is Severity.INFO else 0)


@dataclass(frozen=True)
class GraphNode:
    """A node of the layer graph: a module, an op, an input or the output.

    ``role``: "weight" (reads a factorizable weight), "nonlinear", "op", "module" or "io"; ``calls``: how often it
    runs per forward (a shared module called three times is one node with calls=3)."""

    name: str
    kind: str
    role: str
    calls: int = 1


@dataclass(frozen=True)
class LayerGraph:
    """The layer graph as plain data.

    ``data_flow`` is True only for fx/export graphs, whose edges follow the tensors; a module walk's edges follow
    call order, and a weights-only audit has no graph at all. ``chains``: pairs (a, b) of linear weight sites where
    a feeds only b and b reads only a (one linear map of low rank); computed by the graph stage, and empty when
    ``data_flow`` is False, because call order cannot tell a chain from a residual branch.

    >>> g = LayerGraph([GraphNode("x", "input", "io"), GraphNode("fc", "Linear", "weight")], [("x", "fc")], True, [])
    >>> g.node("fc").role, g.successors("x")
    ('weight', ['fc'])
    """

    nodes: list[GraphNode]
    edges: list[tuple[str, str]]
    data_flow: bool
    chains: list[tuple[str, str]] = field(default_factory=list)

    @cached_property
    def _index(self) -> dict[str, GraphNode]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> GraphNode:
        return self._index[name]

    def successors(self, name: str) -> list[str]:
        return [b for a, b in self.edges if a == name]

    def predecessors(self, name: str) -> list[str]:
        return [a for a, b in self.edges if b == name]


class LayerTotals:
    """What an audit's layers add up to: the factorizable and other parameters, the dense MACs, the running shares
    of the largest layers, and the spectra's rank summaries. A mixin of :class:`AuditResult` (these are its
    fields)."""

    layers: list[Layer]
    total_params: int
    macs_known: bool
    spectra: dict[str, Spectrum]

    @property
    def factorizable_params(self) -> int:
        """Parameters in the factorizable weights (biases and norms are the rest).

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Linear(8, 4), spectra=False)
        >>> a.factorizable_params, a.rest_params, round(a.rest_share, 3)
        (32, 4, 0.111)
        """
        return sum(layer.params for layer in self.layers)

    @property
    def rest_params(self) -> int:
        """Parameters outside the factorizable weights (see :attr:`factorizable_params`)."""
        return self.total_params - self.factorizable_params

    @property
    def rest_share(self) -> float:
        """:attr:`rest_params` as a share of all unique parameters."""
        return self.rest_params / self.total_params if self.total_params else 0.0

    @property
    def total_macs(self) -> int | None:
        """Dense MACs per forward of the weight ops for the example inputs; None without inputs.

        >>> import auditor, torch
        >>> auditor.audit(torch.nn.Linear(8, 4), torch.zeros(2, 8), spectra=False).total_macs
        64
        """
        if not self.macs_known:
            return None
        return sum(layer.macs or 0 for layer in self.layers)

    def cumulative(self) -> list[float]:
        """The running share of the model's parameters, largest layer first.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False)), spectra=False)
        >>> a.cumulative()
        [0.6666666666666666, 1.0]
        """
        acc, out = 0.0, []
        for layer in self.layers:
            acc += layer.share
            out.append(acc)
        return out

    def layers_holding(self, fraction: float) -> int:
        """How many of the largest layers hold ``fraction`` of all parameters (0 if they never do).

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False)), spectra=False)
        >>> a.layers_holding(0.5), a.layers_holding(0.9)
        (1, 2)
        """
        for i, c in enumerate(self.cumulative(), start=1):
            if c + 1e-12 >= fraction:
                return i
        return 0

    @property
    def stable_ranks(self) -> dict[str, float]:
        """Stable rank ||W||_F^2 / sigma_1^2 per layer with a spectrum.

        >>> import auditor, torch
        >>> lin = torch.nn.Linear(8, 4)
        >>> _ = torch.nn.init.eye_(lin.weight)
        >>> auditor.audit(lin, cache=False, progress=False).stable_ranks
        {'Linear': 4.0}
        """
        return {k: s.stable_rank for k, s in self.spectra.items() if s.sigma is not None}

    @property
    def effective_ranks(self) -> dict[str, float]:
        """Effective rank exp(entropy of sigma / sum sigma) per layer with a spectrum (4 equal values: 4.0)."""
        return {k: s.effective_rank for k, s in self.spectra.items() if s.sigma is not None}


@dataclass(frozen=True)
class TieGroup:
    """Layers whose ranks must be equal (``--tie``): one block's members of one tie, so that a fused kernel can run
    them as one (q/k/v of one attention: [A_q; A_k; A_v] stacked over the shared input). ``label`` names the tie by
    its patterns ("q_proj/k_proj/v_proj"), ``block`` is the members' common parent."""

    label: str
    block: str
    members: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"tie": self.label, "block": self.block, "members": list(self.members)}


@dataclass(frozen=True)
class AuditResult(LayerTotals):
    """The result of an audit as plain data, complete when :func:`auditor.pipeline.audit` returns it
    (:func:`auditor.audit` returns it as :class:`auditor.api.Audit`, with the output methods); its totals are
    :class:`LayerTotals`.

    >>> import auditor, torch
    >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(64, 32)), torch.zeros(1, 64),
    ...                   options=auditor.AuditOptions(cache=False, progress=False))
    >>> a.total_params, a.layer("0").break_even, a.total_macs
    (2080, 21.333333333333332, 2048)
    """

    model_name: str
    source: str
    trace_method: TraceMethod
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
    graph: LayerGraph | None = None  # None in a weights-only audit
    environment: dict[str, str] = field(default_factory=dict)
    spectra_stats: dict[str, int] = field(default_factory=dict)
    trace_log: str = field(default="", repr=False, compare=False)  # torch's logging while tracing (--verbose)
    calibration: "CalibrationReport | None" = None  # measured rank floors (auditor.calresults); None without data
    speed: "SpeedReport | None" = None  # measured latency and memory (auditor.speed); None unless asked
    ties: tuple[TieGroup, ...] = ()  # --tie: the groups whose ranks must be equal (auditor/planning/ties.py)

    # ---- lookups and derived numbers -------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, Layer]:
        index: dict[str, Layer] = {}
        for layer in self.layers:
            index.setdefault(layer.param, layer)
        for layer in self.layers:  # a layer's own name wins over another's tensor name
            index[layer.name] = layer
        return index

    def layer(self, name: str) -> Layer:
        """The layer with this name (or tensor name), in O(1); KeyError when there is none.

        >>> import auditor, torch
        >>> a = auditor.audit(torch.nn.Sequential(torch.nn.Linear(8, 4)), spectra=False)
        >>> a.layer("0").m, a.layer("0.weight").n
        (4, 8)
        """
        return self._by_name[name]

    @property
    def counts(self) -> SeverityCounts:
        """Findings by severity.

        >>> import auditor, torch
        >>> auditor.audit(torch.nn.Linear(8, 4), spectra=False).counts.error
        0
        """
        return SeverityCounts.of(self.findings)

    @property
    def trace_summary(self) -> str:
        """How the layer graph was obtained, in one sentence.

        >>> import auditor, torch
        >>> auditor.audit(torch.nn.Linear(8, 4), torch.zeros(1, 8), spectra=False).trace_summary
        'Traced with torch.fx.symbolic_trace.'
        """
        if self.trace_method is TraceMethod.WEIGHTS:
            text = "No graph: layers inferred from tensor names and shapes (weights-only audit)"
        else:
            text = f"Traced with {self.trace_method}"
            if self.trace_method is TraceMethod.WALK:
                text += ": no data-flow graph, edges follow module call order"
        if self.trace_failures:
            text += " (" + "; ".join(self.trace_failures) + ")"
        return text + "."

    def __repr__(self) -> str:
        return (f"<Audit {self.model_name}: {self.total_params:,} params, {len(self.layers)} factorizable layers, "
                f"{len(self.findings)} findings>")


def __getattr__(name: str) -> Any:
    """``results.Audit``, the old name of :class:`AuditResult`, for code written before the rename (issue 30:
    ``Audit`` is now only the front object, :class:`auditor.api.Audit`); new code names ``AuditResult``."""
    if name == "Audit":
        import warnings

        warnings.warn("auditor.results.Audit is now auditor.results.AuditResult", DeprecationWarning, stacklevel=2)
        return AuditResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
