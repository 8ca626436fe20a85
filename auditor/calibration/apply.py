"""A plan applied with factors from the data: :mod:`auditor.surgery` replaces the layers, this module says where
their factors come from. Without calibration each layer's factors are its plain truncated SVD; with calibration (a
session, a ``Calibration`` or ``InputStatistics``) the whitened truncation, which keeps the layer's outputs on the
calibration data as close as any rank-r map can (:class:`auditor.calibration.statistics.whiten.Truncator`). With
``fit="sequential"`` each layer's factors are fitted on the inputs the factorized layers before it produce, anchored
to the dense outputs (:mod:`auditor.calibration.statistics.sequential`)."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, MutableMapping, Union

import torch
from torch import nn

from .. import kinds
from ..errors import AuditError
from ..results import Layer
from ..surgery import Factors, Truncation, checked_plan, replace_layers
from .data.inputs import Calibration
from .session import CalibrationSession
from .statistics.stats import InputStatistics
from .statistics.whiten import Truncator

if TYPE_CHECKING:
    from .statistics.sequential import SequentialFit
    from .statistics.whiten import LossMetric
    from .statistics.stream import Blocks
    from .statistics.whiten import Truncator


CalibrationGiven = Union[Calibration, CalibrationSession, InputStatistics]
"""What the factors may be fitted on: the rows (a ``Calibration``), a session over them, or input statistics alone."""
FitMethod = Literal["independent", "loss-aware", "sequential"]
METHODS: tuple[FitMethod, ...] = ("independent", "sequential", "loss-aware")


@dataclass(frozen=True)
class Spelling:
    """How a caller names the fit's choices and flags in its one-line refusals: the library's keywords
    (:data:`LIBRARY`) or the command's flags (``lowrank-audit factorize``). ``fit`` is a format with the fit's name."""

    fit: str = "fit={!r}"
    calibration: str = "a calibration"  # what the refit and refine flags need beside the sequential fit
    no_calibration: str = "no calibration"
    give_calibration: str = "a calibration"
    to_sequential: str = "fit='sequential'"
    refit: str = "refit_dense=True"
    no_refine: str = "refine=False"
    plan: str = "the plan"  # the plan as the review's refusals name it
    no_saving: str | None = None  # the flag that writes a rank at or above break-even; None: never refused

    def fit_named(self, name: str) -> str:
        return self.fit.format(name)

    def gradient(self) -> tuple[str, str]:
        """(the loss-aware fit, the fits that need no gradient), as a refusal of a metric without one names them."""
        return (self.fit_named("loss-aware"),
                f"{self.fit_named('sequential')} or {self.fit_named('independent')}")


LIBRARY = Spelling()


def check_fit(method: str, refit_dense: bool, refine: bool, calibrated: bool, spelled: Spelling = LIBRARY) -> None:
    """The sequential fit's two flags (``refit_dense``, ``refine=False``) need the sequential fit on calibration: else
    one line, in the caller's words (``spelled``); ``calibrated``: whether calibration is given."""
    needs = f"{spelled.give_calibration} and {spelled.to_sequential}"
    for flag, on, what, fix in ((spelled.refit, refit_dense, "refits the dense layers in the sequential fit",
                                 f"Pass {needs}"),
                                (spelled.no_refine, not refine, "turns off the sequential fit's block refinement",
                                 f"Drop {spelled.no_refine}, or pass {needs}")):
        if on and (not calibrated or method != "sequential"):
            got = spelled.no_calibration if not calibrated else spelled.fit_named(method)
            raise AuditError(f"{flag} {what}, which needs {spelled.calibration} and {spelled.fit_named('sequential')} "
                             f"(got {got})", fix)


