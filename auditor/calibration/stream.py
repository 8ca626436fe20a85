"""Tier 1, step 1 for models built of repeated blocks: input statistics one block at a time (GPTQ-style).

The calibration batches run up to the first block (a pre-hook catches its positional and keyword inputs and stops the
forward); only those inputs are kept. Then, for each block in turn, its layers' hooks are attached, the block runs on
each kept input, the hooks are closed (that block's statistics, handed to ``on_block``), and the block's outputs
replace its inputs as the next block's. The layers outside the blocks (embeddings, final norm, output head) get theirs
in one last pass in which every block returns the last block's output instead of running. What is alive at once: the
weights (with ``offload``, one block's on the device), the kept inputs of one block (one hidden-state tensor per batch
plus the keyword inputs the blocks share: mask, rotary cos/sin), and one block's statistics (one more when
``on_block`` keeps them). Caches the blocks would fill (``past_key_value(s)``, ``layer_past``, ``cache``, any ``Cache``) are
not passed.

A model has repeated blocks when some ``nn.ModuleList`` of at least two children of one class holds more than half of
the layers read; the longest such list is used. Models without one, or whose blocks are not called one after another
with the same inputs apart from the hidden state (checked on the first batch before any statistics are taken), get
the one-pass :func:`auditor.calibration.stats.input_statistics`. Both give the same statistics (to float64 rounding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..errors import AuditError
from ..results import Layer
from .inputs import Batch, Calibration, eval_mode, model_device
from .stats import InputStatistics, StatisticsHooks, _batch_mask, _module_path, by_name, input_statistics

CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")  # not passed: the blocks would fill them


def _is_cache(v: Any) -> bool:
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
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or len({type(c) for c in mod}) != 1:
            continue
        prefix = f"{path}." if path else ""
        per: list[list[Layer]] = [[] for _ in mod]
        for layer in named:
            p = _module_path(layer)[0]
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


def batch_dtype_for(device: torch.device) -> torch.dtype:
    """Each batch's X^T X in float32 on a GPU (added into a float64 sum), float64 on the CPU."""
    return torch.float32 if device.type == "cuda" else torch.float64


class _Stop(Exception):
    pass


class _NotSequential(Exception):
    pass


