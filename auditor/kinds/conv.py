"""Convolutions (``nn.Conv1d/2d/3d``, and the transposed ones, which are found and viewed but cannot be factorized).

A convolution's weight (out, in/g, *kernel) is ``g`` matrices of out/g x in/g * prod(kernel); a transposed one's
(in, out/g, *kernel) is read per group as out/g x in/g * prod(kernel). Statistics: the unfolded input patches, with
the module's own padding, stride and dilation. Replacement: the same convolution with r outputs per group (no
bias), then a 1x1 convolution to the original outputs (groups kept, bias as before)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..results import Kind, Layer
from ._weights import call_weight, only_weight
from .base import Cost, Feeds, LayerKind, LayerSpec, MatrixView, Shape, fill


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    g = mod.groups
    k = math.prod(shape[2:])
    ks = "x".join(str(s) for s in shape[2:])
    if mod.transposed:
        cin, cout_g = shape[0], shape[1]
        m, n = cout_g, (cin // g) * k
        view = f"(in, out/g, {ks}) viewed as out/g x in/g*{ks} per group"
        kind = Kind.CONV_TRANSPOSE
    else:
        cout, cin_g = shape[0], shape[1]
        m, n = cout // g, cin_g * k
        view = f"(out, in/g, {ks}) viewed as out/g x in/g*{ks} per group"
        kind = Kind.CONV
    if g == 1:
        view = view.replace("/g", "").replace(" per group", "")
    return MatrixView(kind, m, n, g, view)


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    kernel = math.prod(mod.kernel_size)
    if mod.transposed:  # weight (in, out/g, *kernel): each input element meets out/g * kernel weights
        k = mod.out_channels // mod.groups * kernel
        return [] if x is None else [Cost("weight", "conv_transpose", math.prod(x) * k)]
    k = mod.in_channels // mod.groups * kernel  # weight (out, in/g, *kernel)
    return [] if out is None else [Cost("weight", "conv", math.prod(out) * k)]


SPEC = LayerSpec(only_weight, _view, _cost)


def conv_patches(mod: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """The unfolded input patches of a (non-transposed) convolution: (N * positions, in_channels * prod(kernel)),
    columns ordered (channel, kernel offsets) as the weight (out, in/g, *kernel) is flattened."""
    nd = len(mod.kernel_size)
    if x.dim() == nd + 1:  # unbatched
        x = x[None]
    pad = list(mod._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        x = nn.functional.pad(x, pad, mode=mode)
    for d in range(nd):
        k, s, dil = mod.kernel_size[d], mod.stride[d], mod.dilation[d]
        x = x.unfold(2 + d, dil * (k - 1) + 1, s)
        if dil > 1:
            x = x[..., ::dil]
    # x: (N, C, L1..Lnd, k1..knd) -> (N, L1..Lnd, C, k1..knd)
    perm = [0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)]
    x = x.permute(perm)
    return x.reshape(-1, mod.in_channels * math.prod(mod.kernel_size))


class ConvKind(LayerKind):
    kind = Kind.CONV
    label = "Conv1d/2d/3d"
    finds = {nn.modules.conv._ConvNd: SPEC,
             torch.ao.nn.quantized.modules.conv._ConvNd: LayerSpec(lambda m: ("weight",), _view, _cost, call_weight)}
    swept = True
    cut_to_rank1 = True
    timed = True

    def timing_shape(self, shape: Shape, lead: Shape) -> Shape:
        """The batch becomes ``lead[0]``; the channels and spatial size stay the model's."""
        return (lead[0], *shape[1:])

    def timing_outputs(self, shape: Shape, layer: Layer) -> int:
        """About the input's size times out/in channels."""
        numel = math.prod(shape)
        return numel * layer.m // max(int(shape[1]), 1) if len(shape) > 1 else numel * layer.m

    def guess(self, name: str, shape: Shape) -> tuple[int, int, str] | None:
        if len(shape) <= 2:
            return None
        return shape[0], math.prod(shape[1:]), f"{len(shape)}-D kernel viewed as dim0 x prod(rest)"

    def accepts(self, mod: nn.Module) -> bool:
        return isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed

    def function_matrices(self, layer: Layer, w: torch.Tensor) -> np.ndarray:
        return w.reshape(layer.groups, layer.m, layer.n).numpy()

    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        for layer in layers:
            feed = feeds.rows(layer, layer.n, layer.groups)
            feeds.hook(mod, lambda m, a, feed=feed: feed.add_rows(conv_patches(m, a[0])))

    def replace(self, layer, mod, r, a, b):
        assert isinstance(mod, nn.modules.conv._ConvNd)
        w, bias = mod.weight, mod.bias
        kw = dict(device=w.device, dtype=w.dtype)
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(mod.kernel_size)]
        g = mod.groups
        first = cls(mod.in_channels, g * r, mod.kernel_size, stride=mod.stride, padding=mod.padding,
                    dilation=mod.dilation, groups=g, bias=False, padding_mode=mod.padding_mode, **kw)
        second = cls(g * r, mod.out_channels, 1, groups=g, bias=bias is not None, **kw)
        if a is not None and b is not None:
            fill(first.weight, b)  # (g, r, in/g * k) -> (g*r, in/g, *k)
            fill(second.weight, a)  # (g, out/g, r) -> (out, r, 1...)
        if bias is not None:
            with torch.no_grad():
                second.bias.copy_(bias)
        return nn.Sequential(first, second)


def _transpose_matrices(t: torch.Tensor, g: int, m: int, n: int) -> torch.Tensor:
    k = math.prod(t.shape[2:])
    cin_g = t.shape[0] // g
    return t.reshape(g, cin_g, m, k).permute(0, 2, 1, 3).reshape(g, m, n)


class ConvTransposeKind(LayerKind):
    """Found by :class:`ConvKind` (one module type, two views); neither swept nor suggested: no replacement."""

    kind = Kind.CONV_TRANSPOSE
    cannot_factorize = ("factorize() has no two-module replacement for a transposed convolution (its weight is read "
                        "(in, out/g, *kernel) by the adjoint of a convolution)")

    def matrices(self, t: torch.Tensor, groups: int, m: int, n: int) -> torch.Tensor:
        return _transpose_matrices(t, groups, m, n)


KIND = ConvKind()
TRANSPOSE = ConvTransposeKind()