@dataclass(frozen=True)
class Fit:
    """How the factors are fitted with calibration: each layer alone on the dense model's inputs (``independent``,
    or ``loss-aware``: truncated in the metric's gradient metric), or in call order on the inputs the factorized
    layers before it produce (``sequential``, output-anchored), then with ``refit_dense`` the layers the plan keeps
    dense refitted, and with ``refine`` each repeated block's factors trained together (:mod:`.statistics.refine`).
    :attr:`label` is the fit in words (``"sequential, refit dense"``); :meth:`parse` reads it back."""

    method: FitMethod = "independent"
    refit_dense: bool = False
    refine: bool = True

    INDEPENDENT: ClassVar["Fit"]
    SEQUENTIAL: ClassVar["Fit"]
    LOSS_AWARE: ClassVar["Fit"]
    SEQUENTIAL_REFIT: ClassVar["Fit"]  # the sequential fit refitting the layers the plan keeps dense
    SEQUENTIAL_CLOSED: ClassVar["Fit"]  # the sequential fit without the block refinement
    SEQUENTIAL_REFIT_CLOSED: ClassVar["Fit"]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _unknown(self.method)
        check_fit(self.method, self.refit_dense, self.refine, True)

    @property
    def label(self) -> str:
        """The fit in words, as plan.json, reports and ``fit=`` spell it: ``"independent"``, ``"loss-aware"``,
        ``"sequential"``, ``"sequential, refit dense"``, ``"sequential, closed form"``,
        ``"sequential, refit dense, closed form"``."""
        return self.method + (", refit dense" if self.refit_dense else "") + ("" if self.refine else ", closed form")

    @property
    def sequential(self) -> bool:
        return self.method == "sequential"

    @property
    def refits(self) -> bool:
        """Whether the layers the plan keeps dense are refitted (``refit_dense``)."""
        return self.refit_dense

    @property
    def refines(self) -> bool:
        """Whether each repeated block's factors are trained together on its output (:mod:`.statistics.refine`)."""
        return self.sequential and self.refine

    @classmethod
    def of_sequential(cls, refit_dense: bool = False, refine: bool = True) -> "Fit":
        """The sequential fit with or without the dense refit and the block refinement."""
        return cls("sequential", refit_dense, refine)

    @classmethod
    def parse(cls, text: str) -> "Fit":
        """The fit a label names (:attr:`label`), or one line naming the choices."""
        for fit in ALL_FITS:
            if fit.label == text:
                return fit
        raise _unknown(text)

    def with_flags(self, refit_dense: bool = False, refine: bool = True, calibrated: bool = True,
                   spelled: Spelling = LIBRARY) -> "Fit":
        """This fit with the flags given beside it (``refit_dense=True`` adds the refit, ``refine=False`` drops the
        refinement), refused in one line in the caller's words where a flag needs the sequential fit on calibration
        (:func:`check_fit`)."""
        check_fit(self.method, refit_dense, refine, calibrated, spelled)
        return Fit(self.method, self.refit_dense or refit_dense, self.refine and refine)


Fit.INDEPENDENT, Fit.SEQUENTIAL, Fit.LOSS_AWARE = Fit("independent"), Fit("sequential"), Fit("loss-aware")
Fit.SEQUENTIAL_REFIT, Fit.SEQUENTIAL_CLOSED = Fit("sequential", True), Fit("sequential", refine=False)
Fit.SEQUENTIAL_REFIT_CLOSED = Fit("sequential", True, False)
ALL_FITS = (Fit.INDEPENDENT, Fit.SEQUENTIAL, Fit.LOSS_AWARE, Fit.SEQUENTIAL_REFIT, Fit.SEQUENTIAL_CLOSED,
            Fit.SEQUENTIAL_REFIT_CLOSED)  # every fit, in the order a refusal names them


DEFAULT_FIT = Fit.SEQUENTIAL
"""The fit ``auditor.factorize`` and ``lowrank-audit factorize`` use with calibration when none is named, and the
one the audit's number for a plan is measured with (docs/calibration.md, "The sequential fit": it pays on every model
measured). Where the calibration holds no rows to fit on (input statistics alone) :func:`default_fit` falls back."""


FITTED_WITH = "lowrank_fit"
"""The attribute ``auditor.factorize`` sets on the copy it returns: the label of the fit its factors came from
(:attr:`Fit.label`; ``"svd"`` without calibration): where the default fell back, the fallback is named there."""