def _keep(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    for k, v in out.items():
        if k in CACHE_KWARGS or _is_cache(v):
            out[k] = None
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _hidden(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise _NotSequential("a block returned neither a tensor nor a tuple starting with one")


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], h: torch.Tensor) -> tuple[tuple[Any, ...], dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _same(a: Any, b: Any) -> bool:
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


def stream_statistics(model: nn.Module, layers: dict[str, Layer] | list[Layer], batches: Calibration | list[Batch],
                      device: str | torch.device | None = None, offload: bool = False,
                      on_block: Callable[[int, InputStatistics], None] | None = None, keep: bool = True,
                      batch_dtype: torch.dtype | None = None,
                      progress: Callable[[int, int], None] | None = None) -> InputStatistics:
    """The input statistics of ``layers``, block by block when the model has repeated blocks (else in one pass).

    ``device``: where the forward runs and the sums accumulate (default: where the model is); the model is moved
    there and back. ``offload``: the blocks stay where they are and each is moved to ``device`` only while it runs.
    ``on_block(i, stats)`` gets each block's statistics as soon as they are complete (and the outside layers' last,
    with ``i`` = -1); ``keep=False`` drops them afterwards, so the result holds only ``missing`` and ``warnings`` for
    them. ``batch_dtype``: the dtype each batch's X^T X is formed in (default float32 on CUDA, float64 on the CPU)."""
    home = model_device(model)
    dev = resolve_device(device) if device is not None else home
    bdt = batch_dtype or batch_dtype_for(dev)
    digest = batches.digest if isinstance(batches, Calibration) else ""
    fit = batches.fit if isinstance(batches, Calibration) else list(batches)
    found = find_blocks(model, layers)
    moved = False
    try:
        if found is not None and offload and dev != home:
            _move(model, dev, skip=found.blocks)
            moved = True
        elif dev != home:
            _move(model, dev)
            moved = True
        if found is not None:
            try:
                return _stream(model, found, fit, digest, dev, offload, on_block, keep, bdt, progress)
            except _NotSequential:
                pass
        if offload and moved:
            _move(model, dev)
        out = input_statistics(model, layers, fit, progress=progress, batch_dtype=bdt)
        out.digest = digest
        if on_block is not None:
            on_block(-1, out)
        if not keep:
            out.layers.clear()
        return out
    finally:
        if moved:
            _move(model, home)


def _stream(model: nn.Module, found: Blocks, fit: list[Batch], digest: str, dev: torch.device, offload: bool,
            on_block: Callable[[int, InputStatistics], None] | None, keep: bool, bdt: torch.dtype,
            progress: Callable[[int, int], None] | None) -> InputStatistics:
    blocks = list(found.blocks)
    kept: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    masks = [_batch_mask(b) for b in fit]
    result = InputStatistics(batches=len(fit), digest=digest)

    def catch(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kept.append((args, _keep(kwargs)))
        raise _Stop

    def on_device(i: int) -> None:
        if offload:
            _move(blocks[i], dev)

    def off_device(i: int) -> None:
        if offload:
            _move(blocks[i], torch.device("cpu"))

    with eval_mode(model), torch.no_grad():
        h = blocks[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            for b in fit:
                n = len(kept)
                try:
                    bb = b.to(dev)
                    model(*bb.args, **bb.kwargs)
                except _Stop:
                    pass
                if len(kept) != n + 1:
                    raise _NotSequential("a batch did not reach the first block")
        finally:
            h.remove()
        if not kept:
            raise _NotSequential("no batches")
        # the blocks must run one after another, each on the last one's hidden state and the same other inputs:
        # checked on the first batch with every block passing its input through
        on_device(0)
        try:
            shape = blocks[0](*kept[0][0], **kept[0][1])
        finally:
            off_device(0)
        _check_sequential(model, blocks, fit[0].to(dev), kept[0], shape)
        del shape
        finals: list[Any] = []
        for i, blk in enumerate(blocks):
            on_device(i)
            hooks = StatisticsHooks(model, found.layers[i], bdt)
            try:
                for j, (args, kwargs) in enumerate(kept):
                    with hooks.batch(masks[j]):
                        out = blk(*args, **kwargs)
                    if i == len(blocks) - 1:
                        finals.append(out)
                    kept[j] = _with_hidden(args, kwargs, _hidden(out))
                    del out
            finally:
                hooks.remove()
                off_device(i)
            st = hooks.close(len(fit), digest)
            _merge(result, st, on_block, i, keep)
            del st, hooks
            if progress is not None:
                progress(round(len(fit) * (i + 1) / (len(blocks) + 1)), len(fit))
        kept.clear()
        if found.outside:
            hooks = StatisticsHooks(model, found.outside, bdt)
            current = [0]
            saved = [(blk, blk.__dict__.get("forward")) for blk in blocks]
            try:
                for blk in blocks:
                    blk.forward = lambda *a, **k: finals[current[0]]  # type: ignore[method-assign]
                for j, b in enumerate(fit):
                    current[0] = j
                    with hooks.batch(masks[j]):
                        bb = b.to(dev)
                        model(*bb.args, **bb.kwargs)
            finally:
                hooks.remove()
                for blk, fwd in saved:
                    if fwd is None:
                        del blk.forward
                    else:
                        blk.forward = fwd
            finals.clear()
            _merge(result, hooks.close(len(fit), digest), on_block, -1, keep)
        if progress is not None:
            progress(len(fit), len(fit))
    return result


def _check_sequential(model: nn.Module, blocks: list[nn.Module], batch: Batch,
                      first: tuple[tuple[Any, ...], dict[str, Any]], shape: Any) -> None:
    """Run ``batch`` with every block passing its hidden input through (in the output structure ``shape``), and
    raise :class:`_NotSequential` unless each block is called once, in order, with the first block's other inputs."""
    calls: list[int] = []
    problem: list[str] = []
    saved = [(blk, blk.__dict__.get("forward")) for blk in blocks]
    args0, kw0 = first

    def through(i: int) -> Callable[..., Any]:
        def fwd(*args: Any, **kwargs: Any) -> Any:
            calls.append(i)
            kwargs = _keep(kwargs)
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
            if isinstance(shape, torch.Tensor):
                return h
            return (h, *shape[1:])

        return fwd

    try:
        for i, blk in enumerate(blocks):
            blk.forward = through(i)  # type: ignore[method-assign]
        model(*batch.args, **batch.kwargs)
    except Exception as exc:  # noqa: BLE001 - a model that does not take pass-through blocks is run in one pass
        raise _NotSequential(str(exc)) from None
    finally:
        for blk, fwd in saved:
            if fwd is None:
                del blk.forward
            else:
                blk.forward = fwd
    if calls != list(range(len(blocks))) or problem:
        raise _NotSequential(problem[0] if problem else f"blocks called in the order {calls}")


def _merge(result: InputStatistics, st: InputStatistics, on_block: Callable[[int, InputStatistics], None] | None,
           i: int, keep: bool) -> None:
    if on_block is not None:
        on_block(i, st)
    if keep:
        result.layers.update(st.layers)
    result.missing.update(st.missing)
    result.warnings.extend(w for w in st.warnings if w not in result.warnings)


__all__ = ["Blocks", "find_blocks", "resolve_device", "stream_statistics"]
