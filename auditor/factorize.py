"""Apply a plan: a new module in which every planned layer is two, initialised by a (whitened) truncated SVD.

- Linear (and transformers' Conv1D) -> Linear(in, r, bias=False) then Linear(r, out, bias as before);
- Conv1d/2d/3d -> the same convolution with r outputs per group (no bias), then a 1x1 convolution to the original
  outputs (groups kept, bias as before);
- Embedding -> Embedding(V, r) then Linear(r, dim, bias=False).

Each planned layer stores groups * r * (m + n) numbers instead of groups * m * n, so the new module has exactly
``dense - sum(m*n*groups) + sum(r*(m+n)*groups)`` parameters. Without calibration the factors come from the SVD of
the weight; with calibration (a ``Calibration`` or its ``InputStatistics``) from the whitened truncation, which keeps
the layer's outputs on the calibration data as close as any rank-r map can. A recovery fine-tune follows either way.

``save_factorized`` writes ``model.safetensors`` (the factorized module's weights) and ``plan.json``;
``load_factorized(model, dir)`` rebuilds the factorized structure from the original model and the plan, then loads
the weights.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import AuditError
from .layers import ParamTable, collect_layers, hf_conv1d_type
from .results import Kind, Layer

FORMAT = "lowrank-auditor factorized"
FORMAT_VERSION = 1
SUPPORTED = (Kind.LINEAR, Kind.CONV1D_HF, Kind.CONV, Kind.EMBEDDING)


def resolve_plan(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> dict[str, tuple[Layer, int]]:
    """Plan entries (layer or parameter names -> rank) checked against the model: ``Layer.name -> (layer, rank)``."""
    if layers is None:
        layers = collect_layers(model, ParamTable.of(model))
    named = {layer.name: layer for layer in layers.values()}
    by_param = {layer.param: layer for layer in layers.values()}
    out: dict[str, tuple[Layer, int]] = {}
    for key, rank in plan.items():
        layer = named.get(key) or by_param.get(key)
        if layer is None:
            close = difflib.get_close_matches(key, list(named), n=3)
            raise AuditError(f"plan names {key!r}, which is not a factorizable layer of the model",
                             f"Did you mean {', '.join(close)}?" if close else "Check the layer names in the audit")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 1 <= int(rank) <= layer.max_rank:
            raise AuditError(f"plan rank {rank!r} for {layer.name} is not an integer in 1..{layer.max_rank}",
                             "Give a positive integer rank no larger than min(m, n)")
        out[layer.name] = (layer, int(rank))
    return out


def predicted_params(model: nn.Module, plan: dict[str, int], layers: dict[str, Layer] | None = None) -> int:
    """The factorized model's parameter count: dense - m*n*groups + r*(m+n)*groups per planned layer."""
    resolved = resolve_plan(model, plan, layers)
    total = ParamTable.of(model).total
    return total - sum(l.params - l.params_at(r) for l, r in resolved.values())


def _paths_of(model: nn.Module, mod: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules(remove_duplicate=False) if m is mod]


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    owner._modules[child] = new


def _two(layer: Layer, mod: nn.Module, r: int, a: np.ndarray | None, b: np.ndarray | None) -> nn.Module:
    """The two-module replacement of ``mod`` at rank r; factors a (g, out, r), b (g, r, in) when given."""
    w = getattr(mod, "weight")
    kw: dict[str, Any] = dict(device=w.device, dtype=w.dtype)
    bias = getattr(mod, "bias", None)

    def fill(p: torch.Tensor, x: np.ndarray) -> None:
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(x)).reshape(p.shape))

    if layer.kind in (Kind.LINEAR, Kind.CONV1D_HF):
        first = nn.Linear(layer.n, r, bias=False, **kw)
        second = nn.Linear(r, layer.m, bias=bias is not None, **kw)
        if a is not None and b is not None:
            fill(first.weight, b[0])
            fill(second.weight, a[0])
        if bias is not None:
            with torch.no_grad():
                second.bias.copy_(bias)
        return nn.Sequential(first, second)
    if layer.kind == Kind.CONV:
        assert isinstance(mod, nn.modules.conv._ConvNd)
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
    assert isinstance(mod, nn.Embedding)
    if mod.max_norm is not None:
        raise AuditError(f"{layer.name} renormalises its rows (max_norm): a factorized table cannot reproduce it",
                         "Leave it out of the plan")
    first = nn.Embedding(layer.m, r, padding_idx=mod.padding_idx, scale_grad_by_freq=mod.scale_grad_by_freq,
                         sparse=mod.sparse, **kw)
    second = nn.Linear(r, layer.n, bias=False, **kw)
    if a is not None and b is not None:
        fill(first.weight, b[0].T)  # E = B^T (V x r)
        fill(second.weight, a[0])  # (dim x r)
    return nn.Sequential(first, second)


