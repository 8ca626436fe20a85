"""A plan applied with factors from the data: :mod:`auditor.surgery` replaces the layers, this module says where
their factors come from. Without calibration each layer's factors are its plain truncated SVD; with calibration (a
session, a ``Calibration`` or ``InputStatistics``) the whitened truncation, which keeps the layer's outputs on the
calibration data as close as any rank-r map can (:class:`auditor.calibration.statistics.whiten.Truncator`). With
``fit="sequential"`` each layer's factors are fitted on the inputs the factorized layers before it produce, anchored
to the dense outputs (:mod:`auditor.calibration.statistics.sequential`)."""

from __future__ import annotations

import os
import weakref
from enum import Enum
from typing import TYPE_CHECKING, MutableMapping

import torch
from torch import nn

from .. import kinds
from ..errors import AuditError
from ..results import Layer
from ..surgery import Factors, Truncation, apply_plan, checked_plan, replace_layers
from .data.inputs import Calibration
from .session import CalibrationSession
from .statistics.stats import InputStatistics
from .statistics.whiten import Truncator

if TYPE_CHECKING:
    from .statistics.sequential import SequentialFit
    from .statistics.stream import Blocks
    from .statistics.whiten import Truncator


class Fit(str, Enum):
    """How the factors are fitted with calibration: each layer alone on the dense model's inputs, or in call order on
    the inputs the factorized layers before it produce (the sequential, output-anchored fit)."""

    INDEPENDENT = "independent"
    SEQUENTIAL = "sequential"
    LOSS_AWARE = "loss-aware"
    SEQUENTIAL_REFIT = "sequential, refit dense"  # the sequential fit refitting the layers the plan keeps dense
    SEQUENTIAL_CLOSED = "sequential, closed form"  # the sequential fit without the block refinement
    SEQUENTIAL_REFIT_CLOSED = "sequential, refit dense, closed form"

    @property
    def sequential(self) -> bool:
        return self.value.startswith("sequential")

    @property
    def refits(self) -> bool:
        """Whether the layers the plan keeps dense are refitted (``refit_dense``)."""
        return "refit dense" in self.value

    @property
    def refines(self) -> bool:
        """Whether each repeated block's factors are trained together on its output (:mod:`.statistics.refine`)."""
        return self.sequential and "closed form" not in self.value

    @classmethod
    def of_sequential(cls, refit_dense: bool = False, refine: bool = True) -> "Fit":
        """The sequential fit with or without the dense refit and the block refinement."""
        return cls("sequential" + (", refit dense" if refit_dense else "") + ("" if refine else ", closed form"))


def fit_of(fit: "Fit | str") -> Fit:
    """``fit`` as a :class:`Fit`, or one line naming the choices."""
    try:
        return Fit(fit)
    except ValueError:
        raise AuditError(f"fit {fit!r} is not a way to fit the factors",
                         f"Give one of {', '.join(repr(f.value) for f in Fit)}") from None


def truncation(stats: InputStatistics | None = None, reuse: "MutableMapping[str, Truncator] | None" = None) -> Truncation:
    """The factors of a layer at a rank: whitened under the layer's statistics in ``stats``, the plain SVD where
    there are none. ``reuse``: a dict the caller keeps across plans of one model and calibration, so each layer is
    decomposed once."""

    def factors(name: str, layer: Layer, weight: torch.Tensor, rank: int) -> Factors:
        trunc = reuse.get(name) if reuse is not None else None
        if trunc is None:
            trunc = Truncator(layer, weight, stats.layers.get(name) if stats is not None else None)
            if reuse is not None:
                reuse[name] = trunc
        return trunc.factors(rank)

    return factors


def statistics(calibration: object, model: nn.Module, planned: list[Layer]) -> InputStatistics | None:
    """The input statistics of the planned layers: ``InputStatistics`` as given, a session's (read once, when they
    cover the plan), or gathered on ``model`` (in eval mode) from a ``Calibration``; None without calibration."""
    if calibration is None or isinstance(calibration, InputStatistics):
        return calibration
    if isinstance(calibration, (Calibration, CalibrationSession)):
        return CalibrationSession.of(calibration, model, layers=planned).statistics(planned)
    raise AuditError(f"calibration is a {type(calibration).__name__}",
                     "Pass a CalibrationSession, a Calibration (load_calibration) or InputStatistics")


