"""Sensitivity from gradients: every layer's model-level cost at every rank from one backward pass.

With ``Y`` the model's output and ``y = F x`` a layer's output, a small change ``D`` of F moves the audit's metric
by a quadratic form in ``D``, whose Kronecker-factored (KFAC) approximation is

    cost(D) = c * trace(G D S D^T),    G = mean over positions of E[g g^T],   S = X^T X (the input statistics)

where ``g`` is the gradient at the layer's output of
- the relative output error: a random projection ``<w, Y>`` of the output (``w`` standard normal, so that
  E[g g^T] = J^T J, the Gauss-Newton matrix of ||dY||^2), with ``c = 1 / ||Y||^2`` (the dense output's squared norm
  over the same rows): the cost is the squared relative output error;
- a likelihood metric (perplexity, masked perplexity, KL): the negative log-likelihood of labels sampled from the
  model's own next-token (or masked-token) distribution (so that E[g g^T] is the Fisher information), with
  ``c = 1 / (2 N)`` for N scored positions: the cost is the increase of the mean cross-entropy in nats, which is the
  KL and, to first order, the relative perplexity increase;
- a row-embedding metric (the pooled cosine distance): a random projection ``<w, E>`` of the metric's unit row
  embeddings (``MetricKind.embedding``), with ``c = 1 / (2 N)`` for N counted rows: the cost is the mean of
  ||dE_row||^2 / 2, the mean 1 - cosine to second order, which adds up across layers as it is (``linear``).

The truncation tier 3 applies at rank r keeps F_r = U_r U_r^T F (U the left singular vectors of the whitened F S,
:mod:`~auditor.calibration.statistics.whiten`), so D = (I - U_r U_r^T) F and, in the basis that diagonalises F S S^T F^T,

    cost(r) = c * sum_{i > r} q_i * gamma_i,    q_i = u_i^T F S F^T u_i,   gamma_i = u_i^T G u_i:

the whitened spectrum weighted, direction by direction, by how much the loss cares about each output direction.
Per layer the pass keeps one min(out, in)-square matrix: G itself where out <= in, else F^T G F (in x in, the
gradient carried back through F), from which gamma_i = w_i^T (F^T G F) w_i with u_i = F w_i.

Supported: Linear, transformers' Conv1D and embeddings (one group); other layers get tier 1's curve scaled by the
median ratio of gradient cost to tier-1 cost over the layers that have gradients.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypedDict

import numpy as np
import torch
from torch import nn

from ... import kinds, lrmath
from ..._env import trim_heap
from ...errors import AuditError, first_line
from ...results import Layer
from ..data.inputs import Batch, Calibration, eval_mode, model_device
from ..measure.metric import Metric, main_output
from ..metrics.common import row_mask
from ..statistics.stats import InputStatistics, LayerInput, by_name, module_path
from ..statistics.whiten import (DAMP, LossMetric, Truncator, WhitenedSpectrum, function_matrices, save_spilled,
                                 weighted_bases)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..metrics.chunks import Scored
    from ..statistics.stream import Blocks

GRADIENT_KINDS = kinds.registry.KindSet(lambda k: k.gradient_sensitivity, "read by the gradient pass")  # live view
SAMPLES = 2  # random projections (output error) or sampled label sets (likelihood metrics) per fit batch


@dataclass
class OutputGradients:
    """Per layer the accumulated second moment of the output gradient (``second``: sum over positions and samples,
    min(out, in) square; ``carried``: it is F^T G F, in input space, because out > in), how many position-samples it
    sums, the metric's scale ``c`` and whether costs are in the metric's own units (``linear``: likelihood metrics,
    which add up across layers) or squared (the relative output error, whose squares add up)."""

    second: "dict[str, np.ndarray] | Moments"  # a Moments in output_gradients' result (one part in memory)
    count: dict[str, int]
    carried: dict[str, bool]
    scale: float
    linear: bool
    passes: int  # backward passes run
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it has no gradient statistics
    unreachable: dict[str, str] = field(default_factory=dict)  # hooked layers no gradient reached -> why


def _out_in(layer: Layer) -> tuple[int, int]:
    """(out, in) of the layer's function matrix (the kind's: an embedding's is (dim, vocabulary))."""
    return kinds.for_kind(layer.kind).function_shape(layer)


