"""Group-wise round-to-nearest integer quantization of a 2-D weight, and its exact size in bytes.

A weight F (out x in) is cut along the input dimension into groups of ``group`` consecutive columns (the last group
of a row is shorter when ``in`` is not a multiple of ``group``). Each (row, group) gets a float16 scale, and in the
asymmetric mode an integer zero point stored at ``bits`` bits. Codes are packed ``bits`` bits each.

Stored bytes, exact integers (groups = ceil(in / group)):

    codes ceil(out*in*bits/8) + scales 2*out*groups + (asymmetric) zeros ceil(out*groups*bits/8)

>>> spec = QuantSpec(4)
>>> spec.label
'int4 g128 sym'
>>> spec.code_bytes(4096, 4096), spec.scale_bytes(4096, 4096), spec.nbytes(4096, 4096)
(8388608, 262144, 8650752)
>>> spec.bits_per_weight(4096, 4096)
4.125
>>> QuantSpec.parse("int4 g128 asym").nbytes(4096, 4096)   # 65,536 bytes of 4-bit zero points more
8716288
>>> QuantSpec(3).nbytes(4096, 4096) == 6_291_456 + 262_144
True
>>> QuantSpec(4).groups(300)   # 128 + 128 + 44 columns
3

Rounding is ``torch.round`` (half to even) in float32 whatever the input dtype. Each scale is rounded to float16
*before* the codes are chosen, so the codes are the nearest ones for the scale that is actually stored.

Symmetric (``sym``): qmax = 2**(bits-1) - 1, scale = max|w| / qmax, q = clamp(round(w/scale), -qmax-1, qmax),
stored offset-binary as q + 2**(bits-1). An all-zero group stores scale 0 and dequantizes to exact zeros; so does a
group whose scale is below float16's smallest subnormal (its largest value under about 6e-8 times the top level:
7.6e-6 for int8, 4.2e-7 for int4), the error of writing it as zeros at most that value.

Asymmetric (``asym``): levels 0 .. L with L = 2**bits - 1 over the range [lo, hi] = [min(min w, 0), max(max w, 0)];
scale = (hi - lo) / L, zero = clamp(round(-lo/scale), 0, L), q = clamp(round(w/scale) + zero, 0, L), dequantized
(q - zero) * scale. The range is widened to hold 0 (as GPTQ does) because an integer zero point in [0, L] always
puts 0 on the grid: a range without 0 would be clipped. So a constant group c gets scale |c|/L and dequantizes to
+-L*fp16(|c|/L), which is c up to the float16 rounding of the scale; a constant 0 group stores scale 0 and comes
back exactly 0.

>>> q = quantize(torch.tensor([[0.0, 1.0, -2.0, 0.5]]), QuantSpec(4, group=4))
>>> q.codes.tolist(), q.scales.tolist()
([[8, 12, 1, 10]], [[0.28564453125]])
>>> q.dequantize().tolist()
[[0.0, 1.142578125, -1.99951171875, 0.5712890625]]
>>> q.packed()["codes"].tolist()   # value i in bits [4i, 4i+4), least significant bit first
[200, 161]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 5, 6, 7, 8)
FP16_MAX = 65504.0
_LABEL = re.compile(r"int(\d+)(?: g(\d+) (sym|asym))?")


@dataclass(frozen=True)
class QuantSpec:
    """One integer format: ``bits`` per code, ``group`` columns per scale, symmetric or with zero points."""

    bits: int
    group: int = 128
    symmetric: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in BITS:
            raise ValueError(f"bits must be an integer from 2 to 8, got {self.bits!r}.")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group must be a positive integer number of columns, got {self.group!r}.")

    @property
    def label(self) -> str:
        """``int4 g128 sym``: the form ``parse`` reads back."""
        return f"int{self.bits} g{self.group} {'sym' if self.symmetric else 'asym'}"

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """Read a ``label`` back; the short form ``int4`` means ``int4 g128 sym``.

        >>> QuantSpec.parse("int3 g64 asym") == QuantSpec(3, 64, symmetric=False)
        True
        >>> QuantSpec.parse("int8").label
        'int8 g128 sym'
        """
        m = _LABEL.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"{text!r} is not a quantization format; write e.g. 'int4' or 'int4 g128 sym' "
                             "or 'int3 g64 asym'.")
        bits, group, mode = m.groups()
        if group is None:
            return cls(int(bits))
        return cls(int(bits), int(group), mode == "sym")

    def groups(self, cols: int) -> int:
        """Groups per row: ceil(cols / group)."""
        return -(-cols // self.group)

    def code_bytes(self, out: int, cols: int) -> int:
        _check_shape(out, cols)
        return -(-out * cols * self.bits // 8)

    def scale_bytes(self, out: int, cols: int) -> int:
        _check_shape(out, cols)
        return 2 * out * self.groups(cols)

    def zero_bytes(self, out: int, cols: int) -> int:
        _check_shape(out, cols)
        return 0 if self.symmetric else -(-out * self.groups(cols) * self.bits // 8)

    def nbytes(self, out: int, cols: int) -> int:
        """Bytes of the packed codes, float16 scales and packed zero points of an out x cols weight."""
        return self.code_bytes(out, cols) + self.scale_bytes(out, cols) + self.zero_bytes(out, cols)

    def bits_per_weight(self, out: int, cols: int) -> float:
        return 8 * self.nbytes(out, cols) / (out * cols)


def _check_shape(out: int, cols: int) -> None:
    if out < 1 or cols < 1:
        raise ValueError(f"a weight must have at least one row and one column, got {out} x {cols}.")


@dataclass
class Quantized:
    """Unpacked integer codes of one weight with their float16 scales (and zero points when asymmetric)."""

    spec: QuantSpec
    shape: tuple[int, int]
    codes: torch.Tensor  # uint8 (out, in), values in [0, 2**bits - 1]
    scales: torch.Tensor  # float16 (out, groups)
    zeros: torch.Tensor | None = None  # uint8 (out, groups), asymmetric only

    def __post_init__(self) -> None:
        out, cols = self.shape
        grid = (out, self.spec.groups(cols))
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (out, cols):
            raise ValueError(f"codes must be uint8 of shape {(out, cols)}, got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}.")
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != grid:
            raise ValueError(f"scales must be float16 of shape {grid}, got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}.")
        if self.spec.symmetric != (self.zeros is None):
            raise ValueError(f"{self.spec.label} {'takes no' if self.spec.symmetric else 'needs'} zero points.")
        if self.zeros is not None and (self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != grid):
            raise ValueError(f"zeros must be uint8 of shape {grid}, got {self.zeros.dtype} "
                             f"{tuple(self.zeros.shape)}.")

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes(*self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(q - zero) * scale per element, computed in float32 with the stored float16 scales."""
        cols = self.shape[1]
        scale = self.scales.float().repeat_interleave(self.spec.group, dim=1)[:, :cols]
        if self.zeros is None:
            zero = torch.tensor(float(2 ** (self.spec.bits - 1)))
        else:
            zero = self.zeros.float().repeat_interleave(self.spec.group, dim=1)[:, :cols]
        return ((self.codes.float() - zero) * scale).to(dtype)

    def packed(self) -> dict[str, torch.Tensor]:
        """The stored tensors: ``codes`` and ``zeros`` packed ``bits`` bits each, ``scales`` float16; their bytes
        add up to ``nbytes`` exactly."""
        out = {"codes": pack(self.codes, self.spec.bits), "scales": self.scales.clone()}
        if self.zeros is not None:
            out["zeros"] = pack(self.zeros, self.spec.bits)
        return out

    @classmethod
    def from_packed(cls, spec: QuantSpec, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Quantized:
        """The inverse of ``packed``."""
        out, cols = shape
        codes = unpack(tensors["codes"], spec.bits, out * cols).reshape(out, cols)
        zeros = None
        if not spec.symmetric:
            zeros = unpack(tensors["zeros"], spec.bits, out * spec.groups(cols)).reshape(out, spec.groups(cols))
        return cls(spec, (out, cols), codes, tensors["scales"].clone(), zeros)


def quantize(f: torch.Tensor, spec: QuantSpec) -> Quantized:
    """Round-to-nearest codes of a 2-D floating weight (out x in) in the format ``spec``."""
    w = _grouped(f, spec.group)  # float32 (out, groups, group), zero-padded
    if spec.symmetric:
        qmax = 2 ** (spec.bits - 1) - 1
        scale = _fp16_scale(w.abs().amax(dim=2) / qmax, w)
        q = torch.clamp(torch.round(w / _safe(scale)[..., None]), -qmax - 1, qmax) + (qmax + 1)
        zeros = None
    else:
        top = 2 ** spec.bits - 1
        lo = w.amin(dim=2).clamp(max=0.0)  # the grid always holds 0: see the module docstring
        hi = w.amax(dim=2).clamp(min=0.0)
        scale = _fp16_scale((hi - lo) / top, w)
        zero = torch.clamp(torch.round(-lo / _safe(scale)), 0, top)
        q = torch.clamp(torch.round(w / _safe(scale)[..., None]) + zero[..., None], 0, top)
        zeros = zero.to(torch.uint8)
    out, cols = f.shape
    codes = q.reshape(out, -1)[:, :cols].to(torch.uint8).contiguous()
    return Quantized(spec, (out, cols), codes, scale.to(torch.float16), zeros)


def _grouped(f: torch.Tensor, group: int) -> torch.Tensor:
    """``f`` as float32 (out, groups, group), the last group zero-padded; checks dtype, shape and finiteness."""
    if not isinstance(f, torch.Tensor) or not f.is_floating_point() or f.dim() != 2:
        raise ValueError("quantize takes a 2-D floating-point tensor (out x in).")
    _check_shape(*f.shape)
    w = f.detach().float()
    if torch.isnan(w).any():
        raise ValueError("the weight holds NaN; quantization needs finite values.")
    if torch.isinf(w).any():
        raise ValueError("the weight holds an infinity; quantization needs finite values.")
    pad = -w.shape[1] % group
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))  # zeros change neither max|w| nor a range that holds 0
    return w.reshape(w.shape[0], -1, group)


