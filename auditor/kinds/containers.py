"""The container modules the other parts of the auditor ask about: ``nn.ModuleList`` and ``nn.Sequential`` as the
lists of blocks a model repeats, and the two-module ``nn.Sequential`` that a factorized layer becomes. Every
``isinstance`` test of a torch layer class lives in ``auditor/kinds/`` (tests/test_layering.py checks it)."""

from __future__ import annotations

import torch
from torch import nn


def is_block_list(mod: nn.Module) -> bool:
    """An ``nn.ModuleList`` of two or more children of one class: the repeated blocks of a model (a transformer's
    layers)."""
    return isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1


def holds_blocks(mod: nn.Module) -> bool:
    """An ``nn.ModuleList`` or ``nn.Sequential``: a container whose children are blocks of their own."""
    return isinstance(mod, (nn.ModuleList, nn.Sequential))


def is_factor_pair(new: nn.Module, old: nn.Module | None) -> bool:
    """``new`` is the two-module ``nn.Sequential`` of weighted modules that factorizing puts where ``old`` was, a
    layer with a weight that is no such pair itself."""
    return (isinstance(new, nn.Sequential) and len(new) == 2 and old is not None
            and not isinstance(old, nn.Sequential) and isinstance(getattr(old, "weight", None), torch.Tensor)
            and all(isinstance(getattr(m, "weight", None), nn.Parameter) for m in new))


__all__ = ["holds_blocks", "is_block_list", "is_factor_pair"]
