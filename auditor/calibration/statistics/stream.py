"""Tier 1, step 1 for models built of repeated blocks: input statistics one block at a time (GPTQ-style).

The calibration batches run up to the first block (a pre-hook catches its positional and keyword inputs and stops the
forward); only those inputs are kept. Then, for each block in turn, its layers' hooks are attached, the block runs on
each kept input, the hooks are closed (that block's statistics, handed to ``on_block``), and the block's outputs
replace its inputs as the next block's. The layers outside the blocks (embeddings, final norm, output head) get theirs
in one last pass in which every block returns the last block's output instead of running. What is alive at once: the
weights (with ``offload``, one block's on the device), the kept inputs of one block (one hidden-state tensor per batch
plus the keyword inputs the blocks share: mask, rotary cos/sin), and one block's statistics (one more when
``on_block`` keeps them). Caches the blocks would fill (``past_key_value(s)``, ``layer_past``, ``cache``, any ``Cache``,
by keyword or, as GPT-2's blocks take theirs, positionally) are not passed.

A model has repeated blocks when some ``nn.ModuleList`` of at least two children of one class holds more than half of
the layers read; the longest such list is used. Models without one, or whose blocks are not called one after another
with the same inputs apart from the hidden state, or whose forward does anything to a block's output before the
next block reads it (a ReLU, a scaling, a flip, a permutation, a residual from elsewhere), get the one-pass
:func:`auditor.calibration.statistics.stats.input_statistics`: both are checked on the first batch before any statistics are
taken, with every block returning distinct random values that the next block must receive exactly. Both paths give the
same statistics (to float64 rounding). What the check cannot see is code between blocks that acts only on some values
(e.g. a clamp beyond 1e3 that these values never reach).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, TypedDict

import torch
from torch import nn

from ... import kinds
from ...errors import AuditError
from ...results import Layer
from ..data.inputs import Batch, Calibration, eval_mode, model_device
from ..data.precision import HALF
from .stats import InputStatistics, StatisticsHooks, batch_mask, by_name, input_statistics, module_path

if TYPE_CHECKING:
    from typing_extensions import Unpack

CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")  # not passed: the blocks would fill them


def _is_cache(v: object) -> bool:
    """A key/value cache object (transformers' ``Cache`` and its subclasses)."""
    return any(c.__name__ == "Cache" for c in type(v).__mro__)


@dataclass
class Blocks:
    """The repeated blocks of a model: the ModuleList's path, the list, the layers of each block, the rest."""

    path: str
    blocks: nn.ModuleList
    layers: list[list[Layer]]
    outside: list[Layer]


def find_blocks(model: nn.Module, layers: dict[str, Layer] | list[Layer]) -> Blocks | None:
    """The longest ``nn.ModuleList`` of two or more children of one class that holds more than half of ``layers``;
    None when there is none."""
    named = list(by_name(layers).values())
    best: tuple[tuple[int, int], str, nn.ModuleList, list[list[Layer]]] | None = None
    for path, mod in model.named_modules():
        if not kinds.is_block_list(mod):
            continue
        prefix = f"{path}." if path else ""
        per: list[list[Layer]] = [[] for _ in mod]
        for layer in named:
            p = module_path(layer)[0]
            if p.startswith(prefix):
                head = p[len(prefix):].partition(".")[0]
                if head.isdigit() and int(head) < len(mod):
                    per[int(head)].append(layer)
        inside = sum(map(len, per))
        if 2 * inside <= len(named):
            continue
        key = (len(mod), inside)
        if best is None or key > best[0]:
            best = (key, path, mod, per)
    if best is None:
        return None
    _, path, mod, per = best
    ids = {id(l) for ls in per for l in ls}
    return Blocks(path, mod, per, [l for l in named if id(l) not in ids])


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available, else the CPU) as a device; an unknown or
    unavailable one raises :class:`AuditError` with one line."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or "cpu").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", text)
    if m is None:
        raise AuditError(f"unknown device {spec!r}", "Give --device cpu, cuda, cuda:N or auto")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise AuditError(f"device {spec!r} is not available: this torch sees no CUDA GPU",
                             "Use --device cpu (or auto), or run on a machine with a GPU and a CUDA build of torch")
        n = torch.cuda.device_count()
        if m.group(1) is not None and int(m.group(1)) >= n:
            raise AuditError(f"device {spec!r} is not available: {n} CUDA device(s), cuda:0 to cuda:{n - 1}",
                             f"Give --device cuda:0 ... cuda:{n - 1}")
    return torch.device(text)


