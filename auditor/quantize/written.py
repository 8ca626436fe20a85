"""A byte plan written and loaded: integer codes, float16 scales and zero points, low-rank factors, and every other
tensor of the model as it is, in one safetensors file beside a plan.json naming each layer's choice.

Per rewritten weight ``P`` (its function matrix F, out x in; ``transposed``: stored as F^T, transformers' Conv1D):
``P.codes`` and ``P.zeros`` (uint8, ``bits`` bits each, packed), ``P.scales`` (float16), ``P.a`` (out x r) and
``P.b`` (r x in) in the model's dtype. The weight is rebuilt as

    W = (dequantize(codes, scales, zeros) + a @ b)   computed in float32, then cast to the model's dtype

by :meth:`Parts.weight`, which is also what the audit measured (the same function builds the audit's replacement),
so the loaded model is the measured one bit for bit. The file's tensor bytes are the plan's predicted bytes exactly;
the file adds the safetensors header (8 bytes and its JSON).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AuditError
from .codes import QuantSpec, Quantized

if TYPE_CHECKING:
    from torch import nn

FORMAT = "lowrank-auditor byte plan"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
PLAN_FILE = "plan.json"
SUFFIXES = ("codes", "scales", "zeros", "a", "b")


@dataclass
class Parts:
    """One rewritten weight: its choice's label, its function shape, layout and dtype, its codes and factors."""

    param: str
    label: str
    shape: tuple[int, int]
    transposed: bool
    dtype: torch.dtype
    quantized: Quantized | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors, named ``<param>.<part>``."""
        out = {f"{self.param}.{k}": v for k, v in (self.quantized.packed() if self.quantized else {}).items()}
        if self.a is not None and self.b is not None:
            out[f"{self.param}.a"], out[f"{self.param}.b"] = self.a.contiguous(), self.b.contiguous()
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def weight(self) -> torch.Tensor:
        """The weight in its stored layout and dtype (see the module docstring)."""
        f = self.quantized.dequantize(torch.float32) if self.quantized is not None else torch.zeros(self.shape)
        if self.a is not None and self.b is not None:
            f = f + self.a.float() @ self.b.float()
        return (f.T if self.transposed else f).to(self.dtype).contiguous()

    def meta(self) -> dict[str, Any]:
        return {"label": self.label, "shape": list(self.shape), "transposed": self.transposed,
                "dtype": str(self.dtype).removeprefix("torch."),
                "spec": self.quantized.spec.label if self.quantized is not None else "",
                "rank": int(self.a.shape[1]) if self.a is not None else 0}


def _unique(dense: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One name per shared storage (tied tensors), and the other names -> the stored one."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    kept, aliases = {}, {}
    for name, t in dense.items():
        key = (t.untyped_storage().data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t.detach().contiguous().clone()
    return kept, aliases


def write_byte_plan(directory: str | Path, dense: dict[str, torch.Tensor], parts: dict[str, Parts],
                    meta: dict[str, Any]) -> int:
    """``dense`` (the state dict's tensors no part replaces) and ``parts`` into ``directory`` (a new or empty
    folder): model.safetensors, then plan.json; returns the safetensors file's size in bytes."""
    from safetensors.torch import save_file

    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AuditError(f"{out} exists and is not an empty folder; refusing to write the byte plan into it",
                         "Give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    kept, aliases = _unique(dense)
    tensors = {**kept, **{k: v for p in parts.values() for k, v in p.tensors().items()}}
    save_file(tensors, str(out / MODEL_FILE))
    plan = {"format": FORMAT, "format_version": FORMAT_VERSION, "aliases": aliases,
            "layers": {p.param: p.meta() for p in parts.values()}, **meta}
    (out / PLAN_FILE).write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return os.path.getsize(out / MODEL_FILE)


def _parts(name: str, m: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Parts:
    shape = (int(m["shape"][0]), int(m["shape"][1]))
    q = None
    if m["spec"]:
        q = Quantized.from_packed(QuantSpec.parse(m["spec"]), shape,
                                  {k: tensors[f"{name}.{k}"] for k in ("codes", "scales", "zeros")
                                   if f"{name}.{k}" in tensors})
    a, b = tensors.get(f"{name}.a"), tensors.get(f"{name}.b")
    return Parts(name, m["label"], shape, bool(m["transposed"]), dtype, q, a, b)


def load_byte_plan(model: "nn.Module", directory: str | Path) -> "nn.Module":
    """A copy of ``model`` (left untouched) holding the byte plan in ``directory``: every rewritten weight rebuilt
    by :meth:`Parts.weight` (dequantized), every other tensor loaded as written. A file that does not fit the model
    (names, shapes, dtypes) is an AuditError, never a partial load."""
    from safetensors.torch import load_file

    d = Path(directory)
    fix = "Point to a folder lowrank-audit wrote with --write-bits for this model"
    try:
        plan = json.loads((d / PLAN_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(d / MODEL_FILE))
    except (OSError, ValueError) as exc:
        raise AuditError(f"{d} holds no readable byte plan: {exc}", fix) from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise AuditError(f"{d / PLAN_FILE} is not a byte plan lowrank-audit wrote", fix)
    new = copy.deepcopy(model)
    state = new.state_dict()
    layers, aliases = plan.get("layers", {}), plan.get("aliases", {})
    values: dict[str, torch.Tensor] = {}
    try:
        for name, m in layers.items():
            values[name] = _parts(name, m, tensors, state[name].dtype).weight()
    except (KeyError, ValueError) as exc:
        raise AuditError(f"{d / MODEL_FILE} does not hold the byte plan's layers ({exc})", fix) from None
    for name in state:
        if name not in values:
            values[name] = tensors.get(aliases.get(name, name))  # type: ignore[assignment]
    _check(d / MODEL_FILE, state, values, fix)
    with torch.no_grad():
        new.load_state_dict(values, strict=True)
    return new


def _check(path: Path, state: dict[str, torch.Tensor], values: dict[str, torch.Tensor], fix: str) -> None:
    for name, want in state.items():
        got = values.get(name)
        if got is None:
            raise AuditError(f"{path} lacks {name}", fix)
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise AuditError(f"{path}: {name} is {tuple(got.shape)} {got.dtype}, the model's {tuple(want.shape)} "
                             f"{want.dtype}", fix)
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise AuditError(f"{path}: {name} holds NaN or infinite values", fix)


__all__ = ["FORMAT", "Parts", "load_byte_plan", "write_byte_plan"]
