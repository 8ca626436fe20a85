"""A deterministic clock for the speed tests: time advances only by a cost model of the ``nn.Linear`` calls made
between two readings (``seconds_per_mac`` per multiply-accumulate plus ``launch`` per call), never by the wall.

The timer reads the clock in pairs around each block of calls: the first reading of a pair installs a global
forward hook that adds each Linear call's cost, the second removes it, so no hook outlives a block.
"""

from __future__ import annotations

import torch
from torch import nn


class CostClock:
    def __init__(self, seconds_per_mac: float = 1e-9, launch: float = 50e-6) -> None:
        self.t = 0.0
        self.per_mac = seconds_per_mac
        self.launch = launch
        self.handle = None

    def cost(self, mod: nn.Linear, x: torch.Tensor) -> float:
        rows = x.numel() // mod.in_features
        return rows * mod.in_features * mod.out_features * self.per_mac + self.launch

    def _hook(self, mod: nn.Module, args: tuple, out: object) -> None:
        if isinstance(mod, nn.Linear):
            self.t += self.cost(mod, args[0])

    def __call__(self) -> float:
        if self.handle is None:
            self.handle = nn.modules.module.register_module_forward_hook(self._hook)
        else:
            self.handle.remove()
            self.handle = None
        return self.t
