"""Block refinement: one block's factors trained together on the block's output, after the sequential fit.

The sequential fit (:mod:`.sequential`) gives each planned layer the rank-r map closest to the dense layer's
outputs, one layer at a time. A block's layers then still pass their errors on to each other (the attention's q, k
and v through the softmax, gate and up through the SwiGLU product), and no single layer's fit sees that. Here, once
a block's stages are fitted, its planned layers' factors (A, B per layer, from their truncators) are trained
together with Adam to bring the block's output on the factorized model's inputs to it back to the dense block's
output on the dense inputs (the same anchor as the layers' own fit), as AA-SVD's block refinement and BRECQ's block
reconstruction do. Only the factors train: the ranks, the other weights and the parameter count stay as they are.

Early stopping guards against fitting the calibration rows' noise: one fit batch in CHECK (the last ones) is held
out of the training, the block's error on it is measured after each epoch, training ends at the first epoch that
does not lower it, and the factors of the last epoch that did are kept; where no epoch beats the closed form (or
there is a single fit batch, so nothing can be held out) the closed-form factors stay, bit for bit. Each factor's
step is LR times its root mean square (Adam's steps are in the parameters' units), so the same setting holds for any
scale of weights. Alive at once: the block's factors (float32 master copies, float64 for a float64 model) with
Adam's two moments, one batch's autograd graph through the block, and the dense block's outputs on every fit batch
(the targets, one copy of what the sequential fit already keeps per batch). Measured in docs/calibration.md ("Block
refinement").

A planned ``nn.Linear`` trains in its factored form: while its block is refined, the module is swapped for one that
computes ``(x B^T) A^T + bias`` (:class:`_LowRank`), r (m + n) multiply-adds a position instead of m n, and no m x n
product A B formed, and differentiated, at each step (the Llama-2-7B block's training step on a batch of 16 x 256
positions, its Linears at half their break-even ranks: 44.3 s with the products, 20.3 s factored, on 2 CPU cores;
``benchmarks/refine_factored.py``). Each factor is rounded to the layer's stored dtype before it multiplies, as the
written factors are. Other kinds (convolutions, grouped maps, a transposed ``Conv1D``) run with the product in place
of their weight, as before; the original modules are back in place when the refinement ends, an error included.

On a device (``--device cuda``: :class:`Refinement`'s ``device``) the block trains there while the model stays
where it is: the block's weights and buffers are copied there once for the block (passed to ``functional_call``,
the module itself never moved), the factors, Adam's moments and the autograd graph live there, and each batch's
inputs, target and mask go there as that batch is used (one batch at a time, not the block's fit rows at once). The
refined factors come back to the host as float64, as on the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from ...results import Layer
from .whiten import spill_array, stored_weight

EPOCHS = 8  # the most passes over a block's training batches
LR = 5e-3  # each factor's Adam step, relative to its root mean square
CHECK = 8  # one fit batch in CHECK (at least one) is held out of the training to stop it

Inputs = list[tuple[tuple[object, ...], dict[str, object]]]  # per batch: a block's positional and keyword inputs


@dataclass(frozen=True)
class Refinement:
    """How the sequential fit refines its blocks: ``epochs`` at most (0: the closed form only) and the ``device`` a
    block trains on (None: where its weights are)."""

    epochs: int = EPOCHS
    device: torch.device | None = None


class Batches(NamedTuple):
    """A block's fit batches, per batch: ``inputs`` (the factorized model's inputs to the block), ``targets`` (the
    dense block's outputs on the dense inputs) and ``masks`` (real positions, or None for all)."""

    inputs: Inputs
    targets: list[torch.Tensor]
    masks: list[torch.Tensor | None]


@dataclass(frozen=True)
class Refined:
    """A layer's factors as the block refinement left them, at the one rank they were trained at: ``factors`` and
    ``weight`` as a :class:`~.whiten.Truncator`'s."""

    layer: Layer
    a: np.ndarray  # (groups, out, r), float64
    b: np.ndarray  # (groups, r, in), float64
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        if rank != self.a.shape[-1]:
            raise ValueError(f"{self.layer.name} was refined at rank {self.a.shape[-1]}, not {rank}")
        return self.a, self.b

    def weight(self, rank: int) -> torch.Tensor:
        a, b = self.factors(rank)
        return stored_weight(self.layer, torch.from_numpy(a @ b), self.shape, self.dtype, self.device)

    @property
    def on_disk(self) -> bool:
        """Whether the factors are :meth:`spilled` (memory-mapped files)."""
        return isinstance(self.a, np.memmap) and isinstance(self.b, np.memmap)

    def spilled(self, base: str) -> "Refined":
        """The same, its factors written to ``base``.a.npy / .b.npy and read back memory-mapped."""
        return Refined(self.layer, spill_array(f"{base}.a.npy", self.a), spill_array(f"{base}.b.npy", self.b),
                       self.shape, self.dtype, self.device)


@dataclass
class _Factors:
    """One planned layer's trainable factors and where its weight sits in the block."""

    layer: Layer
    name: str  # the weight's name inside the block (functional_call's key)
    a: torch.Tensor
    b: torch.Tensor
    like: torch.Tensor  # the weight in place now: shape, dtype

    def weight(self) -> torch.Tensor:  # where the factors train (a device's copy of the block runs with it)
        return stored_weight(self.layer, self.a @ self.b, tuple(self.like.shape), self.like.dtype, self.a.device)

    def refined(self, a: torch.Tensor, b: torch.Tensor) -> Refined:
        """``a`` and ``b``, a snapshot of the factors (:func:`_train`'s best epoch), as float64 on the host (exact:
        the masters are float32 or float64)."""
        return Refined(self.layer, a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy(),
                       tuple(self.like.shape), self.like.dtype, self.like.device)


class _LowRank(nn.Module):
    """A planned ``nn.Linear`` as its factors while its block is refined: ``x B^T A^T + bias``, each factor rounded to
    the weight's stored dtype and computed in the input's (a half-precision model under ``--compute-dtype float32``
    gets float32 inputs). The bias is read, never trained."""

    def __init__(self, factors: _Factors, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.factors = factors  # a plain attribute: its tensors are the optimizer's, not this module's parameters
        self.fixed = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, dt = self.factors, self.factors.like.dtype
        a, b = f.a[0].to(dt), f.b[0].to(dt)
        if x.dtype != dt and x.is_floating_point():
            a, b = a.to(x.dtype), b.to(x.dtype)
        bias = self.fixed.to(a.dtype) if self.fixed is not None else None
        return F.linear(F.linear(x, b), a, bias)


def _factorable(blk: nn.Module, f: _Factors) -> tuple[nn.Module, str, nn.Linear] | None:
    """(parent, attribute, module) of a planned layer that runs factored: a plain ``nn.Linear`` whose weight is the
    one map F (out x in) the factors approximate; None for every other kind."""
    path, _, attr = f.name.rpartition(".")
    mod = blk.get_submodule(path) if path else blk
    if type(mod) is not nn.Linear or attr != "weight" or f.a.shape[0] != 1:
        return None
    if tuple(mod.weight.shape) != (f.a.shape[1], f.b.shape[2]):
        return None
    parent_path, _, child = path.rpartition(".")
    return (blk.get_submodule(parent_path) if parent_path else blk), child, mod


@contextlib.contextmanager
def _factored(blk: nn.Module, factors: list[_Factors]) -> Iterator[None]:
    """Every plain ``nn.Linear`` among ``factors`` swapped for its :class:`_LowRank` while the block is refined (its
    weight is then gone from the block's parameters; its bias read where the factors are), and back afterwards, an
    error included."""
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    try:
        for f in factors:
            found = _factorable(blk, f)
            if found is not None:
                parent, child, mod = found
                bias = mod.bias.detach().to(f.a.device) if mod.bias is not None else None
                setattr(parent, child, _LowRank(f, bias))
                swapped.append(found)
        yield
    finally:
        for parent, child, mod in reversed(swapped):
            setattr(parent, child, mod)


def _factor(layer: Layer, name: str, like: torch.Tensor, ab: tuple[np.ndarray, np.ndarray],
            device: torch.device | None = None) -> _Factors:
    """A layer's trainable factors on ``device`` (None: its weight's)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32  # float32 master factors for 16-bit weights
    a, b = (torch.from_numpy(x).to(device=device or like.device, dtype=dtype).requires_grad_(True) for x in ab)
    return _Factors(layer, name, a, b, like)


def _block_error(blk: nn.Module, factors: list[_Factors], frozen: dict[str, torch.Tensor],
                 inputs: tuple[tuple[object, ...], dict[str, object]], target: torch.Tensor,
                 mask: torch.Tensor | None, hidden: Callable[[object], torch.Tensor]) -> torch.Tensor:
    """The mean squared error of the block's output with ``factors`` in place (a swapped ``nn.Linear`` computes with
    its own, :class:`_LowRank`; every other's product is its weight), at the real positions."""
    weights = {**frozen, **{f.name: f.weight() for f in factors if f.name in frozen}}
    out = hidden(functional_call(blk, weights, inputs[0], inputs[1]))
    d = (out.float() - target.float()) ** 2
    return d[mask].mean() if mask is not None and mask.shape == d.shape[: mask.dim()] else d.mean()


def refine_block(blk: nn.Module, planned: Iterable[tuple[Layer, str, tuple[np.ndarray, np.ndarray]]],
                 batches: Batches, hidden: Callable[[object], torch.Tensor], epochs: int = EPOCHS, lr: float = LR,
                 factored: bool = True, device: torch.device | None = None) -> dict[str, Refined]:
    """The planned layers of ``blk`` (layer, its weight's name in ``blk``, its closed-form factors) trained together
    on the block's output (the module docstring) over ``batches``, on ``device`` (None: where the block's weights
    are). Returns the layers' refined factors, or nothing where the check batches' error does not fall below the
    closed form's. The block's own parameters are read, never written, moved or given gradients (the weights in place
    now are those it runs with). ``planned`` is read once, one layer at a time, each layer's master factors made
    before the next is asked for (a generator's closed-form factors need not be alive together: the sequential fit's
    are read from its fit and freed one by one). ``factored=False``: every planned layer's product A B in place of
    its weight (the module docstring; a benchmark's reference)."""
    if epochs < 1 or len(batches.inputs) < 2:
        return {}
    params = dict(blk.named_parameters())
    factors = [_factor(layer, name, params[name], ab, device) for layer, name, ab in planned]
    if not factors:
        return {}
    with _factored(blk, factors if factored else []):
        return _train(blk, factors, _frozen(blk, factors[0].a.device), batches, hidden, epochs, lr)


def _frozen(blk: nn.Module, device: torch.device | None) -> dict[str, torch.Tensor]:
    """The block's parameters (its factored Linears' weights swapped out) and buffers, detached, as
    ``functional_call`` reads them: on ``device`` (copied there once for the block), or where they are (None)."""
    return {k: t.detach() if device is None else t.detach().to(device)
            for k, t in [*blk.named_parameters(), *blk.named_buffers()]}


def on_device(obj: object, device: torch.device) -> object:
    """``obj`` with every tensor in it (through tuples, lists and dicts) on ``device``: a batch's block inputs, its
    target or its mask, as the refinement uses them; the same tensors where they are there already."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        items = [on_device(o, device) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [on_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: on_device(v, device) for k, v in obj.items()}
    return obj


def _train(blk: nn.Module, factors: list[_Factors], frozen: dict[str, torch.Tensor],
           data: Batches, hidden: Callable[[object], torch.Tensor],
           epochs: int, lr: float) -> dict[str, Refined]:
    """Adam over the factors' training batches, an epoch at a time, while the check batches' error falls."""
    inputs, targets, masks = data
    held = max(1, len(inputs) // CHECK)
    train, check = range(len(inputs) - held), range(len(inputs) - held, len(inputs))
    trained = [t for f in factors for t in (f.a, f.b)]
    opt = torch.optim.Adam([{"params": [t], "lr": lr * float(t.detach().pow(2).mean().sqrt())} for t in trained])

    dev = trained[0].device

    def loss(j: int) -> torch.Tensor:  # batch j's error, its tensors where the factors train
        there = on_device((inputs[j], targets[j], masks[j]), dev)
        return _block_error(blk, factors, frozen, *there, hidden)  # type: ignore[misc]

    def error() -> float:
        with torch.no_grad():
            return sum(float(loss(j)) for j in check)

    # the best epoch's factors copied in place into one snapshot in the masters' dtype, where they train (2026-12-08:
    # a float64 host copy of every factor made each better epoch, two alive while the next was made)
    best, kept = error(), None
    with torch.enable_grad():
        for _ in range(epochs):
            for j in train:
                opt.zero_grad(set_to_none=True)
                loss(j).backward()
                opt.step()
            now = error()
            if not now < best:
                break
            best = now
            kept = kept if kept is not None else [(torch.empty_like(f.a), torch.empty_like(f.b)) for f in factors]
            with torch.no_grad():
                for (a, b), f in zip(kept, factors):
                    a.copy_(f.a)
                    b.copy_(f.b)
    if kept is None:
        return {}
    for t in trained:  # the gradients and Adam's moments freed before the host copies are made
        t.grad = None
    del opt
    return {f.layer.name: f.refined(a, b) for (a, b), f in zip(kept, factors)}


def step_seconds(blk: nn.Module, inputs: tuple[tuple[object, ...], dict[str, object]], keep: float,
                 hidden: Callable[[object], torch.Tensor], clock: Callable[[], float], enough: float = 2.0,
                 device: torch.device | None = None) -> float:
    """One training step of the refinement on ``blk`` as :func:`refine_block` runs it, timed: every plain
    ``nn.Linear`` of the block factored at the rank that keeps ``keep`` of its weights (:func:`_random_factors`), the
    factored forward recording for the backward, the error against a target of the output's shape, the backward to
    the factors and Adam's step; the quicker of two (the first call warms up), once where it took ``enough`` seconds
    or more (a 7B block's step: about 27 s on 2 cores). On ``device`` (None: where the block's weights are) as the
    refinement trains there: the block's weights and the inputs copied there, the device synchronized before the
    clock is read. What ``--estimate`` counts for each of the refinement's steps."""
    factors = _random_factors(blk, keep, device)
    dev = factors[0].a.device if factors else device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev is not None and dev.type == "cuda" else (lambda: None)
    opt = torch.optim.Adam([t for f in factors for t in (f.a, f.b)], lr=1e-6)
    cut = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731 - the inputs' own graph left out
    inputs = (tuple(cut(a) for a in inputs[0]), {k: cut(v) for k, v in inputs[1].items()})
    inputs = on_device(inputs, dev) if dev is not None else inputs  # type: ignore[assignment]
    took: list[float] = []
    with _factored(blk, factors), torch.enable_grad():
        frozen = _frozen(blk, dev)
        with torch.no_grad():
            target = hidden(functional_call(blk, frozen, inputs[0], inputs[1])).detach()
        while len(took) < 2 and (not took or took[0] < enough):
            sync()
            t0 = clock()
            opt.zero_grad(set_to_none=True)
            _block_error(blk, factors, frozen, inputs, target, None, hidden).backward()
            opt.step()
            sync()
            took.append(clock() - t0)
    return min(took)


def _random_factors(blk: nn.Module, keep: float, device: torch.device | None = None) -> list[_Factors]:
    """Factors for every plain ``nn.Linear`` of ``blk`` at r = keep m n / (m + n) (what keeps ``keep`` of its
    weights), random values (a step's time does not depend on them), float32 masters as :func:`_factor` makes, on
    ``device`` (None: the weight's)."""
    from ...results import Kind

    params = dict(blk.named_parameters())
    g = torch.Generator().manual_seed(0)
    out = []
    for name, mod in blk.named_modules():
        if type(mod) is not nn.Linear:
            continue
        m, n = mod.weight.shape
        r = max(1, min(m, n, round(keep * m * n / (m + n))))
        dt = torch.float64 if mod.weight.dtype == torch.float64 else torch.float32
        a, b = (torch.randn(1, *shape, generator=g, dtype=dt).div(shape[-1] ** 0.5).to(device or mod.weight.device)
                .requires_grad_(True) for shape in ((m, r), (r, n)))
        weight = f"{name}.weight" if name else "weight"
        out.append(_Factors(Layer(name, weight, Kind.LINEAR, "Linear", (m, n), m, n), weight, a, b, params[weight]))
    return out


__all__ = ["CHECK", "EPOCHS", "LR", "Refined", "Refinement", "on_device", "refine_block", "step_seconds"]
