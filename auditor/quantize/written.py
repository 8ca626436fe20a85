"""A byte plan written and loaded: integer codes, float16 scales and zero points, low-rank factors, and every other
tensor of the model as it is, in one safetensors file beside a plan.json naming each layer's choice.

Per rewritten weight ``P`` (its function matrix F, out x in; ``transposed``: stored as F^T, transformers' Conv1D):
``P.codes`` and ``P.zeros`` (uint8, ``bits`` bits each, packed), ``P.scales`` (float16), ``P.a`` (out x r) and
``P.b`` (r x in) in the model's dtype, or as int8 codes (``P.a.codes``, ``P.a.scales``, ``P.b.codes``,
``P.b.scales``: a factor-only choice "rank r int8"). The weight is rebuilt as

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
SUFFIXES = ("codes", "scales", "zeros", "a", "b", "a.codes", "a.scales", "b.codes", "b.scales")


FACTOR_SPEC = QuantSpec(8)  # factors stored as integers: int8, groups of 128 along each factor's inputs, symmetric


@dataclass
class Parts:
    """One rewritten weight: its choice's label, its function shape, layout and dtype, its codes and factors (in
    the model's dtype, ``a`` and ``b``; or as int8 codes, ``qa`` and ``qb``)."""

    param: str
    label: str
    shape: tuple[int, int]
    transposed: bool
    dtype: torch.dtype
    quantized: Quantized | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    qa: Quantized | None = None
    qb: Quantized | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors, named ``<param>.<part>``."""
        out = {f"{self.param}.{k}": v for k, v in (self.quantized.packed() if self.quantized else {}).items()}
        if self.a is not None and self.b is not None:
            out[f"{self.param}.a"], out[f"{self.param}.b"] = self.a.contiguous(), self.b.contiguous()
        for side, q in (("a", self.qa), ("b", self.qb)):
            if q is not None:
                out.update({f"{self.param}.{side}.{k}": v for k, v in q.packed().items()})
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def rank(self) -> int:
        return int(self.a.shape[1]) if self.a is not None else self.qa.shape[1] if self.qa is not None else 0

    def weight(self) -> torch.Tensor:
        """The weight in its stored layout and dtype (see the module docstring)."""
        f = self.quantized.dequantize(torch.float32) if self.quantized is not None else torch.zeros(self.shape)
        if self.a is not None and self.b is not None:
            f = f + self.a.float() @ self.b.float()
        if self.qa is not None and self.qb is not None:
            f = f + self.qa.dequantize(torch.float32) @ self.qb.dequantize(torch.float32)
        return (f.T if self.transposed else f).to(self.dtype).contiguous()

    def meta(self) -> dict[str, Any]:
        return {"label": self.label, "shape": list(self.shape), "transposed": self.transposed,
                "dtype": str(self.dtype).removeprefix("torch."),
                "spec": self.quantized.spec.label if self.quantized is not None else "",
                "rank": self.rank, "factors": FACTOR_SPEC.label if self.qa is not None else ""}


def label_of(spec: str, rank: int, factors: str = "") -> str:
    """A choice's label: "keep", "int4 g128 sym", "int3 g128 asym + rank 16", "rank 48", "rank 48 int8".

    >>> label_of("", 48, "int8 g128 sym"), label_of("int4", 16)
    ('rank 48 int8', 'int4 g128 sym + rank 16')
    """
    quant = QuantSpec.parse(spec).label if spec else ""
    ranked = f"rank {rank}" + (f" {factors.split()[0]}" if factors else "") if rank else ""
    return " + ".join(x for x in (quant, ranked) if x) or "keep"


def unique_tensors(dense: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One name per shared storage (tied tensors), and the other names -> the kept one (no copies made)."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    kept, aliases = {}, {}
    for name, t in dense.items():
        key = (t.untyped_storage().data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t.detach()
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
    kept, aliases = unique_tensors(dense)
    tensors = {**{k: v.contiguous().clone() for k, v in kept.items()},
               **{k: v for p in parts.values() for k, v in p.tensors().items()}}
    save_file(tensors, str(out / MODEL_FILE))
    plan = {"format": FORMAT, "format_version": FORMAT_VERSION, "aliases": aliases,
            "layers": {p.param: p.meta() for p in parts.values()}, **meta}
    (out / PLAN_FILE).write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return os.path.getsize(out / MODEL_FILE)


def _meta_of(name: str, m: Any) -> tuple[tuple[int, int], bool, str, int, str, str]:
    """(shape, transposed, spec, rank, factors, label) of one layer's plan.json entry, each checked; ValueError says
    what."""
    if not isinstance(m, dict):
        raise ValueError(f"the entry of {name[:80]!r} is not an object")
    shape, spec, rank, label, factors = m.get("shape"), m.get("spec"), m.get("rank"), m.get("label"), m.get("factors")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
        raise ValueError(f"the shape of {name[:80]!r} is not two positive integers")
    if not isinstance(spec, str) or not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"the spec or rank of {name[:80]!r} is not a format and a rank")
    if factors not in ("", FACTOR_SPEC.label) or (factors and (spec or not rank)):
        raise ValueError(f"the factors of {name[:80]!r} are {str(factors)[:40]!r}, not {FACTOR_SPEC.label!r} "
                         "on a rank alone or nothing")
    if not spec and not rank:
        raise ValueError(f"{name[:80]!r} is neither quantized nor factorized")
    want = label_of(spec, rank, factors)
    if label != want or not isinstance(m.get("transposed"), bool):
        raise ValueError(f"the label of {name[:80]!r} ({str(label)[:40]!r}) is not its spec and rank ({want!r})")
    return (shape[0], shape[1]), m["transposed"], spec, rank, factors, want


def _packed(name: str, part: str, spec: QuantSpec, shape: tuple[int, int], tensors: dict[str, torch.Tensor],
            ) -> Quantized:
    """One quantized matrix of the file (``part``: "" for the weight's codes, "a." / "b." for a factor's), its
    packed codes and zero points checked to the byte (``Quantized`` checks the scales' grid)."""
    out, cols = shape
    sizes = {"codes": -(-out * cols * spec.bits // 8), "zeros": -(-out * spec.groups(cols) * spec.bits // 8)}
    for k in ("codes", "zeros"):
        t = tensors.get(f"{name}.{part}{k}")
        if t is not None and (t.dtype != torch.uint8 or tuple(t.shape) != (sizes[k],)):
            raise ValueError(f"{name}.{part}{k} is not {sizes[k]:,} packed bytes")
    keys = ("codes", "scales") if spec.symmetric else ("codes", "scales", "zeros")
    return Quantized.from_packed(spec, shape, {k: tensors[f"{name}.{part}{k}"] for k in keys})


def _parts(name: str, m: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Parts:
    """One layer's parts from the file, every tensor it needs present, none it does not, each of its shape and
    dtype."""
    shape, transposed, spec, rank, factors, label = _meta_of(name, m)
    q_spec = QuantSpec.parse(spec) if spec else None
    need = ({"codes", "scales"} | ({"zeros"} if q_spec is not None and not q_spec.symmetric else set())
            if q_spec is not None else set())
    need |= ({"a.codes", "a.scales", "b.codes", "b.scales"} if factors else {"a", "b"}) if rank else set()
    have = {k for k in SUFFIXES if f"{name}.{k}" in tensors}
    if have != need:
        raise ValueError(f"{name[:80]!r} is {label} and needs {sorted(need)}, the file holds {sorted(have)}")
    q = _packed(name, "", q_spec, shape, tensors) if q_spec is not None else None
    if factors:
        qa = _packed(name, "a.", FACTOR_SPEC, (shape[0], rank), tensors)
        qb = _packed(name, "b.", FACTOR_SPEC, (rank, shape[1]), tensors)
        return Parts(name, label, shape, transposed, dtype, q, qa=qa, qb=qb)
    a, b = tensors.get(f"{name}.a"), tensors.get(f"{name}.b")
    if rank and (a is None or b is None or tuple(a.shape) != (shape[0], rank) or tuple(b.shape) != (rank, shape[1])
                 or a.dtype != dtype or b.dtype != dtype):
        raise ValueError(f"the factors of {name[:80]!r} are not {shape[0]} x {rank} and {rank} x {shape[1]} "
                         f"{str(dtype).removeprefix('torch.')}")
    return Parts(name, label, shape, transposed, dtype, q, a, b)


def _read(d: Path, fix: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """plan.json (checked: this format and version, its layers and aliases objects) and the file's tensors."""
    from safetensors.torch import load_file

    try:
        plan = json.loads((d / PLAN_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(d / MODEL_FILE))
    except Exception as exc:  # noqa: BLE001 - unreadable JSON, a missing file, safetensors' own error
        raise AuditError(f"{d} holds no readable byte plan: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}",
                         fix) from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise AuditError(f"{d / PLAN_FILE} is not a byte plan lowrank-audit wrote", fix)
    if plan.get("format_version") != FORMAT_VERSION:
        raise AuditError(f"{d / PLAN_FILE} is format version {str(plan.get('format_version'))[:20]}, this "
                         f"lowrank-audit reads {FORMAT_VERSION}", "Write it again with this version")
    if not isinstance(plan.get("layers"), dict) or not isinstance(plan.get("aliases", {}), dict):
        raise AuditError(f"{d / PLAN_FILE}: its layers and aliases are not objects", fix)
    return plan, tensors


def load_byte_plan(model: "nn.Module", directory: str | Path) -> "nn.Module":
    """A copy of ``model`` (left untouched) holding the byte plan in ``directory``: every rewritten weight rebuilt
    by :meth:`Parts.weight` (dequantized), every other tensor loaded as written. A folder that does not fit the model
    (names, shapes, dtypes, a tensor missing or left over) is an AuditError, never a partial or silent load."""
    d = Path(directory)
    fix = "Point to a folder lowrank-audit wrote with --write-bits for this model"
    plan, tensors = _read(d, fix)
    state = model.state_dict()
    layers, aliases = plan["layers"], plan.get("aliases", {})
    values: dict[str, torch.Tensor] = {}
    try:
        for name, m in layers.items():
            if name not in state:
                raise ValueError(f"the model has no {name[:80]!r}")
            values[name] = _parts(name, m, tensors, state[name].dtype).weight()
    except (KeyError, ValueError, RuntimeError) as exc:
        raise AuditError(f"{d / MODEL_FILE} does not hold the byte plan's layers: {exc}", fix) from None
    used = {f"{n}.{k}" for n in layers for k in SUFFIXES}
    for name in state:
        if name not in values:
            values[name] = tensors.get(aliases.get(name, name) if isinstance(aliases.get(name, name), str) else name)
            used.add(aliases.get(name, name) if isinstance(aliases.get(name, name), str) else name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise AuditError(f"{d / MODEL_FILE} holds tensors the plan does not use: {', '.join(extra[:3])[:200]}", fix)
    _check(d / MODEL_FILE, state, values, fix)
    new = copy.deepcopy(model)
    with torch.no_grad():
        new.load_state_dict(values, strict=True)
    return new


def _check(path: Path, state: dict[str, torch.Tensor], values: dict[str, torch.Tensor], fix: str) -> None:
    for name, want in state.items():
        got = values.get(name)
        if got is None:
            raise AuditError(f"{path} lacks {name[:120]}", fix)
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise AuditError(f"{path}: {name[:120]} is {tuple(got.shape)} {got.dtype}, the model's "
                             f"{tuple(want.shape)} {want.dtype}", fix)
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise AuditError(f"{path}: {name[:120]} holds NaN or infinite values", fix)


__all__ = ["FACTOR_SPEC", "FORMAT", "Parts", "label_of", "load_byte_plan", "unique_tensors", "write_byte_plan"]
