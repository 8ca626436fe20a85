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
  KL and, to first order, the relative perplexity increase.

The truncation tier 3 applies at rank r keeps F_r = U_r U_r^T F (U the left singular vectors of the whitened F S,
:mod:`~auditor.calibration.whiten`), so D = (I - U_r U_r^T) F and, in the basis that diagonalises F S S^T F^T,

    cost(r) = c * sum_{i > r} q_i * gamma_i,    q_i = u_i^T F S F^T u_i,   gamma_i = u_i^T G u_i:

the whitened spectrum weighted, direction by direction, by how much the loss cares about each output direction.
Per layer the pass keeps one min(out, in)-square matrix: G itself where out <= in, else F^T G F (in x in, the
gradient carried back through F), from which gamma_i = w_i^T (F^T G F) w_i with u_i = F w_i.

Supported: Linear, transformers' Conv1D and embeddings (one group); other layers get tier 1's curve scaled by the
median ratio of gradient cost to tier-1 cost over the layers that have gradients.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .. import lrmath
from ..errors import AuditError, first_line
from ..results import Kind, Layer
from .inputs import Batch, Calibration, eval_mode, model_device
from .metric import Metric, _row_mask, main_output
from .stats import InputStatistics, LayerInput, _module_path, by_name
from .whiten import DAMP, WhitenedSpectrum, function_matrices

GRADIENT_KINDS = (Kind.LINEAR, Kind.CONV1D_HF, Kind.EMBEDDING)
SAMPLES = 2  # random projections (output error) or sampled label sets (likelihood metrics) per fit batch


@dataclass
class OutputGradients:
    """Per layer the accumulated second moment of the output gradient (``second``: sum over positions and samples,
    min(out, in) square; ``carried``: it is F^T G F, in input space, because out > in), how many position-samples it
    sums, the metric's scale ``c`` and whether costs are in the metric's own units (``linear``: likelihood metrics,
    which add up across layers) or squared (the relative output error, whose squares add up)."""

    second: dict[str, np.ndarray]
    count: dict[str, int]
    carried: dict[str, bool]
    scale: float
    linear: bool
    passes: int  # backward passes run
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)  # layer -> why it has no gradient statistics


def _out_in(layer: Layer) -> tuple[int, int]:
    """(out, in) of the layer's function matrix: an embedding's is (dim, vocabulary), the stored view transposed."""
    return (layer.n, layer.m) if layer.kind == Kind.EMBEDDING else (layer.m, layer.n)


def _function_view(layer: Layer, weight: torch.Tensor) -> torch.Tensor:
    """F (out x in) as a view of the stored weight, for carrying an output gradient back: g @ F."""
    if layer.kind == Kind.LINEAR:
        return weight
    return weight.t()  # transformers' Conv1D stores (in, out); an embedding (vocab, dim) is F^T


