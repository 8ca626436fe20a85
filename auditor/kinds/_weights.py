"""Helpers the built-in kinds share to find a module's weight."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


def only_weight(mod: nn.Module) -> tuple[str, ...]:
    """("weight",) if the module has one: a parameter, a parametrized weight or a hook-computed tensor. Reading
    a parametrized weight would compute it (and run spectral_norm's power iteration in training mode), so the
    presence is checked without reading it."""
    if parametrize.is_parametrized(mod, "weight"):
        return ("weight",)
    w = mod._parameters.get("weight", mod.__dict__.get("weight"))
    if not isinstance(w, torch.Tensor) or isinstance(w, nn.parameter.UninitializedParameter):
        return ()
    return ("weight",)


def call_weight(mod: nn.Module, name: str) -> torch.Tensor | None:
    """Quantized modules keep their weight packed and hand it out by a call."""
    w = getattr(mod, name, None)
    return w() if callable(w) else w


def linear_pair(n: int, m: int, r: int, bias: torch.Tensor | None, a, b, like: torch.Tensor) -> nn.Sequential:
    """Linear(n, r, no bias) then Linear(r, m, bias as before), filled with B and A when given."""
    from .base import fill

    kw = dict(device=like.device, dtype=like.dtype)
    first = nn.Linear(n, r, bias=False, **kw)
    second = nn.Linear(r, m, bias=bias is not None, **kw)
    if a is not None and b is not None:
        fill(first.weight, b[0])
        fill(second.weight, a[0])
    if bias is not None:
        with torch.no_grad():
            second.bias.copy_(bias)
    return nn.Sequential(first, second)