def factorize(model: nn.Module, plan: dict[str, int], calibration: Any = None, *, init: bool = True,
              layers: dict[str, Layer] | None = None, reuse: dict[str, Any] | None = None) -> nn.Module:
    """A deep copy of ``model`` with each planned layer (``{layer name: rank}``) replaced by two; ``model`` is left
    untouched. ``calibration``: None (plain SVD), a ``Calibration`` (input statistics are gathered on ``model``), or
    ``InputStatistics``. ``init=False`` builds the structure only (for ``load_factorized``). ``reuse``: a dict the
    caller keeps across calls with the same model and calibration, so each layer is decomposed once."""
    from .calibration.whiten import Truncator

    resolved = resolve_plan(model, plan, layers)
    stats = None
    if calibration is not None and init:
        from .calibration.inputs import Calibration
        from .calibration.stats import InputStatistics, input_statistics

        if isinstance(calibration, InputStatistics):
            stats = calibration
        elif isinstance(calibration, Calibration):
            stats = input_statistics(model, [l for l, _ in resolved.values()], calibration)
        else:
            raise AuditError(f"calibration is a {type(calibration).__name__}",
                             "Pass a Calibration (load_calibration) or InputStatistics")
    conv1d = hf_conv1d_type()
    for name, (layer, _) in resolved.items():
        mod = model.get_submodule(layer.name) if layer.kind in SUPPORTED else None
        ok = mod is not None and (
            (layer.kind == Kind.LINEAR and isinstance(mod, nn.Linear))
            or (layer.kind == Kind.CONV1D_HF and conv1d is not None and isinstance(mod, conv1d))
            or (layer.kind == Kind.CONV and isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed)
            or (layer.kind == Kind.EMBEDDING and type(mod) is nn.Embedding))
        if not ok:
            raise AuditError(f"factorize() rewrites Linear, Conv1D, Conv1d/2d/3d and Embedding layers; {name} is "
                             f"{layer.module_type} ({layer.kind})", "Leave it out of the plan")
        others = [a for a in layer.aliases if model.get_submodule(a.rpartition(".")[0]) is not mod]
        if others:
            raise AuditError(f"{name} shares its weight with {', '.join(others)}: factorizing one use would "
                             "untie it", "Leave tied weights out of the plan, or untie them first")
    new = copy.deepcopy(model)
    for name, (layer, r) in resolved.items():
        old = new.get_submodule(layer.name)
        a = b = None
        if init:
            inp = stats.layers.get(name) if stats is not None else None
            trunc = reuse.get(name) if reuse is not None else None
            if trunc is None:
                trunc = Truncator(layer, old.weight, inp)
                if reuse is not None:
                    reuse[name] = trunc
            a, b = trunc.factors(r)
        replacement = _two(layer, old, r, a, b)
        replacement.train(old.training)
        for path in _paths_of(new, old):  # a module reached by several paths is replaced at each
            _set(new, path, replacement)
    return new


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied tensors once)."""
    return ParamTable.of(model).total


def save_factorized(factorized: nn.Module, plan: dict[str, int], directory: str | Path,
                    source: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` and ``plan.json`` into ``directory`` (created); returns the directory."""
    from safetensors.torch import save_model

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_model(factorized, str(out / "model.safetensors"))
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source,
            "plan": {k: int(v) for k, v in plan.items()}, "params": count_params(factorized),
            "note": "a recovery fine-tune follows factorization"}
    meta.update(extra or {})
    (out / "plan.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def read_plan(directory: str | Path) -> dict[str, int]:
    path = Path(directory) / "plan.json"
    if not path.is_file():
        raise AuditError(f"{path} does not exist", "Point to a directory written by save_factorized")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AuditError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}", "Rewrite it with save_factorized") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("plan"), dict):
        raise AuditError(f"{path} is not a factorized-model plan", "Point to a directory written by save_factorized")
    return {k: int(v) for k, v in meta["plan"].items()}


def load_factorized(model: nn.Module, directory: str | Path) -> nn.Module:
    """Rebuild the factorized module from the original ``model`` (left untouched) and the plan in ``directory``,
    then load its weights."""
    from safetensors.torch import load_model

    plan = read_plan(directory)
    new = factorize(model, plan, init=False)
    try:
        load_model(new, str(Path(directory) / "model.safetensors"), strict=True)
    except Exception as exc:  # noqa: BLE001 - mismatched or corrupt weights
        from .errors import first_line

        raise AuditError(f"factorized weights in {directory} do not fit the plan: {first_line(exc)}",
                         "Load them with the same original model the plan was made for") from None
    return new
