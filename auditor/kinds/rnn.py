"""LSTM / GRU / RNN gate matrices (``nn.RNNBase``): each 2-D parameter, gates stacked ((gates * hidden, in)).

Statistics: each layer's input sequence (``weight_ih``) and the hidden state the recurrence reads at each step
(``weight_hh``: h0, then the layer's own outputs shifted by one step, reversed for the backward direction), both
recomputed layer by layer with the module's own weights. Measured for their spectra and tier-1 curves, but the
fused recurrence reads the weights itself: there is no two-module replacement, so no suggestion to factorize and no
sweep."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from ..results import Kind, Layer
from .base import Cost, Feed, Feeds, LayerKind, LayerSpec, MatrixView, NamedByParameter, Shape


def _weights(mod: nn.Module) -> list[str]:
    return [n for n, p in mod.named_parameters(recurse=False) if p.dim() == 2]


def _view(mod: nn.Module, name: str, shape: Shape) -> MatrixView:
    gates = {"LSTM": 4, "GRU": 3}.get(mod.mode, 1)
    return MatrixView(Kind.RNN, shape[0], shape[1], 1, f"{gates} gate matrices stacked: ({gates}*hidden, in)")


def _cost(mod: nn.Module, ins: list[Shape | None], out: Shape | None) -> list[Cost]:
    x = ins[0] if ins else None
    if x is None:
        return []
    positions = math.prod(x) // x[-1]
    return [Cost(n, mod.mode.lower(), positions * p.numel())
            for n, p in mod.named_parameters(recurse=False) if p.dim() == 2]


SPEC = LayerSpec(_weights, _view, _cost)


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, i: int) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _clone(mod: nn.RNNBase, layer: int) -> nn.RNNBase:
    """A one-layer copy of layer ``layer`` of ``mod`` (both directions), sequence-first."""
    d = 2 if mod.bidirectional else 1
    in_size = mod.input_size if layer == 0 else mod.hidden_size * d
    kw: dict[str, Any] = dict(bias=mod.bias, batch_first=False, bidirectional=mod.bidirectional)
    if mod.mode == "LSTM":
        c: nn.RNNBase = nn.LSTM(in_size, mod.hidden_size, 1, **kw)
    elif mod.mode == "GRU":
        c = nn.GRU(in_size, mod.hidden_size, 1, **kw)
    else:
        c = nn.RNN(in_size, mod.hidden_size, 1, nonlinearity="tanh" if mod.mode == "RNN_TANH" else "relu", **kw)
    c = c.to(device=mod.weight_ih_l0.device, dtype=mod.weight_ih_l0.dtype)
    with torch.no_grad():
        for sfx in ([""] + (["_reverse"] if mod.bidirectional else [])):
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                src = getattr(mod, f"{kind}_l{layer}{sfx}", None)
                if src is not None:
                    getattr(c, f"{kind}_l0{sfx}").copy_(src)
    return c.eval()


def _hook(mod: nn.RNNBase, path: str, accs: dict[str, Feed]) -> Callable[..., None]:
    clones: dict[int, nn.RNNBase] = {}

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = _first(args, kwargs, "input", 0)
        hx = _first(args, kwargs, "hx", 1)
        if not isinstance(x, torch.Tensor):
            for a in accs.values():
                a.approximate = "packed sequences are not read: no statistics"
            return
        unbatched = x.dim() == 2
        seq = x[:, None] if unbatched else (x.transpose(0, 1) if mod.batch_first else x)  # (T, B, in)
        d = 2 if mod.bidirectional else 1
        h = mod.hidden_size
        h0_all = hx[0] if isinstance(hx, tuple) else hx
        c0_all = hx[1] if isinstance(hx, tuple) else None
        if h0_all is not None and unbatched:
            h0_all = h0_all[:, None]
            c0_all = c0_all[:, None] if c0_all is not None else None
        with torch.no_grad():
            for layer in range(mod.num_layers):
                names = {f"{path}.weight_ih_l{layer}{s}": ("ih", i) for i, s in enumerate(["", "_reverse"][:d])}
                names.update({f"{path}.weight_hh_l{layer}{s}": ("hh", i) for i, s in enumerate(["", "_reverse"][:d])})
                for name, (what, _i) in names.items():
                    if what == "ih" and name in accs:
                        accs[name].add_rows(seq.reshape(-1, seq.shape[-1]))
                clone = clones.get(layer)
                if clone is None:
                    clone = clones[layer] = _clone(mod, layer)
                b = seq.shape[1]
                h0 = (h0_all[layer * d:(layer + 1) * d] if h0_all is not None
                      else seq.new_zeros(d, b, h))
                if mod.mode == "LSTM":
                    c0 = c0_all[layer * d:(layer + 1) * d] if c0_all is not None else seq.new_zeros(d, b, h)
                    out, _ = clone(seq, (h0, c0))
                else:
                    out, _ = clone(seq, h0)
                for name, (what, i) in names.items():
                    if what != "hh" or name not in accs:
                        continue
                    o = out[..., i * h:(i + 1) * h]
                    prev = torch.cat([h0[i][None], o[:-1]]) if i == 0 else torch.cat([o[1:], h0[i][None]])
                    accs[name].add_rows(prev.reshape(-1, h))
                seq = out

    return hook


class RNNKind(NamedByParameter, LayerKind):
    kind = Kind.RNN
    finds = {nn.RNNBase: SPEC}
    cannot_factorize = ("its gate matrices are read inside the fused recurrence, and factorize() has no two-module "
                        "replacement for an LSTM, GRU or RNN")

    def graph_site(self, layer: Layer) -> str:
        return layer.param.rpartition(".")[0]

    def statistics(self, path: str, mod: nn.Module, layers: list[Layer], feeds: Feeds) -> None:
        assert isinstance(mod, nn.RNNBase)
        if mod.proj_size > 0:
            for layer in layers:
                feeds.missing(layer, "LSTM with proj_size: hidden statistics are not read")
            return
        accs = {layer.name: feeds.rows(layer, layer.n) for layer in layers}
        feeds.hook(mod, _hook(mod, path, accs), with_kwargs=True)


KIND = RNNKind()
