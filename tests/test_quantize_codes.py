"""Group-wise integer codes: exact byte formulas, bit packing, hand-computed small cases and error bounds."""

from __future__ import annotations

import pytest
import torch

from auditor.quantize.codes import QuantSpec, Quantized, pack, quantize, unpack

MODES = [True, False]


def fp16(x: float) -> float:
    return torch.tensor(x).half().item()


@pytest.mark.parametrize(("spec", "out", "cols", "codes", "scales", "zeros"), [
    (QuantSpec(4), 4096, 4096, 8_388_608, 262_144, 0),
    (QuantSpec(4, symmetric=False), 4096, 4096, 8_388_608, 262_144, 65_536),
    (QuantSpec(3), 4096, 4096, 6_291_456, 262_144, 0),
    (QuantSpec(4, 128), 10, 300, 1_500, 60, 0),  # 3 groups per row: 128 + 128 + 44
    (QuantSpec(3, 128, False), 3, 300, 338, 18, 4),  # ceil(2700/8), 9 zeros at 3 bits -> ceil(27/8)
    (QuantSpec(8, 1, False), 1, 1, 1, 2, 1),
])
def test_byte_formulas(spec: QuantSpec, out: int, cols: int, codes: int, scales: int, zeros: int) -> None:
    assert (spec.code_bytes(out, cols), spec.scale_bytes(out, cols), spec.zero_bytes(out, cols)) == (
        codes, scales, zeros)
    assert spec.nbytes(out, cols) == codes + scales + zeros
    assert spec.bits_per_weight(out, cols) == 8 * (codes + scales + zeros) / (out * cols)


def test_bits_per_weight_and_groups() -> None:
    assert QuantSpec(4).bits_per_weight(4096, 4096) == 4.125
    assert QuantSpec(4, symmetric=False).bits_per_weight(4096, 4096) == 4.15625
    assert QuantSpec(4).groups(300) == 3 and QuantSpec(4).groups(256) == 2 and QuantSpec(4).groups(1) == 1


def test_labels_round_trip_and_bad_specs() -> None:
    for bits in range(2, 9):
        for group in (1, 32, 128):
            for sym in MODES:
                spec = QuantSpec(bits, group, sym)
                assert QuantSpec.parse(spec.label) == spec
    assert QuantSpec(3, symmetric=False).label == "int3 g128 asym"
    assert QuantSpec.parse("int4") == QuantSpec(4, 128, True)
    for text in ("int4 g128", "INT4", "int4 g128 sym ", "int9", "int1 g8 sym", "int4 g0 sym", "fp8"):
        with pytest.raises(ValueError):
            QuantSpec.parse(text)
    with pytest.raises(ValueError, match="bits must be"):
        QuantSpec(9)
    with pytest.raises(ValueError, match="group must be"):
        QuantSpec(4, 0)
    with pytest.raises(ValueError, match="at least one row"):
        QuantSpec(4).nbytes(0, 10)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 13, 1001])
def test_pack_unpack_round_trip(bits: int, count: int) -> None:
    values = torch.randint(0, 2 ** bits, (count,), generator=torch.Generator().manual_seed(bits * count),
                           dtype=torch.uint8)
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack(packed, bits, count), values)


def test_pack_bit_order_and_errors() -> None:
    assert pack(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).tolist() == [0b10_01_00_11]
    assert pack(torch.tensor([[5, 6]], dtype=torch.uint8), 4).tolist() == [0x65]
    with pytest.raises(ValueError, match="does not fit"):
        pack(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="packed uint8 bytes"):
        unpack(torch.zeros(2, dtype=torch.uint8), 4, 5)


def test_symmetric_by_hand() -> None:
    q = quantize(torch.tensor([[0.0, 1.0, -2.0, 0.5]]), QuantSpec(4, group=4))
    s = fp16(2 / 7)
    assert s == 0.28564453125
    # 1/s = 3.50..., -2/s = -7.00..., 0.5/s = 1.75... -> 0, 4, -7, 2; offset by 8
    assert q.codes.tolist() == [[8, 12, 1, 10]] and q.scales.tolist() == [[s]] and q.zeros is None
    assert q.dequantize().tolist() == [[0.0, 4 * s, -7 * s, 2 * s]]


def test_asymmetric_by_hand() -> None:
    q = quantize(torch.tensor([[0.0, 1.0, -2.0, 0.5]]), QuantSpec(4, group=4, symmetric=False))
    s = fp16(3 / 15)
    assert s == 0.199951171875
    # zero = round(2/s) = round(10.002) = 10; w/s = 0, 5.001, -10.002, 2.5006 -> 0, 5, -10, 3; plus 10
    assert q.codes.tolist() == [[10, 15, 0, 13]] and q.zeros.tolist() == [[10]]
    assert q.dequantize().tolist() == [[0.0, 5 * s, -10 * s, 3 * s]]