def default_fit(calibration: object, loss_metric: "LossMetric | None" = None) -> Fit:
    """The fit a caller that names none gets: :data:`DEFAULT_FIT` where ``calibration`` holds rows to fit on (a
    session, a ``Calibration``, an audit's ``Calibrated`` or data to read: anything but ``InputStatistics`` and
    None; the sequential fit runs on any model, block by block where its repeated blocks stream
    (:func:`.statistics.stream.find_blocks`), else the whole model per stage), else the loss-aware fit where a loss
    metric (a metric with a gradient) is given, else the independent whitened one (input statistics alone; without
    calibration the factors are the plain SVD's whatever the fit)."""
    if calibration is not None and not isinstance(calibration, InputStatistics):
        return DEFAULT_FIT
    return Fit.LOSS_AWARE if loss_metric is not None and calibration is not None else Fit.INDEPENDENT


def _unknown(fit: object) -> AuditError:
    return AuditError(f"fit {fit!r} is not a way to fit the factors",
                      f"Give one of {', '.join(repr(f.label) for f in ALL_FITS)}")


def fit_of(fit: "Fit | str") -> Fit:
    """``fit`` as a :class:`Fit` (a label read by :meth:`Fit.parse`), or one line naming the choices."""
    return fit if isinstance(fit, Fit) else Fit.parse(fit)


def truncation(stats: InputStatistics | None = None, reuse: "MutableMapping[str, Truncator] | None" = None) -> Truncation:
    """The factors of a layer at a rank: whitened under the layer's statistics in ``stats``, the plain SVD where
    there are none. ``reuse``: a dict the caller keeps across plans of one model and calibration, so each layer is
    decomposed once."""

    def factors(name: str, layer: Layer, weight: torch.Tensor, rank: int) -> Factors:
        trunc = reuse.get(name) if reuse is not None else None
        if trunc is None:
            trunc = Truncator(layer, weight, stats.layers.get(name) if stats is not None else None)
            if reuse is not None:  # as a store keeps it (its cut): the same factors whether it keeps this one or not
                trunc = trunc.cut()
                reuse[name] = trunc
        return trunc.factors(rank)

    return factors


def statistics(calibration: "CalibrationGiven | None", model: nn.Module,
               planned: list[Layer]) -> InputStatistics | None:
    """The input statistics of the planned layers: ``InputStatistics`` as given, a session's (read once, when they
    cover the plan), or gathered on ``model`` (in eval mode) from a ``Calibration``; None without calibration."""
    if calibration is None or isinstance(calibration, InputStatistics):
        return calibration
    if isinstance(calibration, (Calibration, CalibrationSession)):
        return CalibrationSession.of(calibration, model, layers=planned).statistics(planned)
    raise AuditError(f"calibration is a {type(calibration).__name__}",
                     "Pass a CalibrationSession, a Calibration (load_calibration) or InputStatistics")


