"""The audit's data: plain dataclasses, serializable, with derived numbers as properties. Renderers see only these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from . import lrmath


class StrEnum(str, Enum):
    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


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
        return {"error": 0, "warning": 1, "info": 2}[self.value]


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
    method: str = ""  # "gram-eigh" | "svd-f64" | "cache"
    skipped: str = ""  # why there is no spectrum
    frob2: float = 0.0
    stable_rank: float = 0.0
    effective_rank: float = 0.0
    numerical_rank: int = 0
    energy: list[float] = field(default_factory=list)  # cumulative energy E(r) for r = 1..min(m, n)

    def energy_at(self, r: int) -> float:
        if not self.energy or r <= 0:
            return 0.0
        return self.energy[min(r, len(self.energy)) - 1]

    def rank_for(self, target: float) -> int:
        return lrmath.energy_rank(self.energy, target)

    def to_dict(self, with_sigma: bool = True) -> dict[str, Any]:
        d = asdict(self)
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
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlanReview:
    source: str  # file path, or "suggested"
    items: list[PlanItem]
    finetune: str | None
    params_before: int
    params_after: int
    macs_before: int | None
    macs_after: int | None
    total_params: int

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

