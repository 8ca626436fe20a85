"""What an audit is asked to do: one frozen :class:`AuditOptions`, shared by the API and the command line, and
:class:`LoadOptions` for reading a model from a source string. No torch here."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypedDict, Union

from .config import Settings, StrEnum
from .errors import AuditError

if TYPE_CHECKING:
    from distributed import Client


CALIBRATION_MAX_ROWS = 100_000  # calibration rows (examples, windows) read at most unless raised
CALIBRATION_MAX_BYTES = 1 << 30  # calibration bytes (a file's size, the tensors a function yields) read at most


class Tracer(StrEnum):
    """How to trace the model: ``auto`` tries symbolic_trace, then torch.export, then the module walk."""

    AUTO = "auto"
    SYMBOLIC = "symbolic"
    EXPORT = "export"
    WALK = "walk"


class SpectraBackend(StrEnum):
    """What computes the singular values (auditor/spectra/backend.py): ``lapack`` (CPU float64 Gram + dsyevd, the
    default), ``torch-cpu`` or ``torch-cuda`` (the same path with torch's linear algebra on that device). Each keeps
    its own cache entries."""

    LAPACK = "lapack"
    TORCH_CPU = "torch-cpu"
    TORCH_CUDA = "torch-cuda"


CalibrationInput = Union[str, "os.PathLike[str]", Mapping[str, Any], Iterable[Any]]
"""Calibration data: a file, ``file.py:fn`` / ``module:fn``, a dict of tensors, batches (an iterable), or a
``Calibration`` (auditor.calibration.data.inputs; not imported here: options sit below calibration)."""
MetricSpec = Union[str, Callable[..., float]]
"""A metric: a built-in name (perplexity, kl, ...), ``file.py:fn`` / ``module:fn``, or fn(model, batches) -> float."""


@dataclass(frozen=True)
class CalibrationData:
    """The calibration data (docs/calibration.md) and how much of it is read."""

    source: CalibrationInput | None = None  # None: no calibration (tiers 1-3 off)
    holdout: "float | str | os.PathLike[str]" = 0.25  # share of the rows held out to measure, or a second source
    length: int | None = None  # tokens per window of a text file (default: the positions, at most 512)
    tokenizer: "str | os.PathLike[str] | None" = None  # the tokenizer's directory for a text file
    max_rows: int | None = CALIBRATION_MAX_ROWS  # read at most this many rows (None: no cap)
    max_bytes: int | None = CALIBRATION_MAX_BYTES  # read at most this many bytes (None: no cap)
    separator: str | None = None  # a text file's document separator: each piece one document (documents.py)

    def check_limits(self) -> None:
        """The caps on rows and bytes, each a positive whole number or None."""
        for name, v in (("calibration_max_rows", self.max_rows), ("calibration_max_bytes", self.max_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                flag = "--" + name.replace("_", "-")
                raise AuditError(f"{name} {v!r} is not a positive whole number",
                                 f"Give e.g. {flag} {'200000' if 'rows' in name else '4G'}, or None for no cap")

    def check_length(self) -> None:
        """The text window's length, a positive whole number or None."""
        length = self.length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise AuditError(f"calibration_length {length!r} is not a positive whole number",
                             "Give e.g. calibration_length=128 (on the command line --calibration-length 128)")


TIE_AUTO = ("auto",)  # --tie auto: the tie groups of the families the tool knows (auditor/planning/ties.py)


def tie_specs(value: Any) -> tuple[tuple[str, ...], ...]:
    """``--tie`` / ``ties=`` as tie groups: a group is "q_proj,k_proj,v_proj" or a sequence of patterns; "auto"
    (:data:`TIE_AUTO`) offers the defaults. A group of one, an empty pattern or a pattern twice in a group is one
    AuditError line.

    >>> tie_specs("q_proj,k_proj,v_proj"), tie_specs(["auto", ("gate_proj", "up_proj")])
    ((('q_proj', 'k_proj', 'v_proj'),), (('auto',), ('gate_proj', 'up_proj')))
    >>> tie_specs("q_proj")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    auditor.errors.AuditError: --tie q_proj is a group of one: a tie makes two or more layers share one rank. ...
    """
    if value is None or value == ():
        return ()
    items = [value] if isinstance(value, str) else list(value)  # a string is one group; else each item one
    out: list[tuple[str, ...]] = []
    for item in items:
        parts = tuple(p.strip() for p in item.split(",")) if isinstance(item, str) else tuple(map(str, item))
        text = ",".join(parts)
        if parts == TIE_AUTO:
            out.append(TIE_AUTO)
            continue
        if any(not p for p in parts):
            raise AuditError(f"--tie {text} holds an empty layer pattern",
                             "Separate patterns with single commas, e.g. --tie q_proj,k_proj,v_proj")
        if "auto" in parts:
            raise AuditError(f"--tie {text} mixes auto with layer patterns",
                             "Give --tie auto alone, and other groups as separate --tie flags")
        if len(parts) < 2:
            raise AuditError(f"--tie {text} is a group of one: a tie makes two or more layers share one rank",
                             "Name every member, e.g. --tie q_proj,k_proj,v_proj (or --tie auto for the known "
                             "defaults)")
        twice = sorted({p for p in parts if parts.count(p) > 1})
        if twice:
            raise AuditError(f"--tie {text} names {', '.join(twice)} twice", "Name each member once")
        if parts not in out:
            out.append(parts)
    return tuple(out)


@dataclass(frozen=True)
class TierOptions:
    """What a calibrated audit measures: the metric and its tolerance, tiers 2 and 3, the verification split, and
    rank or bits under a byte budget."""

    metric: MetricSpec | None = None  # None: the model's default (perplexity for a causal LM, else output error)
    tolerance: float | None = None  # in the metric's units (default 0.01 relative output error)
    measure_floor: bool = False  # tier 2: each layer truncated alone, floor found by bisection
    budget: float | None = None  # tier 3: a fraction of the parameters to remove, checked all at once
    probe_sensitivity: bool = True  # tier 3 without tier 2: each layer's model-level sensitivity (False: tier-1 costs)
    probe: bool = False  # that sensitivity from truncation probes (each layer measured alone at two ranks), not gradients
    confidence: float = 0.9  # the verification interval's level (bootstrap over held-out rows the search never read)
    split: bool = True  # held-out rows cut into search and verification parts (False: every row for both, no interval)
    ties: tuple[tuple[str, ...], ...] = ()  # --tie: groups of layer patterns whose ranks must be equal within each
    #                                         block (("q_proj", "k_proj", "v_proj"), ...); TIE_AUTO: the known defaults
    budget_bytes: int | None = None  # rank or bits: the model's parameters in at most this many bytes
    bits_per_weight: float | None = None  # rank or bits: this many bits per weight of the layers it can rewrite
    write_bits: str | None = None  # rank or bits: write the plan that measured least harm at the budget here

    def check(self) -> None:
        """The confidence level, the budget and the tolerance, each checked before any work."""
        confidence, budget, tolerance = self.confidence, self.budget, self.tolerance
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise AuditError(f"confidence {confidence!r} is not a level in (0, 1)", "Give e.g. confidence=0.9")
        if budget is not None and not 0 < budget < 1:
            raise AuditError(f"budget {budget} is not a fraction in (0, 1)", "Give e.g. budget=0.3")
        self._check_bytes()
        if tolerance is not None:
            if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
                raise AuditError(f"tolerance {tolerance!r} is not a number", "Give e.g. tolerance=0.01")
            if not math.isfinite(tolerance):
                raise AuditError(f"tolerance {tolerance} is not a finite number",
                                 "Give a finite tolerance of 0 or more, e.g. --tolerance 0.01")
            if tolerance < 0:
                raise AuditError(f"tolerance {tolerance} is negative", "Give a tolerance of 0 or more")

    @property
    def bytes_planned(self) -> bool:
        """A byte plan was asked for (--budget-bytes or --bits-per-weight)."""
        return self.budget_bytes is not None or self.bits_per_weight is not None

    def _check_bytes(self) -> None:
        """--budget-bytes a positive integer, --bits-per-weight a number in (0, 32], not both; --write-bits with one
        of them, a new or empty folder that can be made."""
        b, bpw = self.budget_bytes, self.bits_per_weight
        if b is not None and bpw is not None:
            raise AuditError("--budget-bytes and --bits-per-weight both set the byte budget",
                             "Give one of them")
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise AuditError(f"budget_bytes {b!r} is not a positive number of bytes", "Give e.g. --budget-bytes 800MB")
        if bpw is not None and (isinstance(bpw, bool) or not isinstance(bpw, (int, float)) or not math.isfinite(bpw)
                                or not 0 < bpw <= 32):
            raise AuditError(f"bits_per_weight {bpw!r} is not a number of bits in (0, 32]",
                             "Give e.g. --bits-per-weight 4.5")
        if self.write_bits is not None and b is None and bpw is None:
            raise AuditError("--write-bits writes the byte plan, and none was asked for",
                             "Pass --budget-bytes SIZE or --bits-per-weight X as well")
        if self.write_bits is not None:
            self._check_folder(str(self.write_bits))

    @staticmethod
    def _check_folder(out: str) -> None:
        """--write-bits: a new or empty folder that can be made (checked before the audit runs)."""
        if not out.strip():
            raise AuditError("--write-bits is empty", "Give a new folder, e.g. --write-bits q4/")
        if os.path.lexists(out) and (not os.path.isdir(out) or os.path.islink(out) or os.listdir(out)):
            raise AuditError(f"--write-bits {out} exists and is not an empty folder", "Give a new folder")
        parent = os.path.dirname(os.path.abspath(out))
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise AuditError(f"--write-bits {out} cannot be made: {parent} is not a folder you can write to",
                             "Give a new folder under one you can write to")


@dataclass(frozen=True)
class StatisticsOptions:
    """Where and in which dtype calibration statistics are read (``device`` is also where speed is measured)."""

    device: str | None = None  # cpu, cuda, cuda:N or auto (None: where the model is)
    offload: bool = False  # each repeated block on the device only while it runs
    compute_dtype: str | None = None  # "float32" runs bf16/fp16 weights upcast, a block at a time

    def check(self) -> None:
        """The device: cpu, cuda, cuda:N or auto."""
        if self.device is not None:
            import re

            device = self.device
            if not isinstance(device, str) or not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device.strip().lower()):
                raise AuditError(f"unknown device {device!r}", "Give device='cpu', 'cuda', 'cuda:N' or 'auto'")