def factorize(model: nn.Module, plan: dict[str, int],
              calibration: "CalibrationGiven | None" = None, *,
              reuse: "MutableMapping[str, Truncator] | None" = None, share: bool = False,
              fit: "Fit | str" = Fit.INDEPENDENT, loss_metric: "LossMetric | None" = None) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two; ``model`` is left
    untouched. ``calibration``: None (plain SVD), a ``CalibrationSession`` (its statistics, read once), a
    ``Calibration`` (input statistics are gathered on ``model``, in eval mode), or ``InputStatistics``. The structure
    alone, without factors (for ``load_factorized``), is :func:`auditor.surgery.apply_plan`. ``reuse``: see
    :func:`truncation`; without it, a session on a Dask cluster (``AuditOptions(scheduler=...)``) has the
    decompositions made there. ``share``: the copy holds ``model``'s own parameters and buffers
    (:func:`auditor.surgery.replace_layers`). ``fit`` (a :class:`Fit` or its label): ``"independent"`` (each layer
    whitened under the dense inputs), ``"loss-aware"`` (each layer's truncation from ``loss_metric``, the gradient
    pass's: :func:`auditor.calibration.tiers.sensitivity.loss_metric`) or ``"sequential"`` (each layer fitted on the
    inputs the factorized layers before it produce, loss-aware with ``loss_metric``'s moments; needs a session or a
    ``Calibration``; ``reuse`` is not read: the factors hold for this plan only, and are fitted here);
    ``Fit.SEQUENTIAL_REFIT`` (``"sequential, refit dense"``, what ``refit_dense=True`` of :func:`auditor.factorize`
    asks): the same, and the layers the plan keeps dense (:func:`dense_layers`) refitted at full rank on the inputs
    the factorized layers give them, anchored to their dense outputs, so they absorb part of the error passed on
    (their weights change, their shapes do not; docs/calibration.md, "The sequential fit"). The sequential fits
    train each repeated block's factors together on the block's output once the block is fitted
    (:mod:`.statistics.refine`), but ``Fit.SEQUENTIAL_CLOSED`` and ``Fit.SEQUENTIAL_REFIT_CLOSED`` (``refine=False``),
    which keep the closed-form factors."""
    chosen = fit_of(fit)
    resolved = checked_plan(model, plan)  # before any statistics are gathered: a complex layer would crash them
    if chosen.sequential and calibration is not None:
        dense = dense_layers(model, resolved) if chosen.refits else None
        done = sequential(calibration, model, resolved, dense, chosen.refines, loss_metric=loss_metric)
        new = replace_layers(model, resolved, truncation(None, done.truncators), share=share)
        return with_weights(new, done.refitted, dense) if dense else new
    if chosen.method == "loss-aware" and calibration is not None:
        if loss_metric is None:
            raise AuditError("the loss-aware fit needs the gradient pass's truncations, which this calibration does "
                             "not hold", "Use auditor.factorize (it runs the pass), pass the audit's session, or "
                             "fit='independent'")
        reuse = loss_metric.store
    stats = statistics(calibration, model, [l for l, _ in resolved.values()])
    if reuse is None and isinstance(calibration, CalibrationSession) and calibration.decompositions.on_cluster:
        reuse = cluster_truncators(model, calibration, [l for l, _ in resolved.values()], stats)
    return replace_layers(model, resolved, truncation(stats, reuse), share=share)


def cluster_truncators(model: nn.Module, session: CalibrationSession, planned: list[Layer],
                       stats: InputStatistics) -> "MutableMapping[str, Truncator]":
    """The planned layers' decompositions made on the session's Dask cluster, one block at a time, into a
    :class:`~auditor.calibration.statistics.whiten.TruncatorStore` holding one part of the model in memory (the rest
    on disk until its layer is replaced)."""
    from .statistics.whiten import TruncatorStore, part_bytes

    store = TruncatorStore(part_bytes(model, planned))
    session.decompositions.truncators(planned, stats, store)
    return store


def dense_layers(model: nn.Module, resolved: dict[str, tuple[Layer, int]]) -> dict[str, Layer]:
    """The layers a checked plan keeps dense that the sequential fit can refit: Linear and transformers' Conv1D
    layers outside the plan whose weight no other layer shares (a tied head is left as it is)."""
    from ..results import Kind
    from ..structure.layers import ParamTable, collect_layers

    planned = {layer.name for layer, _ in resolved.values()}
    return {l.name: l for l in collect_layers(model, ParamTable.of(model)).values()
            if l.kind in (Kind.LINEAR, Kind.CONV1D_HF) and l.name not in planned and not l.aliases}


def with_weights(model: nn.Module, weights: dict[str, torch.Tensor], layers: dict[str, Layer]) -> nn.Module:
    """``model`` (a copy ``factorize`` made) with each of ``layers`` named in ``weights`` holding that weight as a
    new parameter: the original model's parameter is never written, even in a copy that shares it."""
    for name, w in weights.items():
        path, attr = kinds.for_kind(layers[name].kind).module_path(layers[name])
        mod = model.get_submodule(path)
        old = getattr(mod, attr)
        setattr(mod, attr, nn.Parameter(w, requires_grad=old.requires_grad))
    return model