def _fp16_scale(scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scales rounded to float16 and back to float32; raises when one cannot be stored."""
    if (scale > FP16_MAX).any():
        raise ValueError(f"a group spans more than {FP16_MAX:g} per level: the weight cannot be stored with "
                         "float16 scales.")
    return scale.half().float()  # a scale below float16's range flushes to 0: its group is stored as zeros


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Scale 0 only for all-zero groups; divide those by 1 so their codes come out as the zero level."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit values (any shape, flattened in row-major order) into ceil(n*bits/8) bytes.

    Value i occupies bits [i*bits, (i+1)*bits) of the stream; bit 0 is the least significant bit of byte 0.

    >>> pack(torch.tensor([1, 2, 3], dtype=torch.uint8), 3).tolist()   # 001 010 011 -> 0b11_010_001, 0b0
    [209, 0]
    """
    _check_bits(bits)
    v = values.reshape(-1)
    if v.dtype != torch.uint8:
        raise ValueError(f"pack takes uint8 values, got {v.dtype}.")
    if bits < 8 and v.numel() and int(v.max()) >= 2 ** bits:
        raise ValueError(f"a value {int(v.max())} does not fit in {bits} bits.")
    if bits == 8:
        return v.clone()
    shifts = torch.arange(bits, dtype=torch.uint8)
    stream = ((v[:, None] >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8))
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.int32)
    return (stream.reshape(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` values that ``pack`` stored, as uint8 1-D.

    >>> unpack(torch.tensor([209, 0], dtype=torch.uint8), 3, 3).tolist()
    [1, 2, 3]
    """
    _check_bits(bits)
    need = math.ceil(count * bits / 8)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != need:
        raise ValueError(f"{count} values at {bits} bits are {need} packed uint8 bytes, got {packed.dtype} "
                         f"{tuple(packed.shape)}.")
    if bits == 8:
        return packed.clone()
    stream = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:count * bits]
    weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.int32)
    return (stream.reshape(count, bits).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}.")