def _function_view(layer: Layer, weight: torch.Tensor) -> torch.Tensor:
    """F (out x in) as a view of the stored weight, for carrying an output gradient back: g @ F (the kind's)."""
    return kinds.for_kind(layer.kind).function_view(layer, weight)


CARRY_VALUES = 1 << 24  # an output gradient larger than this (a wide head's) is carried back a chunk of rows at a time


def _carried_in_chunks(g: torch.Tensor, keep: torch.Tensor | None, f: torch.Tensor) -> torch.Tensor:
    """g's real rows (``keep``) carried back through F (out x in), float32 (rows, in), the rows gathered and cast a
    chunk at a time: never a second copy of a wide head's output gradient (rows x vocabulary)."""
    if keep is None or g.dim() != 3 or tuple(g.shape[:2]) != tuple(keep.shape):  # every row counts
        g = g.reshape(-1, g.shape[-1])
        keep = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
    where = keep.nonzero(as_tuple=True)
    n = int(where[0].shape[0])
    out = torch.empty(n, f.shape[1], dtype=torch.float32, device=g.device)
    step = max(1, CARRY_VALUES // (4 * max(1, int(g.shape[-1]))))
    for i in range(0, n, step):
        s = slice(i, min(i + step, n))
        out[s] = g[tuple(w[s] for w in where)].float() @ f
    return out


def output_gradients(model: nn.Module, layers: dict[str, Layer] | list[Layer], calibration: Calibration,
                     metric: Metric, samples: int = SAMPLES, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> OutputGradients:
    """One forward and ``samples`` backward passes per fit batch, every supported layer's output through a tap
    (:class:`_Tap`) that adds its gradient up as the backward reaches it (rows with ``attention_mask`` 0 left out,
    as in the statistics), so one output gradient is alive at a time. The model runs where it is, in eval mode; no
    parameter's ``requires_grad`` or ``.grad`` is touched (the graph starts at the taps). Where the model
    has repeated blocks (:func:`~auditor.calibration.statistics.stream.find_blocks`) each block runs checkpointed
    (``torch.utils.checkpoint``, non-reentrant): the backward recomputes one block's activations at a time, so the
    activations alive at once are the blocks' inputs and one block's, not every block's."""
    if not metric.spec.gradient:
        raise AuditError("gradient sensitivity needs a built-in metric", "Use --probe with a user metric")
    t0 = time.perf_counter()
    named = by_name(layers)
    acc = _Accumulator(named, dict(model.named_parameters(remove_duplicate=False)))
    device = model_device(model)
    cap = _Capture(model, acc.hook_paths(dict(model.named_modules(remove_duplicate=False))), device)
    found = _blocks(model, [named[n] for n in acc.carried])
    acc.second.budget = _part_bytes(found, [named[n] for n in acc.carried])
    spec = metric.spec
    pass_ = _Pass(spec.gradient == "likelihood", spec.scored_positions, samples, torch.Generator().manual_seed(seed),
                  device, embedding=spec.embedding if spec.gradient == "embedding" else None)
    batches = calibration.fit
    try:
        with eval_mode(model), torch.enable_grad(), _checkpointed(found):
            for i, b0 in enumerate(batches):
                done = _one_batch(model, b0.to(pass_.device), i, cap, acc, pass_)
                trim_heap()  # the batch's freed activations, gradients and terms handed back
                if not done:
                    break
                if progress is not None:
                    progress(i + 1, len(batches))
    finally:
        cap.remove()
    acc.close()
    if acc.lost:
        pass_.norm2 = pass_.scored = 0
    linear = pass_.likelihood or pass_.embedding is not None
    scale = ((1.0 / (2.0 * pass_.scored) if pass_.scored else 0.0) if linear
             else (1.0 / pass_.norm2 if pass_.norm2 > 0 else 0.0))
    return OutputGradients(acc.second, acc.count, acc.carried, scale, linear, pass_.passes,
                           time.perf_counter() - t0, acc.skipped, acc.unreachable)


NO_GRAD_OUTPUT = ("the model's output does not require grad (its forward detaches it, runs under torch.no_grad(), "
                  "goes through numpy or returns integers)")
NOT_REACHED = "no gradient reached its output (the forward detaches it or runs it under torch.no_grad())"


@dataclass
class _Pass:
    """The pass's settings and running totals: a likelihood metric (labels sampled from the model), the output
    error (random projections of the output) or a row-embedding metric (random projections of the metric's unit row
    embeddings, ``embedding``); the dense output's squared norm or the positions (rows) scored; backward passes run."""

    likelihood: bool
    scored_of: Callable[..., Scored] | None  # the metric's scored positions of an output and its batch (chunked)
    samples: int
    gen: torch.Generator
    device: torch.device
    norm2: float = 0.0
    scored: int = 0
    passes: int = 0
    embedding: Callable[..., torch.Tensor] | None = None  # the metric's unit row embeddings of an output and its batch


class _Accumulator:
    """Per layer the summed second moment of its output gradient (min(out, in) square: the gradient carried back
    through F where out > in), and the position-samples summed."""

    def __init__(self, named: dict[str, Layer], params: dict[str, torch.Tensor]) -> None:
        self.named, self.params = named, params
        self.second = Moments()  # one part's in memory once its budget is set, the rest on disk
        self.count: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self.unreachable: dict[str, str] = {}  # hooked layers no gradient reached -> why
        self.lost = ""  # why no hooked layer gets a gradient (the output needs none, the backward failed)
        self.hooked: dict[str, list[str]] = {}  # module path -> layers whose output it gives
        self.carried: dict[str, bool] = {}

    def hook_paths(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The modules to hook (path -> module); layers without one are ``skipped`` with the reason."""
        for name, layer in self.named.items():
            if layer.kind not in GRADIENT_KINDS or layer.param not in self.params:
                self.skipped[name] = f"no output gradient for {layer.kind} layers"
                continue
            path = module_path(layer)[0]
            if path not in modules:
                self.skipped[name] = "its module is not found"
                continue
            self.hooked.setdefault(path, []).append(name)
        self.carried = {n: _out_in(self.named[n])[0] > _out_in(self.named[n])[1]
                        for ns in self.hooked.values() for n in ns}
        return {p: modules[p] for p in self.hooked}

    def terms(self, path: str, g: torch.Tensor, keep: torch.Tensor | None) -> list[tuple[str, np.ndarray, int]]:
        """One output gradient of the module at ``path`` as its layers' terms: (layer, g^T g in float64 (carried
        through F where out > in), positions), the rows with ``attention_mask`` 0 left out."""
        out: list[tuple[str, np.ndarray, int]] = []
        for name in self.hooked[path]:
            layer = self.named[name]
            gg = g.detach()
            if self.carried[name] and gg.numel() > CARRY_VALUES:  # a wide head's: its rows a chunk at a time
                gg = _carried_in_chunks(gg, keep, _function_view(layer, self.params[layer.param].detach()).float())
            else:
                if keep is not None and gg.dim() == 3 and tuple(gg.shape[:2]) == tuple(keep.shape):
                    gg = gg[keep]
                gg = gg.reshape(-1, gg.shape[-1]).float()
                if self.carried[name]:
                    gg = gg @ _function_view(layer, self.params[layer.param].detach()).float()
            out.append((name, (gg.T @ gg).double().cpu().numpy(), int(gg.shape[0])))
        return out

    def put(self, terms: list[tuple[str, np.ndarray, int]]) -> None:
        """Terms (:meth:`terms`) added to their layers' second moments and position counts."""
        for name, s, rows in terms:
            self.second.add(name, s)
            self.count[name] = self.count.get(name, 0) + rows

    def close(self) -> None:
        """Every hooked layer without statistics is unreachable, with the reason; when the pass was ``lost`` (no
        backward could run) every one is, and what earlier batches gathered is dropped."""
        for name in [n for ns in self.hooked.values() for n in ns]:
            if self.lost and name in self.second:
                del self.second[name]
                self.count.pop(name, None)
            if name not in self.second:
                self.unreachable[name] = self.lost or NOT_REACHED


class _Tap(torch.autograd.Function):
    """The identity on a hooked module's output whose backward hands the output's gradient (every use of it
    summed, as autograd gives a node) to ``cap`` as it runs and passes it on unchanged. It also takes the pass's
    ``dummy`` leaf, so that one ``torch.autograd.grad(loss, [dummy])`` runs every tap and keeps no gradient."""

    @staticmethod
    def forward(ctx: object, out: torch.Tensor, dummy: torch.Tensor, cap: "_Capture | None",
                index: int) -> torch.Tensor:
        ctx.cap, ctx.index = cap, index  # type: ignore[attr-defined]
        return out.detach()  # an alias, not a view: the user's forward may change it in place

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cap = ctx.cap  # type: ignore[attr-defined]
        if cap is not None and cap.sink is not None:
            cap.sink(ctx.index, g)  # type: ignore[attr-defined]
        return g, None, None, None


class _Capture:
    """Forward hooks routing every hooked module's floating-point output through a :class:`_Tap`: the forward being
    recorded names each call (``calls``: the module's path, in call order) and the backward hands each output's
    gradient to ``sink(call, gradient)`` as its node runs, so one output gradient is alive at a time (not one per
    hooked layer until the backward ends). The outputs themselves are freed when the forward is done with them. An
    output that needs no gradient gets one through the tap (its ``dummy`` leaf), so the graph starts there. While
    ``recording`` is off (a checkpointed block recomputed in the backward) the hooks build the same graph, with taps
    that hand nothing on."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module], device: torch.device) -> None:
        self.calls: list[str] = []
        self.recording = True
        self.sink: Callable[[int, torch.Tensor], None] | None = None
        self.dummy = torch.zeros((), device=device, requires_grad=True)
        self.handles = [m.register_forward_hook(self._hook(p)) for p, m in modules.items()]

    def _hook(self, path: str) -> Callable[..., object]:
        def fn(mod: nn.Module, args: object, out: object) -> object:
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return None
            if not self.recording:
                return _Tap.apply(out, self.dummy, None, -1)
            self.calls.append(path)
            return _Tap.apply(out, self.dummy, self, len(self.calls) - 1)
        return fn

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.calls.clear()


class _Sink:
    """One backward pass's gradients as the taps hand them on: each added to its layers' moments at once, except
    those of a module called more than once in the forward, whose terms are held (the terms, not the gradients)
    and added in call order when the backward is done: the same float64 additions in the same order as the
    gradients of every call returned together and added in call order."""

    def __init__(self, acc: _Accumulator, calls: list[str], keep: torch.Tensor | None) -> None:
        self.acc, self.calls, self.keep = acc, calls, keep
        seen: dict[str, int] = {}
        for path in calls:
            seen[path] = seen.get(path, 0) + 1
        self.repeated = {p for p, n in seen.items() if n > 1}
        self.held: dict[int, list[tuple[str, np.ndarray, int]]] = {}

    def __call__(self, call: int, g: torch.Tensor) -> None:
        path = self.calls[call]
        terms = self.acc.terms(path, g, self.keep)
        if path in self.repeated:
            self.held[call] = terms
        else:
            self.acc.put(terms)

    def close(self) -> None:
        """The held terms added, in call order."""
        for call in sorted(self.held):
            self.acc.put(self.held.pop(call))


def _one_batch(model: nn.Module, b: Batch, i: int, cap: _Capture, acc: _Accumulator, p: _Pass) -> bool:
    """One fit batch: the forward, then ``samples`` backward passes whose output gradients are added up as each
    tap's node runs. False when nothing hooked needs a gradient (nothing more to gather), or when no backward can
    run (``acc.lost`` says why: the loss needs no gradient, or autograd failed going back through the user's
    forward)."""
    cap.calls.clear()
    cap.recording = True
    try:
        out = model(*b.args, **b.kwargs)
        y = main_output(out) if p.embedding is None else p.embedding(out, b)
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - a batch the forward refuses, said in one line
        raise AuditError(f"the forward failed on fit batch {i} while reading output gradients: "
                         f"{first_line(exc)}", "Give every batch the inputs the model takes") from None
    cap.recording = False
    keep = row_mask(b)
    losses = _losses(y, b, keep, p)
    if not cap.calls:
        return False
    for k, loss in enumerate(losses):
        value = loss()
        if not value.requires_grad:  # nothing the model computed reaches the metric through autograd
            acc.lost = NO_GRAD_OUTPUT
            return False
        if not _backward(value, cap, _Sink(acc, list(cap.calls), keep), k < p.samples - 1, acc):
            return False
        p.passes += 1
    cap.calls.clear()
    return True


def _backward(value: torch.Tensor, cap: _Capture, sink: _Sink, retain: bool, acc: _Accumulator) -> bool:
    """One backward from ``value`` through every tap, each gradient handed to ``sink`` as its node runs; False
    (``acc.lost`` says why) when autograd fails going back through the user's forward."""
    cap.sink = sink
    try:
        torch.autograd.grad(value, [cap.dummy], retain_graph=retain, allow_unused=True)
    except (AuditError, torch.OutOfMemoryError):
        raise
    except RuntimeError as exc:  # the user's forward built a graph autograd cannot go back through
        acc.lost = f"the backward pass failed: {first_line(exc)}"
        return False
    finally:
        cap.sink = None
    sink.close()
    return True


def _losses(y: torch.Tensor, b: Batch, keep: torch.Tensor | None, p: _Pass) -> list[Callable[[], torch.Tensor]]:
    """The ``samples`` losses to differentiate, each drawn when called (in order, from the pass's generator): the
    negative log-likelihood of labels sampled from the model, or a random projection of the (masked) output or of
    the metric's row embeddings."""
    if p.likelihood:
        sc = p.scored_of(y, b)  # read a chunk of positions at a time: no full-vocabulary copy but the output's own
        p.scored += len(sc)

        def nll() -> torch.Tensor:
            return sc.nll(sc.sample(p.gen).to(p.device))

        return [nll] * p.samples
    if p.embedding is not None:  # unit rows (zero where a row does not count): 1 - cos = ||de||^2 / 2 a row
        yy = y
        p.scored += int((y.detach().abs().sum(-1) > 0).sum())
    else:
        yy = y if keep is None or y.dim() != 3 or tuple(y.shape[:2]) != tuple(keep.shape) else y * keep[..., None]
        p.norm2 += float(yy.detach().double().pow(2).sum())

    def projection() -> torch.Tensor:
        w = torch.randn(yy.shape, generator=p.gen, dtype=torch.float32).to(device=p.device, dtype=yy.dtype)
        return (w * yy).sum()

    return [projection] * p.samples


def _blocks(model: nn.Module, layers: list[Layer]) -> "Blocks | None":
    """The model's repeated blocks holding most of ``layers`` (:func:`~auditor.calibration.statistics.stream.find_blocks`)."""
    from ..statistics.stream import find_blocks

    return find_blocks(model, layers) if layers else None


def _moment_bytes(layer: Layer) -> int:
    return 8 * min(_out_in(layer)) ** 2


def _part_bytes(found: "Blocks | None", layers: list[Layer]) -> int | None:
    """The second moments of the largest part of the model: one block's layers together, or one layer outside the
    blocks; None (no limit) without repeated blocks."""
    if found is None:
        return None
    parts = [sum(_moment_bytes(l) for l in ls) for ls in found.layers]
    return max([*parts, *(_moment_bytes(l) for l in found.outside)], default=0)


class Moments(MutableMapping):
    """Per layer a float64 matrix summed batch by batch, at most ``budget`` bytes of them in memory (None: all); the
    others in ``.npy`` files in a temporary directory, added to in place in a memory map of the file (no copy in the
    heap). The sums are the same either way (the same float64 additions in the same order); what is alive at once
    is one part of the model's."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.bytes = 0
        self.mem: dict[str, np.ndarray] = {}
        self.files: dict[str, str] = {}
        self._dir: "tempfile.TemporaryDirectory[str] | None" = None

    def add(self, name: str, s: np.ndarray) -> None:
        """``s`` added to ``name``'s sum (its first term when there is none)."""
        if name in self.mem:
            self.mem[name] += s
        elif name in self.files:  # added in place in a map of its file: no copy of it in the heap
            try:
                a = np.load(self.files[name], mmap_mode="r+", allow_pickle=False)
                a += s
                a.flush()
            except OSError as exc:
                raise AuditError(f"cannot write the output gradients' second moments to {self._dir.name}: "
                                 f"{exc.strerror or exc}",
                                 "Free disk space there, or set TMPDIR to a directory with room") from None
            del a
        else:
            self[name] = s

    def __setitem__(self, name: str, a: np.ndarray) -> None:
        if name in self:
            del self[name]
        if self.budget is None or self.bytes + a.nbytes <= self.budget:
            self.mem[name] = a
            self.bytes += a.nbytes
            return
        import tempfile

        from ..._env import scratch_prefix, sweep_scratch

        if self._dir is None:
            sweep_scratch()  # a killed run's folders first
            self._dir = tempfile.TemporaryDirectory(prefix=scratch_prefix("moments"))
        self.files[name] = os.path.join(self._dir.name, f"m{len(self.files)}.npy")
        save_spilled(self.files[name], a, "the output gradients' second moments")

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.mem:
            return self.mem[name]
        return np.load(self.files[name], allow_pickle=False)

    def __delitem__(self, name: str) -> None:
        if name in self.mem:
            self.bytes -= self.mem.pop(name).nbytes
        else:
            os.unlink(self.files.pop(name))

    def __iter__(self) -> Iterator[str]:
        return iter([*self.mem, *self.files])

    def __len__(self) -> int:
        return len(self.mem) + len(self.files)

    def __contains__(self, name: object) -> bool:
        return name in self.mem or name in self.files


@contextlib.contextmanager
def _checkpointed(found: "Blocks | None") -> Iterator[None]:
    """While the block runs, each repeated block (``found``, where the model has them) runs through
    ``torch.utils.checkpoint`` (non-reentrant), without the key/value caches it would fill (they would grow when
    the block is recomputed)."""
    from torch.utils.checkpoint import checkpoint

    from ..statistics.stream import kept_args, kept_kwargs, patched_forwards

    def wrap(_i: int, blk: nn.Module) -> Callable[..., object]:
        fwd = blk.forward

        def run(*args: object, **kwargs: object) -> object:
            return checkpoint(fwd, *kept_args(args), use_reentrant=False, **kept_kwargs(kwargs))
        return run

    with patched_forwards(list(found.blocks) if found is not None else [], wrap):
        yield


def gradient_costs(layer: Layer, weight: torch.Tensor, inp: LayerInput, grads: OutputGradients,
                   damp: float = DAMP) -> np.ndarray:
    """cost[r] for r = 0..k: the predicted model-level cost of the layer truncated alone (whitened) at rank r, in
    the metric's cost units (squared relative output error, or nats of cross-entropy)."""
    f = function_matrices(layer, weight)[0]
    m, n = f.shape
    h = grads.second[layer.name] / max(grads.count[layer.name], 1)  # G: a mean over positions (S: a sum)
    gram = np.diag(inp.gram) if inp.diagonal else inp.gram[0]
    diag = np.diagonal(gram)
    scale_g = float(np.mean(diag)) if diag.size else 0.0
    lam = damp * scale_g if scale_g > 0 else damp
    if m <= n:
        mm = (f @ gram) @ f.T
        mm = (mm + mm.T) / 2
        vals, vecs = np.linalg.eigh(mm + lam * (f @ f.T))
        u = vecs[:, np.argsort(vals)[::-1]]
        q = np.sum((u.T @ mm) * u.T, axis=1)
        if grads.carried[layer.name]:  # cannot happen (carried means out > in); kept for a clear error
            raise ValueError(f"{layer.name}: gradient carried to input space for a wide map")
        gamma = np.sum((u.T @ h) * u.T, axis=1)
    else:
        s = np.linalg.cholesky(gram + lam * np.eye(n))
        a = f.T @ f
        a = (a + a.T) / 2
        kk = s.T @ a @ s
        vals, v = np.linalg.eigh((kk + kk.T) / 2)
        order = np.argsort(vals)[::-1]
        sig = np.sqrt(np.clip(vals[order], 0.0, None))
        keep = sig > sig[0] * 1e-13 if sig.size and sig[0] > 0 else np.zeros(len(sig), dtype=bool)
        w = np.zeros((n, n))
        w[:, keep] = (s @ v[:, order][:, keep]) / sig[keep]
        t = w.T @ a
        q = np.sum((t @ gram) * t, axis=1)
        if not grads.carried[layer.name]:
            raise ValueError(f"{layer.name}: gradient not carried to input space for a tall map")
        gamma = np.sum((w.T @ h) * w.T, axis=1)
    contrib = np.clip(q, 0.0, None) * np.clip(gamma, 0.0, None)
    tail = np.concatenate([np.cumsum(contrib[::-1])[::-1], [0.0]])  # tail[r] = sum_{i >= r} (0-based): rank r
    return grads.scale * tail


def loss_aware(layer: Layer, weight: torch.Tensor, inp: LayerInput, grads: OutputGradients,
               damp: float = DAMP, bases: "Callable[..., Any] | None" = None) -> tuple[np.ndarray, Truncator] | None:
    """(cost[r] for r = 0..k, the truncator) of the layer's loss-aware truncation: the rank-r map F_r minimising
    the KFAC cost trace(G (F - F_r) S (F - F_r)^T) itself, not only its input-whitened part (G the output-gradient
    moment, S the input statistics: :func:`~auditor.calibration.statistics.whiten.weighted_bases`). cost[r] = c * (the dropped squared singular values).
    None where the layer's gradient moment is zero (no gradient reached it). ``bases``: what makes the truncation
    (default :func:`~auditor.calibration.statistics.whiten.weighted_bases` here; ``ondevice.weighted``'s on a
    device)."""
    f = function_matrices(layer, weight)[0]
    h = grads.second[layer.name] / max(grads.count[layer.name], 1)
    gram = inp.gram if inp.diagonal else inp.gram[0]
    cut = (bases or weighted_bases)(f, gram, inp.diagonal, h, grads.carried[layer.name], damp,
                                    grads.count[layer.name])
    if cut is None:
        return None
    sigma2, bases = cut
    tail = np.concatenate([np.cumsum(sigma2[::-1])[::-1], [0.0]])
    return grads.scale * tail, Truncator.from_bases(layer, weight, f[None], bases)


class MeanMoments(Mapping):
    """Per layer (the output-gradient moment as a mean over positions, whether it is carried to input space, the
    position-samples it is a mean over), read
    from the pass's :class:`Moments` when asked (one part in memory, the rest on disk, as the pass left them): what
    the sequential fit truncates in (:func:`~auditor.calibration.statistics.sequential.sequential_truncators`)."""

    def __init__(self, grads: OutputGradients) -> None:
        self.grads = grads

    def __getitem__(self, name: str) -> tuple[np.ndarray, bool, int]:
        g = self.grads
        return g.second[name] / max(g.count[name], 1), g.carried[name], g.count[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.grads.second)

    def __len__(self) -> int:
        return len(self.grads.second)


@dataclass
class GradientSensitivity:
    """Per layer the predicted cost at every rank (``costs[name][r]``), how it was had, and what it cost."""

    costs: dict[str, list[float]]
    linear: bool
    scaled: dict[str, float]  # layers costed by tier 1 times the median ratio (no gradient): the ratio used
    passes: int
    seconds: float
    skipped: dict[str, str]
    unreachable: dict[str, str] = field(default_factory=dict)  # layers of a kind hooked that no gradient reached
    moments: "MeanMoments | None" = field(default=None, repr=False)  # with ``store``: the mean output-gradient
    #                       moments, for the sequential fit
    store: "MutableMapping[str, Truncator] | None" = field(default=None, repr=False)  # the loss-aware truncations

    def loss_metric(self, layers: list[Layer]) -> LossMetric | None:
        """What the pass leaves ``factorize`` (its loss-aware truncations and moments over ``layers``), or None when
        it kept none (run without a store)."""
        if self.store is None or self.moments is None:
            return None
        return LossMetric(self.store, self.moments, frozenset(l.name for l in layers))

    def predicted(self, plan: dict[str, int]) -> float:
        """A plan's summed predicted cost over the layers this knows (the others: nothing)."""
        return sum(self.costs[k][min(r, len(self.costs[k]) - 1)] for k, r in plan.items() if k in self.costs)


@dataclass
class GradientSettings:
    """How the output gradients are gathered: ``samples`` random projections or sampled label sets per fit batch,
    the generator's ``seed``, and ``progress(batches done, batches)``."""

    samples: int = SAMPLES
    seed: int = 0
    progress: Callable[[int, int], None] | None = None
    store: "MutableMapping[str, Truncator] | None" = None  # given: the loss-aware truncations go here, costed as cut
    bases: "Callable[..., Any] | None" = None  # what makes them (loss_aware's ``bases``): None, NumPy here


class GradientFields(TypedDict, total=False):
    """The keywords of :func:`gradient_sensitivity`: :class:`GradientSettings`' fields."""

    samples: int
    seed: int
    progress: Callable[[int, int], None] | None
    store: "MutableMapping[str, Truncator] | None"
    bases: "Callable[..., Any] | None"


def gradient_sensitivity(model: nn.Module, layers: dict[str, Layer] | list[Layer], calibration: Calibration,
                         metric: Metric, stats: InputStatistics, spectra: dict[str, WhitenedSpectrum],
                         **fields: Unpack[GradientFields]) -> GradientSensitivity:
    """Every layer's predicted cost curve from one backward pass per sample (:func:`output_gradients`) and its input
    statistics; layers without gradients (other kinds, and the ``unreachable`` ones no gradient reached, which the
    audit's stage probes instead) get tier 1's squared error times the median ratio. With ``store`` each layer with
    a gradient is truncated loss-aware (:func:`loss_aware`), its truncator put in ``store`` and its costs those of
    that truncation; without, the costs are the input-whitened truncation's (:func:`gradient_costs`).
    The settings as keywords (:class:`GradientFields`: ``samples``, ``seed``, ``progress``, ``store``, ``bases``)."""
    o = GradientSettings(**fields)
    named = by_name(layers)
    grads = output_gradients(model, named, calibration, metric, o.samples, o.seed, o.progress)
    t = time.perf_counter()
    costs: dict[str, list[float]] = {}
    ratios: list[float] = []
    for name, c in _layer_costs(model, named, stats, grads, o.store, o.bases):
        costs[name] = c.tolist()
        spec = spectra.get(name)
        if spec is not None:
            r = min(max(spec.suggested or spec.rank_for(0.01), 1), len(c) - 1)
            e2 = spec.error_at(r) ** 2
            if e2 > 0 and c[r] > 0:
                ratios.append(float(c[r]) / e2)
    scaled: dict[str, float] = {}
    if ratios:
        ratio = float(np.median(ratios))
        for name in named:
            spec = spectra.get(name)
            if name not in costs and spec is not None:
                costs[name] = [ratio * e * e for e in spec.error]
                scaled[name] = ratio
    skipped = {k: v for k, v in grads.skipped.items() if k not in costs}
    return GradientSensitivity(costs, grads.linear, scaled, grads.passes,
                               grads.seconds + time.perf_counter() - t, skipped, dict(grads.unreachable),
                               MeanMoments(grads) if o.store is not None else None, o.store)


def _layer_costs(model: nn.Module, named: dict[str, Layer], stats: InputStatistics, grads: OutputGradients,
                 store: "MutableMapping[str, Truncator] | None",
                 bases: "Callable[..., Any] | None" = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, cost curve) of every layer with a gradient and statistics, in the layers' order: its loss-aware
    truncation's (put into ``store``) with a store, else the input-whitened one's (:func:`gradient_costs`). The
    decompositions run on every core at once, each on one BLAS thread (``whiten.on_every_core``, as tier 1's), and
    are taken in the layers' order; each truncator is put into the store (which takes them from several threads) by the
    thread that made it, so no more than one layer's decomposition per thread is alive at once."""
    from ..statistics.whiten import on_every_core

    params = dict(model.named_parameters(remove_duplicate=False))
    todo = [(name, layer) for name, layer in named.items() if name in grads.second and name in stats.layers]

    def one(t: tuple[str, Layer]) -> np.ndarray | None:
        name, layer = t
        inp = stats.layers[name]  # read here: a spilled Gram is mapped and checked as its layer is cut
        if inp.groups != 1:
            return None
        cut = loss_aware(layer, params[layer.param], inp, grads, bases=bases) if store is not None else None
        if cut is None:
            return gradient_costs(layer, params[layer.param], inp, grads)
        assert store is not None
        store[name] = cut[1].cut()  # cut here, on this thread, whatever mapping the store is (the same factors)
        return cut[0]

    for (name, _), c in zip(todo, on_every_core(one, todo)):
        trim_heap()  # its eigendecomposition's arrays handed back
        if c is not None:
            yield name, c


def predicted_value(cost: float, linear: bool) -> float:
    """A summed cost as the metric's value: itself for a likelihood metric, its square root for the output error."""
    return cost if linear else math.sqrt(max(cost, 0.0))


__all__ = ["GRADIENT_KINDS", "GradientSensitivity", "GradientSettings", "Moments", "OutputGradients",
           "gradient_costs", "gradient_sensitivity", "loss_aware", "MeanMoments", "output_gradients", "predicted_value"]