def sequential(calibration: "CalibrationGiven", model: nn.Module,
               resolved: dict[str, tuple[Layer, int]], refit: dict[str, Layer] | None = None, refine: bool = True, *,
               loss_metric: "LossMetric | None" = None) -> "SequentialFit":
    """The sequential fit of a checked plan on the fit rows of ``calibration`` (a session or a ``Calibration``;
    input statistics alone hold no rows to fit on), loss-aware with ``loss_metric``'s output-gradient moments (the
    gradient pass's: :func:`auditor.calibration.tiers.sensitivity.loss_metric`): its truncators, and with ``refit``
    those dense layers' new weights; ``refine``: with the block refinement (:mod:`.statistics.refine`)."""
    from .statistics.refine import EPOCHS, Refinement
    from .statistics.sequential import sequential_fit

    device = None  # the audit's accelerator (--device cuda): the blocks' refinement trains there
    if isinstance(calibration, CalibrationSession):
        calibration, device = calibration.calibration, calibration.decompositions.device
    if not isinstance(calibration, Calibration):
        raise AuditError(f"the sequential fit needs the calibration rows; {type(calibration).__name__} holds none",
                         "Pass a CalibrationSession or a Calibration (load_calibration), or fit='independent'")
    from threadpoolctl import threadpool_limits

    moments = loss_metric.moments if loss_metric is not None else None
    with threadpool_limits(limits=1, user_api="blas"):  # NumPy's BLAS on one thread, as the audit's stage runs it:
        # the audit's plan check and factorize then fit the same factors to the bit
        return sequential_fit(model, resolved, calibration, moments=moments, refit=refit,
                              refine=Refinement(EPOCHS if refine else 0, device))