def output_gradients(model: nn.Module, layers: dict[str, Layer] | list[Layer], calibration: Calibration,
                     metric: Metric, samples: int = SAMPLES, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> OutputGradients:
    """One forward and ``samples`` backward passes per fit batch, gradient hooks on every supported layer's output
    (rows with ``attention_mask`` 0 left out, as in the statistics). The model runs where it is, in eval mode; no
    parameter's ``requires_grad`` or ``.grad`` is touched (the graph starts at the hooked outputs)."""
    if not metric.spec.gradient:
        raise AuditError("gradient sensitivity needs a built-in metric", "Use --probe with a user metric")
    t0 = time.perf_counter()
    named = by_name(layers)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    skipped: dict[str, str] = {}
    hooked: dict[str, list[str]] = {}  # module path -> layers whose output it gives
    for name, layer in named.items():
        if layer.kind not in GRADIENT_KINDS or layer.param not in params:
            skipped[name] = f"no output gradient for {layer.kind} layers"
            continue
        path = _module_path(layer)[0]
        if path not in modules:
            skipped[name] = "its module is not found"
            continue
        hooked.setdefault(path, []).append(name)
    second: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    carried = {n: _out_in(named[n])[0] > _out_in(named[n])[1] for ns in hooked.values() for n in ns}
    likelihood = metric.spec.gradient == "likelihood"
    gen = torch.Generator().manual_seed(seed)
    device = model_device(model)
    captured: list[tuple[str, torch.Tensor]] = []

    def hook(path: str) -> Callable[..., Any]:
        def fn(mod: nn.Module, args: Any, out: Any) -> Any:
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return None
            if not out.requires_grad:
                out = out.detach().requires_grad_(True)
            captured.append((path, out))
            return out
        return fn

    handles = [modules[p].register_forward_hook(hook(p)) for p in hooked]
    norm2 = 0.0
    scored = 0
    passes = 0
    batches = calibration.fit
    try:
        with eval_mode(model), torch.enable_grad():
            for i, b0 in enumerate(batches):
                b: Batch = b0.to(device)
                captured.clear()
                try:
                    y = main_output(model(*b.args, **b.kwargs))
                except AuditError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a batch the forward refuses, said in one line
                    raise AuditError(f"the forward failed on fit batch {i} while reading output gradients: "
                                     f"{first_line(exc)}", "Give every batch the inputs the model takes") from None
                keep = _row_mask(b)
                if likelihood:
                    logp, _ = metric.spec.logprobs(y, b)
                    scored += int(logp.shape[0])
                    probs = logp.detach().exp().cpu()
                else:
                    yy = y if keep is None or y.dim() != 3 or tuple(y.shape[:2]) != tuple(keep.shape) else y * keep[..., None]
                    norm2 += float(yy.detach().double().pow(2).sum())
                tensors = [t for _, t in captured if t.requires_grad]
                if not tensors:
                    break
                for k in range(samples):
                    if likelihood:
                        pick = torch.multinomial(probs, 1, generator=gen).to(device)
                        loss = -logp.gather(1, pick).sum()
                    else:
                        w = torch.randn(yy.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=yy.dtype)
                        loss = (w * yy).sum()
                    grads = torch.autograd.grad(loss, tensors, retain_graph=k < samples - 1, allow_unused=True)
                    passes += 1
                    for (path, t), g in zip([c for c in captured if c[1].requires_grad], grads):
                        if g is None:
                            continue
                        for name in hooked[path]:
                            layer = named[name]
                            gg = g.detach()
                            if keep is not None and gg.dim() == 3 and tuple(gg.shape[:2]) == tuple(keep.shape):
                                gg = gg[keep]
                            gg = gg.reshape(-1, gg.shape[-1]).float()
                            if carried[name]:
                                gg = gg @ _function_view(layer, params[layer.param].detach()).float()
                            s = (gg.T @ gg).double().cpu().numpy()
                            if name in second:
                                second[name] += s
                            else:
                                second[name] = s
                            count[name] = count.get(name, 0) + int(gg.shape[0])
                del captured[:]
                if progress is not None:
                    progress(i + 1, len(batches))
    finally:
        for h in handles:
            h.remove()
        captured.clear()
    if likelihood:
        scale = 1.0 / (2.0 * scored) if scored else 0.0
    else:
        scale = 1.0 / norm2 if norm2 > 0 else 0.0
    for name in [n for ns in hooked.values() for n in ns]:
        if name not in second:
            skipped[name] = "no gradient reached its output"
    return OutputGradients(second, count, carried, scale, likelihood, passes, time.perf_counter() - t0, skipped)


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


@dataclass
class GradientSensitivity:
    """Per layer the predicted cost at every rank (``costs[name][r]``), how it was had, and what it cost."""

    costs: dict[str, list[float]]
    linear: bool
    scaled: dict[str, float]  # layers costed by tier 1 times the median ratio (no gradient): the ratio used
    passes: int
    seconds: float
    skipped: dict[str, str]

    def predicted(self, plan: dict[str, int]) -> float:
        """A plan's summed predicted cost over the layers this knows (the others: nothing)."""
        return sum(self.costs[k][min(r, len(self.costs[k]) - 1)] for k, r in plan.items() if k in self.costs)


def gradient_sensitivity(model: nn.Module, layers: dict[str, Layer] | list[Layer], calibration: Calibration,
                         metric: Metric, stats: InputStatistics, spectra: dict[str, WhitenedSpectrum],
                         samples: int = SAMPLES, seed: int = 0,
                         progress: Callable[[int, int], None] | None = None) -> GradientSensitivity:
    """Every layer's predicted cost curve from one backward pass per sample (:func:`output_gradients`) and its input
    statistics; layers without gradients (other kinds) get tier 1's squared error times the median ratio."""
    named = by_name(layers)
    grads = output_gradients(model, named, calibration, metric, samples, seed, progress)
    t = time.perf_counter()
    params = dict(model.named_parameters(remove_duplicate=False))
    costs: dict[str, list[float]] = {}
    ratios: list[float] = []
    for name, layer in named.items():
        inp = stats.layers.get(name)
        if name not in grads.second or inp is None or inp.groups != 1:
            continue
        c = gradient_costs(layer, params[layer.param], inp, grads)
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
                               grads.seconds + time.perf_counter() - t, skipped)


def predicted_value(cost: float, linear: bool) -> float:
    """A summed cost as the metric's value: itself for a likelihood metric, its square root for the output error."""
    return cost if linear else math.sqrt(max(cost, 0.0))


__all__ = ["GRADIENT_KINDS", "GradientSensitivity", "OutputGradients", "gradient_costs", "gradient_sensitivity",
           "output_gradients", "predicted_value"]