def accelerator(spec: str | torch.device | None) -> torch.device | None:
    """The device ``spec`` names (:func:`resolve_device`, which raises for one this machine lacks) where it is an
    accelerator, where the decompositions run too (statistics/ondevice.py); None for the CPU and for no spec."""
    device = resolve_device(spec) if spec is not None else None
    return device if device is not None and device.type != "cpu" else None


def batch_dtype_for(device: torch.device) -> torch.dtype:
    """Each batch's X^T X in float32 on a GPU (added into a float64 sum), float64 on the CPU."""
    return torch.float32 if device.type == "cuda" else torch.float64


class _Stop(Exception):
    pass


class NotSequential(Exception):
    """The blocks do not run one after another on one hidden state (:func:`check_sequential`): the model is streamed
    whole instead."""


def kept_args(args: tuple[object, ...]) -> tuple[object, ...]:
    """Positional inputs without a cache object (GPT-2's blocks take theirs positionally): a kept cache would grow
    each time the block runs again on the kept inputs, and hold what a gradient pass through it computed."""
    return tuple(None if _is_cache(a) else a for a in args)


def kept_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """Keyword inputs without a cache object and with ``use_cache`` off (as :func:`kept_args`)."""
    out = dict(kwargs)
    for k, v in out.items():
        if k in CACHE_KWARGS or _is_cache(v):
            out[k] = None
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def hidden_state(out: object) -> torch.Tensor:
    """A block's hidden output: the output itself, or the tensor a tuple starts with; else :class:`NotSequential`."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise NotSequential("a block returned neither a tensor nor a tuple starting with one")


def with_hidden(args: tuple[object, ...], kwargs: dict[str, object], h: torch.Tensor) -> tuple[tuple[object, ...], dict]:
    """A block's kept inputs with ``h`` as the hidden input: the first positional tensor, else ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b.to(a.device))))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or isinstance(a, (bool, int, float, str)):
        return a == b
    return True  # other objects (a cache, a config) are not compared


def _move(model: nn.Module, device: torch.device, skip: nn.Module | None = None) -> None:
    """Every parameter and buffer of ``model`` to ``device``, except those of ``skip`` (and its children)."""
    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    for mod in model.modules():
        if id(mod) in skipped:
            continue
        for k, p in mod._parameters.items():
            if p is not None and p.device != device:
                p.data = p.data.to(device)
        for k, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[k] = b.to(device)