class _MappedFactors:
    """A factorized copy's new factors in its repeated blocks, kept in one file per block and mapped (copy on
    write, never written) only while their block runs: the factors alive at once are one block's, not the plan's.
    Each parameter is a placeholder of its shape between runs (one NaN, expanded: a forward that read it would give
    NaN, never a plausible value), so counting the copy's parameters still counts them, and a forward of the copy
    in which a block holding factors ran without its hooks (called other than through ``__call__``) raises. The
    files go with the copy (removed when it is garbage-collected)."""

    ALIGN = 64  # bytes: each parameter's offset in its block's file

    def __init__(self, model: nn.Module, blocks: "Blocks") -> None:
        import tempfile

        from .._env import scratch_prefix, sweep_scratch

        sweep_scratch()  # a killed run's folders first
        self.dir = tempfile.TemporaryDirectory(prefix=scratch_prefix("factors"))
        self.blocks = blocks
        self.kept = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.params: dict[int, list[tuple[nn.Parameter, int, int, torch.dtype, tuple[int, ...]]]] = {}
        self.size: dict[int, int] = {}
        self.seen: set[int] = set()  # the blocks mapped during the copy's forward running now

    def block_of(self, path: str) -> int | None:
        prefix = f"{self.blocks.path}." if self.blocks.path else ""
        head = path[len(prefix):].partition(".")[0] if path.startswith(prefix) else ""
        return int(head) if head.isdigit() and int(head) < len(self.blocks.blocks) else None

    def put(self, i: int, replacement: nn.Module) -> None:
        """The new parameters of ``replacement`` (in block ``i``) appended to the block's file, then placeholders."""
        from ..errors import AuditError

        path = os.path.join(self.dir.name, f"b{i}.bin")
        for p in replacement.parameters():
            if p.untyped_storage().data_ptr() in self.kept or p.device.type != "cpu":
                continue
            at = -(-self.size.get(i, 0) // self.ALIGN) * self.ALIGN
            raw = p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            try:
                with open(path, "ab") as fh:
                    fh.write(b"\0" * (at - self.size.get(i, 0)))
                    fh.write(memoryview(raw))  # the tensor's own bytes, no copy
            except OSError as exc:
                raise AuditError(f"cannot write a plan's factors to {self.dir.name}: {exc.strerror or exc}",
                                 "Free disk space there, or set TMPDIR to a directory with room") from None
            self.size[i] = at + raw.nbytes
            self.params.setdefault(i, []).append((p, at, raw.nbytes, p.dtype, tuple(p.shape)))
            p.data = _placeholder(p)

    def map(self, i: int) -> None:
        """Block ``i``'s parameters read from a map of its file."""
        import numpy as np

        if i not in self.params:
            return
        self.seen.add(i)
        buf = torch.from_numpy(np.memmap(os.path.join(self.dir.name, f"b{i}.bin"), dtype=np.uint8, mode="c"))
        for p, at, n, dtype, shape in self.params[i]:
            p.data = buf[at:at + n].view(dtype).view(shape)

    def unmap(self, i: int) -> None:
        """Block ``i``'s parameters back to placeholders (the map closes with the last view of it)."""
        for p, *_ in self.params.get(i, []):
            p.data = _placeholder(p)

    def attach(self, new: nn.Module) -> None:
        """Hooks on the copy's blocks that map each block's factors while it runs; the files removed with it."""
        blocks = new.get_submodule(self.blocks.path) if self.blocks.path else new
        for i in self.params:
            blocks[i].register_forward_pre_hook(lambda mod, args, i=i: self.map(i))
            blocks[i].register_forward_hook(lambda mod, args, out, i=i: self.unmap(i))
        new.register_forward_pre_hook(lambda mod, args: self.seen.clear())
        new.register_forward_hook(lambda mod, args, out: self.check())
        weakref.finalize(new, self.dir.cleanup)

    def check(self) -> None:
        """After a forward of the copy: every block holding factors was mapped while it ran."""
        missed = sorted(set(self.params) - self.seen)
        if missed:
            raise RuntimeError(f"blocks {missed} of the factorized copy ran without their factors mapped (a block "
                               "called other than through __call__); measure the plan with factorize(share=True)")


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """One NaN of ``p``'s dtype expanded to its shape: its shape and count, one element's memory."""
    return torch.full((1,), float("nan"), dtype=p.dtype).expand(p.shape)


def measured_copy(model: nn.Module, plan: dict[str, int], stats: InputStatistics | None,
                  reuse: "MutableMapping[str, Truncator] | None") -> nn.Module:
    """``factorize(model, plan, stats, reuse=reuse, share=True)`` for measuring a plan, with the factors of the
    layers in the model's repeated blocks kept on disk as each is made and mapped only while their block runs
    (:class:`_MappedFactors`): what a plan's factors hold in memory at once is one block's (and the layers' outside
    the blocks), whatever the depth. The same model: the same factors, the same values in the forward. On a
    model without repeated blocks, or not on the CPU, it is ``factorize``'s copy."""
    from .data.inputs import model_device
    from .statistics.stream import find_blocks

    resolved = checked_plan(model, plan)
    found = find_blocks(model, [l for l, _ in resolved.values()]) if resolved else None
    if found is None or model_device(model).type != "cpu":
        return factorize(model, plan, stats, reuse=reuse, share=True)
    mapped = _MappedFactors(model, found)

    def built(name: str, replacement: nn.Module) -> None:
        layer = resolved[name][0]
        i = mapped.block_of(kinds.for_kind(layer.kind).module_path(layer)[0])
        if i is not None and not layer.aliases:  # a module reached by several paths stays in memory
            mapped.put(i, replacement)

    new = replace_layers(model, resolved, truncation(stats, reuse), share=True, built=built)
    mapped.attach(new)
    return new


def fitted_copy(model: nn.Module, plan: dict[str, int], calibration: "CalibrationGiven", fit: Fit,
                loss_metric: "LossMetric | None" = None) -> nn.Module:
    """``factorize(model, plan, calibration, fit=fit, loss_metric=loss_metric, share=True)`` for measuring the plan as
    ``factorize`` writes it: the sequential fit's factors (without the dense refit) put in a :func:`measured_copy`,
    so that what the copy holds in memory at once is one block's factors, as for the search's copies (the fit itself
    keeps the planned layers' fitted weights while it runs: :mod:`.statistics.sequential`); other fits as
    ``factorize`` makes them, shared."""
    if fit.sequential and not fit.refits and not isinstance(calibration, InputStatistics):
        done = sequential(calibration, model, checked_plan(model, plan), None, fit.refines, loss_metric=loss_metric)
        return measured_copy(model, plan, None, done.truncators)
    return factorize(model, plan, calibration, fit=fit, loss_metric=loss_metric, share=True)