TRAINABLE = ("factors", "all")  # what a recovery trains: the factor weights, or every parameter
OBJECTIVES = ("auto", "kl", "mse")  # what it distils: KL for logits else MSE, or either
DEFAULT_LR = 1e-4  # its AdamW learning rate


def positive_int(v: object, what: str, fix: str) -> None:
    """One line, ``fix`` the hint, unless ``v`` is an int of at least 1 (a bool is not)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise AuditError(f"{what} {v!r} is not a positive integer", fix)


def positive_finite(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@dataclass(frozen=True)
class RecoveryOptions:
    """Tier 3 after a recovery fine-tune (docs/calibration.md): each frontier plan measured again after it. The one
    recovery settings type: ``lowrank-audit factorize --recover`` and :func:`auditor.recover.recover` take its
    subclass :class:`auditor.calibration.recovery.RecoverySettings` (when to measure, the warm-up, the clip), and
    :meth:`check` is the one validation of these fields."""

    steps: int | None = None  # recovery steps per frontier plan (needs calibration and budget); None: no recovery
    lr: float = DEFAULT_LR  # AdamW learning rate
    trainable: str = "factors"  # "factors" (the factor weights) | "all" (every parameter)
    objective: str = "auto"  # "auto" (KL for logits, else MSE) | "kl" | "mse"
    seed: int = 0
    choose_after: bool = False  # the suggestion: the largest plan that holds after the recovery

    def check(self) -> None:
        """Refuse a bad value with one line (the first found), before any model is looked at."""
        positive_int(self.steps, "recovery steps", "Give --recover a positive number of steps, e.g. --recover 200")
        if not positive_finite(self.lr):
            raise AuditError(f"recovery learning rate {self.lr!r} is not a positive finite number",
                             f"Give e.g. --recover-lr {DEFAULT_LR:g}")
        if self.trainable not in TRAINABLE:
            raise AuditError(f"recovery trainable {self.trainable!r} is neither 'factors' nor 'all'",
                             "Give --recover-trainable factors (the factor weights only) or all")
        if self.objective not in OBJECTIVES:
            raise AuditError(f"recovery objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}",
                             "Give auto, kl (output distributions) or mse (output values)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise AuditError(f"recovery seed {self.seed!r} is not an integer", "Give an integer seed")


@dataclass(frozen=True)
class ClusterOptions:
    """A Dask cluster for the spectra and the tier-2 sweeps (docs/cluster.md)."""

    scheduler: "str | Client | None" = None  # a scheduler address or a distributed.Client
    path_map: tuple[tuple[str, str], ...] = ()  # (client prefix, worker prefix) for the cluster's file paths
    origin: "tuple[str, LoadOptions] | None" = None  # set by audit_source: sweep workers load the model from it


@dataclass(frozen=True)
class SpeedOptions:
    """Speed (docs/performance.md): the plan's layers and model timed on the statistics' ``device`` (default: CPU)."""

    measure: bool = False  # time the reviewed plan's layers, their time break-even ranks, the whole model
    latency_shape: tuple[int, ...] | None = None  # also time the layers at this batch (x positions)
    budget_latency: float | None = None  # a share of the dense latency to remove: the plan chosen by time
    clock: Callable[[], float] | None = None  # seconds, called around each timed block (tests: a fake clock)

    def checked(self) -> "SpeedOptions":
        """--latency-shape and --budget-latency checked, each before any work; either asks for the measurement
        (the group returned with ``measure`` set and the shape a tuple)."""
        out = self
        if self.latency_shape is not None:
            shape = tuple(self.latency_shape)
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
                raise AuditError(f"latency shape {self.latency_shape!r} is not positive whole numbers",
                                 "Give the batch (and positions), e.g. --latency-shape 64,128")
            out = replace(out, latency_shape=shape)
        b = self.budget_latency
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1:
                raise AuditError(f"latency budget {b!r} is not a fraction in (0, 1)",
                                 "Give the share of the dense latency to remove, e.g. --budget-latency 0.2")
        if self.latency_shape is not None or b is not None:
            out = replace(out, measure=True)
        return out


# The flat names of the option groups' fields (the keywords AuditOptions and auditor.audit took before the groups,
# still accepted, and readable as attributes): flat name -> (group, field)
FLAT: dict[str, tuple[str, str]] = {
    **{name: ("calibration_data", f) for name, f in [
        ("calibration", "source"), ("holdout", "holdout"), ("calibration_length", "length"), ("tokenizer", "tokenizer"),
        ("calibration_max_rows", "max_rows"), ("calibration_max_bytes", "max_bytes"),
        ("document_separator", "separator")]},
    **{name: ("tiers", name) for name in ("metric", "tolerance", "measure_floor", "budget", "probe_sensitivity",
                                          "probe", "confidence", "split", "ties", "budget_bytes",
                                          "bits_per_weight", "write_bits")},
    **{name: ("statistics", name) for name in ("device", "offload", "compute_dtype")},
    **{f"recover_{f}": ("recovery", f) for f in ("steps", "lr", "trainable", "objective", "seed")},
    "choose_after_recovery": ("recovery", "choose_after"),
    **{name: ("cluster", name) for name in ("scheduler", "path_map", "origin")},
    "measure_speed": ("speed", "measure"), "latency_shape": ("speed", "latency_shape"),
    "budget_latency": ("speed", "budget_latency"), "speed_clock": ("speed", "clock"),
}


@dataclass(frozen=True, init=False)
class AuditOptions:
    """Everything an audit is asked to do besides the model, its inputs and the plan: a few top-level fields and
    typed groups (``calibration_data``, ``tiers``, ``statistics``, ``recovery``, ``cluster``, ``speed``), which the
    code reads. Every group field may also be given by its flat name (:data:`FLAT`: ``holdout``, ``recover_steps``,
    ...), the keywords ``auditor.audit`` documents; a flat keyword replaces that field of the group given with it.
    Reading a flat name (``options.holdout``) still works but is deprecated (one :class:`DeprecationWarning` path,
    :func:`_flat`): read the group's field (``options.calibration_data.holdout``).

    Settings resolve in one order: ``settings`` (defaults, or what the caller read from pyproject.toml), then the
    plan's ``[thresholds]``, then ``overrides`` (the command line's threshold flags, or a caller's dict).

    >>> o = AuditOptions(spectra=False, jobs=2, holdout=0.5, calibration="c.safetensors")
    >>> o.tracer, o.calibration_data.holdout, o.calibration_data.source, o.tiers.budget
    (<Tracer.AUTO: 'auto'>, 0.5, 'c.safetensors', None)
    >>> AuditOptions(recovery=RecoveryOptions(steps=5), calibration="c", budget=0.5).recovery.steps
    5
    >>> AuditOptions(tracer="fast")
    Traceback (most recent call last):
    ...
    auditor.errors.AuditError: unknown tracer 'fast'. Choose from auto, symbolic, export, walk.
    """

    settings: Settings = field(default_factory=Settings)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # setting name -> value, applied last
    overrides_origin: str = "the command line"  # named in the error when an override is bad
    plan_may_relax: bool = False  # may the plan's [thresholds] ignore rules or lower fail_on (pyproject allows it)
    name: str | None = None  # the model's name in reports (default: the class name or the file's stem)
    source: str = "python object"  # where the model came from, as the reports print it
    spectra: bool = True  # compute singular values (False: structure and counts only)
    cache: bool = True  # read and write the spectrum cache
    cache_dir: Path | None = None  # default: $LOWRANK_AUDITOR_CACHE or ~/.cache/lowrank-auditor
    jobs: int | None = None  # layers whose spectra are computed side by side (default: the cores, at most 4)
    tracer: Tracer = Tracer.AUTO
    spectra_backend: SpectraBackend = SpectraBackend.LAPACK  # what computes the singular values
    progress: bool | str | None = None  # a progress bar on stderr (default: when stderr is a terminal; "auto": also
    # one plain line per calibration phase when it is not, as the command line does)
    calibration_data: CalibrationData = field(default_factory=CalibrationData)
    tiers: TierOptions = field(default_factory=TierOptions)
    statistics: StatisticsOptions = field(default_factory=StatisticsOptions)
    recovery: RecoveryOptions = field(default_factory=RecoveryOptions)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    speed: SpeedOptions = field(default_factory=SpeedOptions)

    def __init__(self, **given: Any) -> None:
        own = {f.name: f for f in fields(AuditOptions)}
        unknown = sorted(set(given) - set(own) - set(FLAT))
        if unknown:
            raise TypeError(f"unknown audit option(s) {', '.join(unknown)}; AuditOptions has "
                            f"{', '.join(sorted([*own, *FLAT]))}")
        for name, f in own.items():
            value = given[name] if name in given else f.default if f.default is not MISSING else f.default_factory()
            object.__setattr__(self, name, value)
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            if name in FLAT:
                group, attr = FLAT[name]
                grouped.setdefault(group, {})[attr] = value
        for group, changes in grouped.items():
            self._update(group, **changes)
        self.__post_init__()

    def _update(self, group: str, **changes: Any) -> None:
        """Replace some fields of one group (while the options are being made)."""
        object.__setattr__(self, group, replace(getattr(self, group), **changes))

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "tracer", Tracer(self.tracer))
        except ValueError:
            raise AuditError(f"unknown tracer {self.tracer!r}",
                             f"Choose from {', '.join(t.value for t in Tracer)}") from None
        try:
            object.__setattr__(self, "spectra_backend", SpectraBackend(self.spectra_backend))
        except ValueError:
            raise AuditError(f"unknown spectra backend {self.spectra_backend!r}",
                             f"Choose from {', '.join(b.value for b in SpectraBackend)}") from None
        if self.jobs is not None and self.jobs < 1:
            raise AuditError(f"jobs={self.jobs}: at least one layer must run", "Use jobs=1 or more, or None")
        if self.statistics.compute_dtype is not None:
            self._update("statistics", compute_dtype=compute_dtype_name(self.statistics.compute_dtype))
        if self.cache_dir is not None and not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.settings is None:
            object.__setattr__(self, "settings", Settings())
        self._update("tiers", ties=tie_specs(self.tiers.ties))
        self.tiers.check()
        self.calibration_data.check_limits()
        self.statistics.check()
        tiers = self.tiers
        if self.calibration_data.source is None and (tiers.measure_floor or tiers.budget is not None
                                                     or tiers.metric is not None):
            raise AuditError("measure_floor, budget and metric need calibration data",
                             "Pass calibration=FILE (on the command line --calibration FILE)")
        self._check_recovery()
        object.__setattr__(self, "speed", self.speed.checked())
        self.calibration_data.check_length()

    def _check_recovery(self) -> None:
        """The recovery settings (those of ``lowrank-audit factorize --recover``), checked before any work."""
        if self.recovery.steps is None:
            if self.recovery.choose_after:
                raise AuditError("choose_after_recovery needs recover_steps: the recovered curve is measured by it",
                                 "Add --recover STEPS (recover_steps=200, say)")
            return
        positive_int(self.recovery.steps, "recovery steps",
                     "Give --recover a positive number of steps, e.g. --recover 200")
        if self.calibration_data.source is None or self.tiers.budget is None:
            raise AuditError("recover_steps needs calibration data and a budget: it measures the frontier of the "
                             "budgeted plan search again after a recovery fine-tune",
                             "Pass --calibration FILE and --budget FRACTION (e.g. --budget 0.5) as well")
        self.recovery.check()

    def with_(self, **changes: Any) -> "AuditOptions":
        """A copy with some fields changed (top-level, group or flat names); unknown names raise TypeError naming
        the known ones."""
        return AuditOptions(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def _flat(name: str) -> property:
    """The deprecated read of a group field by its flat name: the value, with a :class:`DeprecationWarning` naming
    the group field to read instead (the one deprecation path of the flat names)."""
    group, attr = FLAT[name]

    def get(self: AuditOptions) -> Any:
        warnings.warn(f"AuditOptions.{name} is deprecated; read AuditOptions.{group}.{attr}", DeprecationWarning,
                      stacklevel=2)
        return getattr(getattr(self, group), attr)

    get.__name__ = name
    return property(get, doc=f"``{group}.{attr}`` by its flat name (deprecated: read the group's field)")


for _name in FLAT:
    setattr(AuditOptions, _name, _flat(_name))


class OptionFields(TypedDict, total=False):
    """The fields of :class:`AuditOptions` and the flat names of its groups' fields (:data:`FLAT`), as keyword
    shortcuts of :func:`auditor.audit`, for type checkers (a TypedDict cannot be derived from the dataclasses where
    a checker reads it). The dataclasses are the source: :meth:`AuditOptions.__init__` checks the keywords against
    their fields at run time, and tests/test_options.py holds these names and types equal to theirs (wider only
    where ``__post_init__`` converts what it is given: ``tracer``, ``spectra_backend``, ``ties``)."""

    settings: Settings
    overrides: Mapping[str, Any]
    overrides_origin: str
    plan_may_relax: bool
    name: str | None
    source: str
    spectra: bool
    cache: bool
    cache_dir: Path | None
    jobs: int | None
    tracer: Tracer | str
    spectra_backend: SpectraBackend | str
    progress: bool | str | None
    calibration_data: CalibrationData
    tiers: TierOptions
    statistics: StatisticsOptions
    recovery: RecoveryOptions
    cluster: ClusterOptions
    speed: SpeedOptions
    scheduler: "str | Client | None"
    path_map: tuple[tuple[str, str], ...]
    origin: "tuple[str, LoadOptions] | None"
    calibration: CalibrationInput | None
    holdout: "float | str | os.PathLike[str]"
    metric: MetricSpec | None
    tolerance: float | None
    measure_floor: bool
    budget: float | None
    budget_bytes: int | None
    bits_per_weight: float | None
    write_bits: str | None
    probe_sensitivity: bool
    probe: bool
    confidence: float
    split: bool
    ties: "str | Iterable[str | Iterable[str]]"
    calibration_length: int | None
    tokenizer: "str | os.PathLike[str] | None"
    calibration_max_rows: int | None
    calibration_max_bytes: int | None
    document_separator: str | None
    device: str | None
    offload: bool
    compute_dtype: str | None
    recover_steps: int | None
    recover_lr: float
    recover_trainable: str
    recover_objective: str
    recover_seed: int
    choose_after_recovery: bool
    measure_speed: bool
    latency_shape: tuple[int, ...] | None
    budget_latency: float | None
    speed_clock: Callable[[], float] | None


def compute_dtype_name(spec: Any) -> str | None:
    """``model``/None (the model's own dtype), ``float32``/``fp32`` or ``float64``/``fp64`` (or that torch dtype) as
    the name of the dtype calibration statistics are read in; anything else is one :class:`AuditError` line."""
    if spec is None:
        return None
    text = str(spec).strip().lower().replace("torch.", "")
    names = {"model": None, "float32": "float32", "fp32": "float32", "float64": "float64", "fp64": "float64"}
    if text not in names:
        raise AuditError(f"unknown compute dtype {spec!r}", "Give --compute-dtype model or float32")
    return names[text]


@dataclass(frozen=True)
class LoadOptions:
    """How to read a model from a source string (see :func:`auditor.sources.load_source`)."""

    input_shape: tuple[tuple[int, ...], ...] | None = None  # one float input per shape
    input_ids: tuple[int, ...] | None = None  # token ids of this shape, within the config's vocabulary
    weights: str | None = None  # a state dict to load into a factory's or zoo model
    structure_only: bool = False  # a Hugging Face config on the meta device: counts and shapes, no weights
    partial: bool = False  # audit a checkpoint that lacks some weights (they are listed in a note), not an error
    auto_inputs: bool = True  # a Hugging Face source without inputs makes token ids (or pixels) from its config