def factorize(model: nn.Module, plan: dict[str, int], calibration: object = None, *, init: bool = True,
              layers: dict[str, Layer] | None = None, reuse: "MutableMapping[str, Truncator] | None" = None,
              share: bool = False, fit: "Fit | str" = Fit.INDEPENDENT) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two; ``model`` is left
    untouched. ``calibration``: None (plain SVD), a ``CalibrationSession`` (its statistics, read once), a
    ``Calibration`` (input statistics are gathered on ``model``, in eval mode), or ``InputStatistics``.
    ``init=False`` builds the structure only (for ``load_factorized``). ``reuse``: see :func:`truncation`; without
    it, a session on a Dask cluster (``AuditOptions(scheduler=...)``) has the decompositions made there.
    ``share``: the copy holds ``model``'s own parameters and buffers (:func:`auditor.surgery.replace_layers`).
    ``fit``: ``"independent"`` (each layer whitened under the dense inputs) or ``"sequential"`` (each layer fitted on
    the inputs the factorized layers before it produce; needs a session or a ``Calibration``; ``reuse`` is not read:
    the factors hold for this plan only, and are fitted here); ``"sequential, refit dense"`` (``Fit.SEQUENTIAL_REFIT``,
    what ``refit_dense=True`` of :func:`auditor.factorize` asks): the same, and the layers the plan keeps dense
    (:func:`dense_layers`) refitted at full rank on the inputs the factorized layers give them, anchored to their
    dense outputs, so they absorb part of the error passed on (their weights change, their shapes do not;
    docs/calibration.md, "The sequential fit"). The sequential fits train each repeated block's factors together on
    the block's output once the block is fitted (:mod:`.statistics.refine`), but ``"sequential, closed form"`` and
    ``"sequential, refit dense, closed form"`` (:meth:`Fit.of_sequential`), which keep the closed-form factors."""
    if not init:
        return apply_plan(model, plan, layers=layers, share=share)
    resolved = checked_plan(model, plan, layers)  # before any statistics are gathered: a complex layer would crash them
    if fit_of(fit).sequential and calibration is not None:
        dense = dense_layers(model, resolved) if fit_of(fit).refits else None
        done = sequential(calibration, model, resolved, dense, fit_of(fit).refines)
        new = replace_layers(model, resolved, truncation(None, done.truncators), share=share)
        return with_weights(new, done.refitted, dense) if dense else new
    if fit_of(fit) is Fit.LOSS_AWARE and calibration is not None:
        kept = calibration.loss_metric if isinstance(calibration, CalibrationSession) else None
        if kept is None:
            raise AuditError("the loss-aware fit needs the gradient pass's truncations, which this calibration does "
                             "not hold", "Use auditor.factorize (it runs the pass), pass the audit's session, or "
                             "fit='independent'")
        reuse = kept.store
    stats = statistics(calibration, model, [l for l, _ in resolved.values()])
    if reuse is None and isinstance(calibration, CalibrationSession) and calibration.on_cluster:
        reuse = cluster_truncators(model, calibration, [l for l, _ in resolved.values()], stats)
    return replace_layers(model, resolved, truncation(stats, reuse), share=share)


def cluster_truncators(model: nn.Module, session: CalibrationSession, planned: list[Layer],
                stats: InputStatistics | None) -> "MutableMapping[str, Truncator]":
    """The planned layers' decompositions made on the session's Dask cluster, one block at a time, into a
    :class:`~auditor.calibration.statistics.whiten.TruncatorStore` holding one part of the model in memory (the rest
    on disk until its layer is replaced)."""
    from .statistics.whiten import TruncatorStore, part_bytes

    store = TruncatorStore(part_bytes(model, planned))
    session.cluster_truncators(planned, store, stats=stats)
    return store


def check_refit(refit_dense: bool, fit: "Fit | str", calibration: object) -> None:
    """``refit_dense`` only with the sequential fit on calibration: else one line."""
    if refit_dense and (not fit_of(fit).sequential or calibration is None):
        raise AuditError("refitting the dense layers needs the sequential fit on calibration rows",
                         "Pass fit='sequential' with a calibration (lowrank-audit factorize --fit sequential)")


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


def sequential(calibration: object, model: nn.Module, resolved: dict[str, tuple[Layer, int]],
               refit: dict[str, Layer] | None = None, refine: bool = True) -> "SequentialFit":
    """The sequential fit of a checked plan on the fit rows of ``calibration`` (a session or a ``Calibration``;
    input statistics alone hold no rows to fit on), loss-aware where a session holds the gradient pass's moments
    (:attr:`CalibrationSession.loss_metric`): its truncators, and with ``refit`` those dense layers' new weights;
    ``refine``: with the block refinement (:mod:`.statistics.refine`)."""
    from .statistics.refine import EPOCHS
    from .statistics.sequential import sequential_fit

    moments = None
    if isinstance(calibration, CalibrationSession):
        kept = calibration.loss_metric
        moments = kept.moments if kept is not None else None
        calibration = calibration.calibration
    if not isinstance(calibration, Calibration):
        raise AuditError(f"the sequential fit needs the calibration rows; {type(calibration).__name__} holds none",
                         "Pass a CalibrationSession or a Calibration (load_calibration), or fit='independent'")
    return sequential_fit(model, resolved, calibration, moments=moments, refit=refit, refine=EPOCHS if refine else 0)


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