class _Precision:
    """Half-precision (bf16/fp16) parameters and buffers cast to a compute dtype while they run, and back.

    A CPU without bf16 matrix units multiplies bf16 a few hundred times slower than float32 (0.36 against 102
    GFLOPS measured on a 2-core AMD EPYC), so a bf16 model's statistics are read with its blocks upcast one at a
    time: the weights stay bf16 in memory (one block's float32 copy alive at once), and casting back is exact.
    The activations are then float32 products of the bf16 weights; they differ from bf16 arithmetic's by its
    rounding (about 2^-8 relative per element), which the statistics (float64 sums) keep."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.saved: dict[tuple[int, str, str], tuple[nn.Module, torch.dtype]] = {}

    def cast(self, module: nn.Module, skip: nn.Module | None = None) -> None:
        if self.dtype is None:
            return
        skipped = {id(m) for m in skip.modules()} if skip is not None else set()
        for mod in module.modules():
            if id(mod) in skipped:
                continue
            for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
                for k, t in table.items():
                    if t is not None and t.dtype in HALF:
                        self.saved.setdefault((id(mod), kind, k), (mod, t.dtype))
                        if kind == "p":
                            t.data = t.data.to(self.dtype)
                        else:
                            table[k] = t.to(self.dtype)

    def restore(self, module: nn.Module | None = None) -> None:
        """Back to the saved dtypes: every cast tensor, or those of ``module`` and its children."""
        ids = {id(m) for m in module.modules()} if module is not None else None
        for key, (mod, dtype) in list(self.saved.items()):
            if ids is not None and key[0] not in ids:
                continue
            kind, k = key[1], key[2]
            table = mod._parameters if kind == "p" else mod._buffers
            t = table.get(k)
            if t is not None:
                if kind == "p":
                    t.data = t.data.to(dtype)
                else:
                    table[k] = t.to(dtype)
            del self.saved[key]

    def batch(self, b: Batch) -> Batch:
        """``b`` with its half-precision tensors (pixel values, embeddings given as inputs) in the compute dtype."""
        if self.dtype is None or not any(t.dtype in HALF for _, t in b.tensors()):
            return b

        def up(x: object) -> object:
            return x.to(self.dtype) if isinstance(x, torch.Tensor) and x.dtype in HALF else x

        return Batch(args=tuple(up(a) for a in b.args), kwargs={k: up(v) for k, v in b.kwargs.items()})


def compute_dtype_for(spec: str | torch.dtype | None) -> torch.dtype | None:
    """``model``/None (the model's own dtype), ``float32`` or ``float64`` as the dtype statistics are computed in
    (:func:`auditor.options.compute_dtype_name`)."""
    from ...options import compute_dtype_name

    name = compute_dtype_name(spec)
    return None if name is None else getattr(torch, name)


@dataclass
class StreamOptions:
    """How :func:`stream_statistics` reads the statistics (see there for each field)."""

    device: str | torch.device | None = None
    offload: bool = False
    on_block: Callable[[int, InputStatistics], None] | None = None
    keep: bool = True
    batch_dtype: torch.dtype | None = None
    progress: Callable[[int, int], None] | None = None
    compute_dtype: str | torch.dtype | None = None


class StreamFields(TypedDict, total=False):
    """The keywords of :func:`stream_statistics`: :class:`StreamOptions`' fields."""

    device: str | torch.device | None
    offload: bool
    on_block: Callable[[int, InputStatistics], None] | None
    keep: bool
    batch_dtype: torch.dtype | None
    progress: Callable[[int, int], None] | None
    compute_dtype: str | torch.dtype | None


def stream_statistics(model: nn.Module, layers: dict[str, Layer] | list[Layer], batches: Calibration | list[Batch],
                      **fields: Unpack[StreamFields]) -> InputStatistics:
    """The input statistics of ``layers``, block by block when the model has repeated blocks (else in one pass).

    The options as keywords (:class:`StreamFields`, the fields of :class:`StreamOptions`):
    ``device``: where the forward runs and the sums accumulate (default: where the model is); the model is moved
    there and back. ``offload``: the blocks stay where they are and each is moved to ``device`` only while it runs.
    ``on_block(i, stats)`` gets each block's statistics as soon as they are complete (and the outside layers' last,
    with ``i`` = -1); ``keep=False`` drops them afterwards, so the result holds only ``missing`` and ``warnings`` for
    them. ``batch_dtype``: the dtype each batch's X^T X is formed in (default float32 on CUDA, float64 on the CPU).
    ``compute_dtype`` (``float32``): bf16/fp16 weights and inputs cast to it while they run (the blocks one at a
    time, :class:`_Precision`), and back afterwards; None or ``model``: the model's own dtypes."""
    o = StreamOptions(**fields)
    prec = _Precision(compute_dtype_for(o.compute_dtype))
    home = model_device(model)
    dev = resolve_device(o.device) if o.device is not None else home
    run = _Run(batches.digest if isinstance(batches, Calibration) else "", dev, o.offload, o.on_block, o.keep,
               o.batch_dtype or batch_dtype_for(dev), o.progress, prec)
    fit = batches.fit if isinstance(batches, Calibration) else list(batches)
    found = find_blocks(model, layers)
    moved = False
    if prec.dtype is not None:
        fit = [prec.batch(b) for b in fit]
    try:
        prec.cast(model, skip=found.blocks if found is not None else None)
        if dev != home:
            _move(model, dev, skip=found.blocks if found is not None and o.offload else None)
            moved = True
        if found is not None:
            try:
                return _stream(model, found, fit, run)
            except NotSequential:
                pass
        return _one_pass(model, layers, fit, run, moved)
    finally:
        prec.restore()
        if moved:
            _move(model, home)


@dataclass
class _Run:
    """One streaming run's settings, as :func:`stream_statistics` resolved them."""

    digest: str
    dev: torch.device
    offload: bool
    on_block: Callable[[int, InputStatistics], None] | None
    keep: bool
    bdt: torch.dtype
    progress: Callable[[int, int], None] | None
    prec: _Precision

    def on_device(self, block: nn.Module) -> None:
        if self.offload:
            _move(block, self.dev)
        self.prec.cast(block)

    def off_device(self, block: nn.Module) -> None:
        self.prec.restore(block)
        if self.offload:
            _move(block, torch.device("cpu"))


def _one_pass(model: nn.Module, layers: dict[str, Layer] | list[Layer], fit: list[Batch], run: _Run,
              moved: bool) -> InputStatistics:
    """The statistics in one pass over the whole model (no repeated blocks, or blocks not run one after another)."""
    if run.offload and moved:
        _move(model, run.dev)
    run.prec.cast(model)
    out = input_statistics(model, layers, fit, progress=run.progress, batch_dtype=run.bdt)
    out.digest = run.digest
    if run.on_block is not None:
        run.on_block(-1, out)
    if not run.keep:
        out.layers.clear()
    return out


def _stream(model: nn.Module, found: Blocks, fit: list[Batch], run: _Run) -> InputStatistics:
    """Block by block: the first block's inputs caught, checked to run one block after another, then each block's
    statistics, then the outside layers' in one last pass."""
    blocks = list(found.blocks)
    masks = [batch_mask(b) for b in fit]
    result = InputStatistics(batches=len(fit), digest=run.digest)
    with eval_mode(model), torch.no_grad():
        kept = first_inputs(model, blocks[0], fit, run.dev)
        run.on_device(blocks[0])
        try:
            shape = blocks[0](*kept[0][0], **kept[0][1])
        finally:
            run.off_device(blocks[0])
        # the blocks must run one after another, each on the last one's hidden state and the same other inputs:
        # checked on the first batch with every block passing its input through
        check_sequential(model, blocks, fit[0].to(run.dev), kept[0], shape)
        del shape
        finals: list[object] = []
        for i, blk in enumerate(blocks):
            st = _block_statistics(model, blk, found.layers[i], kept, masks, run,
                                   finals if i == len(blocks) - 1 else None)
            _merge(result, st, run.on_block, i, run.keep)
            del st
            if run.progress is not None:
                run.progress(round(len(fit) * (i + 1) / (len(blocks) + 1)), len(fit))
        kept.clear()
        if found.outside:
            st = _outside_statistics(model, blocks, found.outside, fit, masks, run, finals)
            finals.clear()
            _merge(result, st, run.on_block, -1, run.keep)
        if run.progress is not None:
            run.progress(len(fit), len(fit))
    return result


def first_inputs(model: nn.Module, first: nn.Module, fit: list[Batch],
                  dev: torch.device) -> list[tuple[tuple[object, ...], dict[str, object]]]:
    """Each batch's inputs to the first block (positional, keyword), the forward stopped there."""
    kept: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def catch(_m: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        kept.append((kept_args(args), kept_kwargs(kwargs)))
        raise _Stop

    h = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for b in fit:
            n = len(kept)
            try:
                bb = b.to(dev)
                model(*bb.args, **bb.kwargs)
            except _Stop:
                pass
            if len(kept) != n + 1:
                raise NotSequential("a batch did not reach the first block")
    finally:
        h.remove()
    if not kept:
        raise NotSequential("no batches")
    return kept


def _block_statistics(model: nn.Module, blk: nn.Module, layers: list[Layer],
                      kept: list[tuple[tuple[object, ...], dict[str, object]]], masks: list[object], run: _Run,
                      finals: list[object] | None) -> InputStatistics:
    """One block run on every kept input with its layers' hooks: its statistics; each kept input becomes the
    block's output (the next block's input), and with ``finals`` the outputs are also kept there (the last block)."""
    run.on_device(blk)
    hooks = StatisticsHooks(model, layers, run.bdt)
    try:
        for j, (args, kwargs) in enumerate(kept):
            with hooks.batch(masks[j], j):
                out = blk(*args, **kwargs)
            if finals is not None:
                finals.append(out)
            kept[j] = with_hidden(args, kwargs, hidden_state(out))
            del out
    finally:
        hooks.remove()
        run.off_device(blk)
    return hooks.close(len(kept), run.digest)


@contextlib.contextmanager
def patched_forwards(blocks: list[nn.Module], make: Callable[[int, nn.Module], Callable[..., object]]) -> Iterator[None]:
    """While the block runs, block ``i``'s forward is ``make(i, block)`` (made in order, so it may wrap the forward it
    replaces); afterwards each block's own is back (an instance attribute as it was, else the class's). The one loop
    that patches repeated blocks: the outside layers' pass, the pass-through check and the gradient pass's
    checkpointing (calibration/tiers/fisher.py)."""
    saved = [(blk, blk.__dict__.get("forward")) for blk in blocks]
    try:
        for i, blk in enumerate(blocks):
            blk.forward = make(i, blk)  # type: ignore[method-assign]
        yield
    finally:
        for blk, fwd in saved:
            if fwd is None:
                del blk.forward
            else:
                blk.forward = fwd


def _outside_statistics(model: nn.Module, blocks: list[nn.Module], outside: list[Layer], fit: list[Batch],
                        masks: list[object], run: _Run, finals: list[object]) -> InputStatistics:
    """The layers outside the blocks, in one pass where every block returns the last block's output for the batch."""
    hooks = StatisticsHooks(model, outside, run.bdt)
    current = [0]

    def final(*_a: object, **_k: object) -> object:
        return finals[current[0]]

    try:
        with patched_forwards(blocks, lambda i, blk: final):
            for j, b in enumerate(fit):
                current[0] = j
                with hooks.batch(masks[j], j):
                    bb = b.to(run.dev)
                    model(*bb.args, **bb.kwargs)
    finally:
        hooks.remove()
    return hooks.close(len(fit), run.digest)


def _probe(h: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor shaped like the hidden state ``h`` whose values any operation between two blocks would change: signed
    random numbers of magnitudes from 1e-3 to 1e3, all distinct (a ReLU, a scaling, a clamp, a flip, a permutation, an
    added constant or a rounding each changes some); integer states are passed through as they are."""
    if not h.is_floating_point():
        return h
    sign = torch.randint(0, 2, tuple(h.shape), generator=gen).mul(2).sub(1)
    mag = torch.rand(tuple(h.shape), generator=gen, dtype=torch.float64).mul(6).sub(3)
    return (sign * torch.pow(10.0, mag)).to(dtype=h.dtype, device=h.device)


def _unchanged(h: object, probe: torch.Tensor, values: torch.Tensor) -> bool:
    """Block ``i + 1`` reads block ``i``'s output as it was returned: the same tensor (or an exact copy), its values
    untouched."""
    if not isinstance(h, torch.Tensor):
        return False
    if not probe.is_floating_point():
        return h is probe
    return h.shape == values.shape and h.dtype == values.dtype and bool(torch.equal(h, values.to(h.device)))


def check_sequential(model: nn.Module, blocks: list[nn.Module], batch: Batch,
                     first: tuple[tuple[object, ...], dict[str, object]], shape: object) -> None:
    """Run ``batch`` with every block passing its hidden input through (in the output structure ``shape``), and
    raise :class:`NotSequential` unless each block is called once, in order, with the first block's other inputs."""
    calls: list[int] = []
    problem: list[str] = []
    sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block i's probe output, and a copy of its values
    args0, kw0 = first
    gen = torch.Generator().manual_seed(0x5EED)

    def through(i: int) -> Callable[..., object]:
        def fwd(*args: object, **kwargs: object) -> object:
            calls.append(i)
            args, kwargs = kept_args(args), kept_kwargs(kwargs)
            if args and isinstance(args[0], torch.Tensor):
                h, rest, rest0 = args[0], args[1:], args0[1:]
                kw, kw0_ = kwargs, kw0
            else:
                h = kwargs.get("hidden_states")
                rest, rest0 = args, args0
                kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                kw0_ = {k: v for k, v in kw0.items() if k != "hidden_states"}
            if not isinstance(h, torch.Tensor) or set(kw) != set(kw0_) or not _same(rest, rest0) \
                    or not all(_same(kw0_[k], kw[k]) for k in kw):
                problem.append(f"block {i} got other inputs than block 0")
            elif i > 0 and (i - 1 not in sent or not _unchanged(h, *sent[i - 1])):
                problem.append(f"the model changes block {i - 1}'s output before block {i} reads it")
            if isinstance(h, torch.Tensor):
                h = _probe(h, gen)
                sent[i] = (h, h.clone())
            if isinstance(shape, torch.Tensor):
                return h
            return (h, *shape[1:])

        return fwd

    try:
        with patched_forwards(blocks, lambda i, blk: through(i)):
            model(*batch.args, **batch.kwargs)
    except Exception as exc:  # noqa: BLE001 - a model that does not take pass-through blocks is run in one pass
        raise NotSequential(str(exc)) from None
    if calls != list(range(len(blocks))) or problem:
        raise NotSequential(problem[0] if problem else f"blocks called in the order {calls}")


def _merge(result: InputStatistics, st: InputStatistics, on_block: Callable[[int, InputStatistics], None] | None,
           i: int, keep: bool) -> None:
    if on_block is not None:
        on_block(i, st)
    if keep:
        result.layers.update(st.layers)
    result.missing.update(st.missing)
    result.warnings.extend(w for w in st.warnings if w not in result.warnings)


__all__ = ["Blocks", "NotSequential", "StreamOptions", "check_sequential", "find_blocks", "first_inputs", "hidden_state",
           "kept_args", "kept_kwargs", "resolve_device", "stream_statistics", "with_hidden"]