def test_uneven_last_group() -> None:
    w = torch.arange(1, 11, dtype=torch.float32).reshape(1, 10)  # groups [1..4], [5..8], [9, 10]
    q = quantize(w, QuantSpec(8, group=4))
    assert q.scales.tolist() == [[fp16(4 / 127), fp16(8 / 127), fp16(10 / 127)]]
    assert q.codes.shape == (1, 10) and q.codes[0, -1].item() == 127 + 128


def random_weight(seed: int, shape: tuple[int, int] = (33, 300)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("symmetric", MODES)
def test_error_is_at_most_half_a_step(bits: int, symmetric: bool) -> None:
    w = random_weight(bits)
    q = quantize(w, QuantSpec(bits, 64, symmetric))
    step = q.scales.float().repeat_interleave(64, dim=1)[:, :300]
    group_max = w.abs().reshape(33, -1).amax(dim=1, keepdim=True)
    slack = group_max * 2.0 ** -10  # the float16 rounding of the scale, times up to 2**bits levels
    assert ((q.dequantize() - w).abs() <= step / 2 + slack).all()


def test_asymmetric_beats_symmetric_on_positive_weights() -> None:
    w = random_weight(7).abs()
    for bits in (3, 4, 8):
        sym = (quantize(w, QuantSpec(bits)).dequantize() - w).abs().max()
        asym = (quantize(w, QuantSpec(bits, symmetric=False)).dequantize() - w).abs().max()
        assert asym <= sym


@pytest.mark.parametrize("symmetric", MODES)
def test_half_precision_inputs(symmetric: bool) -> None:
    w = random_weight(3)
    for dtype in (torch.bfloat16, torch.float16):
        low = w.to(dtype)
        q = quantize(low, QuantSpec(4, symmetric=symmetric))
        assert torch.equal(q.codes, quantize(low.float(), QuantSpec(4, symmetric=symmetric)).codes)
        assert q.dequantize(dtype).dtype == dtype


@pytest.mark.parametrize("symmetric", MODES)
def test_zero_rows_and_constant_groups(symmetric: bool) -> None:
    w = torch.zeros(3, 8)
    w[1] = 0.3
    w[2, :4] = -1.7
    q = quantize(w, QuantSpec(4, group=4, symmetric=symmetric))
    back = q.dequantize()
    assert torch.equal(back[0], torch.zeros(8)) and q.scales[0].tolist() == [0.0, 0.0]
    assert torch.equal(back[2, 4:], torch.zeros(4))
    levels = 7 if symmetric else 15
    assert back[1].tolist() == [levels * fp16(0.3 / levels)] * 8  # the constant up to fp16 scale rounding
    assert back[2, :4].tolist() == [-levels * fp16(1.7 / levels)] * 4
    assert (back[1] - 0.3).abs().max() <= 0.3 * 2.0 ** -10


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_raise(bad: float) -> None:
    w = torch.ones(2, 4)
    w[1, 2] = bad
    with pytest.raises(ValueError, match="NaN" if bad != bad else "infinity"):
        quantize(w, QuantSpec(4))


def test_scales_float16_cannot_hold_raise() -> None:
    with pytest.raises(ValueError, match="cannot be stored with float16 scales"):
        quantize(torch.tensor([[1e6, 0.0]]), QuantSpec(4))
    tiny = quantize(torch.tensor([[1e-9, 0.0, 2e-9, -1e-9], [1.0, 0.5, 0.0, -1.0]]), QuantSpec(4, group=4))
    assert tiny.scales[0, 0] == 0 and torch.equal(tiny.dequantize()[0], torch.zeros(4))  # below float16: zeros
    assert tiny.dequantize()[1].tolist() == pytest.approx([1.0, 4 / 7, 0.0, -1.0], abs=1e-3)
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize(torch.ones(4, dtype=torch.float32), QuantSpec(4))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", MODES)
def test_packed_bytes_and_round_trip(bits: int, symmetric: bool) -> None:
    w = random_weight(bits, (5, 77))
    spec = QuantSpec(bits, 32, symmetric)
    q = quantize(w, spec)
    tensors = q.packed()
    assert set(tensors) == ({"codes", "scales"} if symmetric else {"codes", "scales", "zeros"})
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == q.nbytes == spec.nbytes(5, 77)
    back = Quantized.from_packed(spec, (5, 77), tensors)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(back.dequantize(), q.dequantize())
