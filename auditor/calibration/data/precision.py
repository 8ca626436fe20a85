"""``--compute-dtype float32`` for every forward of a calibrated audit, not only its statistics.

A CPU without bf16 matrix units multiplies bfloat16 a few hundred times slower than float32 (0.36 against 102 GFLOPS
on this project's 2-core AMD EPYC VM), so a bf16 model's dense reference, gradient pass, tier-3 plans and verification
would take days on the CPU where its statistics take an hour. :func:`computing_in` runs each module's forward with its
own half-precision parameters and buffers replaced, for that call only, by float32 copies (an instance attribute that
shadows the parameter: ``module.weight`` is the copy, ``module._parameters`` and ``state_dict()`` are untouched), and
its half-precision positional inputs cast up. The copies of the modules running at once are alive (a leaf layer's
while it runs), besides what autograd keeps for a backward (the copies a backward needs are saved like any activation;
a checkpointed block makes them again). The weights in memory stay bit for bit what they were, and every shadow is
gone when its forward ends, an exception included.

The hooks are torch's global module hooks (every module of every model in the process, factorized copies made
inside the block included), so the block is the audit's own calibration work, not a library-wide setting; a model
without half-precision parameters is run as it is (nothing is registered).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)


class _Shadows:
    """The float32 copies in place while their module's forward runs: per module a stack of the names shadowed (a
    module called again inside its own forward pushes again), and every module touched, to clear at the end."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.stacks: dict[int, list[list[str]]] = {}
        self.touched: dict[int, nn.Module] = {}

    def pre(self, module: nn.Module, args: tuple) -> tuple | None:
        names = []
        for table in (module._parameters, module._buffers):
            for k, t in table.items():
                if t is not None and t.dtype in HALF and k not in module.__dict__:
                    module.__dict__[k] = t.to(self.dtype)
                    names.append(k)
        self.stacks.setdefault(id(module), []).append(names)
        if names:
            self.touched[id(module)] = module
        if not any(isinstance(a, torch.Tensor) and a.dtype in HALF for a in args):
            return None
        return tuple(a.to(self.dtype) if isinstance(a, torch.Tensor) and a.dtype in HALF else a for a in args)

    def post(self, module: nn.Module, args: tuple, out: object) -> None:
        stack = self.stacks.get(id(module))
        if not stack:
            return
        for k in stack.pop():
            module.__dict__.pop(k, None)

    def clear(self) -> None:
        """Every shadow still in place (none, unless a hook was skipped), and the bookkeeping."""
        for module in self.touched.values():
            for table in (module._parameters, module._buffers):
                for k in table:
                    t = module.__dict__.get(k)
                    if isinstance(t, torch.Tensor):
                        del module.__dict__[k]
        self.stacks.clear()
        self.touched.clear()


def has_half(model: nn.Module) -> bool:
    return any(p.dtype in HALF for p in model.parameters()) or any(b.dtype in HALF for b in model.buffers())


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[bool]:
    """While the block runs, every module forward in the process computes in ``dtype`` (its half-precision parameters,
    buffers and positional inputs cast for the call); yields whether anything is cast (False: ``dtype`` None, or
    ``model`` holds no bfloat16 / float16 tensor, and nothing is registered)."""
    if dtype is None or not has_half(model):
        yield False
        return
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    shadows = _Shadows(dtype)
    pre = register_module_forward_pre_hook(shadows.pre)
    post = register_module_forward_hook(shadows.post, always_call=True)  # a forward that raises is undone too
    try:
        yield True
    finally:
        pre.remove()
        post.remove()
        shadows.clear()


__all__ = ["HALF", "computing_in", "has_half"]
