"""The rounding floor of a low-precision model: the digits MLP cast to bfloat16 (and float16), every plannable layer
factorized at full rank, measures what a hand computation of the relative output error gives; a float32 model gets
no floor and its report no new line or key."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import auditor
from auditor.calibration import load_calibration
from auditor.factorize import factorize


@pytest.fixture(scope="module")
def rows():
    from digits import digits

    return digits(800)  # 600 fit rows: every layer's inputs (fc2, fc3: 512 wide) spanned, so every layer is planned


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(model).to(dtype).eval()


def _hand(model: torch.nn.Module, x: torch.Tensor, ranks: dict[str, int], threads: int | None = 1) -> float:
    """The relative output error on the held-out quarter's search half (the rows the audit searches on) with
    ``ranks`` factorized as the audit factorizes them (loss-aware: one gradient pass on the fit rows, seeded as the
    audit's; statistics from the fit rows)."""
    from threadpoolctl import threadpool_limits

    from auditor.calibration.measure.verify import split_rows

    cal = load_calibration(x, model, holdout=0.25)
    with threadpool_limits(limits=threads, user_api="blas"):  # the calibration stage decomposes on one thread
        new = auditor.factorize(model, ranks, calibration=cal, fit="loss-aware")
    err2 = ref2 = 0.0
    rows = 0
    with torch.no_grad():
        for b in split_rows(cal.holdout)[0]:  # batch by batch, as the evaluator runs them (a bf16 matmul depends on its shape)
            y, y0 = new(*b.args).double(), model(*b.args).double()
            err2 += float((y - y0).pow(2).sum())
            ref2 += float(y0.pow(2).sum())
            rows += y0.numel() // 10
    assert rows == 100
    return math.sqrt(err2 / ref2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_floor_is_the_full_rank_plan_measured(digits_mlp, rows, dtype):
    model = _cast(digits_mlp[0], dtype)
    x = rows.to(dtype)
    a = auditor.audit(model, (x[:1],), calibration=x, cache=False, progress=False)
    f = a.calibration.rounding_floor
    assert f is not None and f.dtype == str(dtype).removeprefix("torch.")
    assert f.ranks == {"fc1": 64, "fc2": 512, "fc3": 256} == {n: a.layer(n).max_rank for n in f.ranks}
    assert f.layers == 3 and f.tolerance == 0.01 and f.used == f.metric
    assert f.metric == pytest.approx(_hand(model, x, f.ranks), rel=1e-6)
    # LAPACK on more threads picks another basis of the factors, so other entries round: the same floor to ~1%
    assert f.metric == pytest.approx(_hand(model, x, f.ranks, threads=None), rel=0.05)
    assert f.metric > (1e-4 if dtype == torch.bfloat16 else 1e-5)  # rounding, not float32 noise (below)
    assert _hand(_cast(digits_mlp[0], torch.float32), rows, f.ranks) < 1e-5
    d = a.calibration.to_dict()["rounding_floor"]
    assert d == {"dtype": f.dtype, "layers": 3, "metric": f.metric, "used": f.metric, "tolerance": 0.01,
                 "top1": f.top1}
    from auditor.render.parts.calibration import rounding_line, view
    from auditor.render.terminal import calibration_lines

    line = rounding_line(a.calibration)
    assert line.startswith(f"{f.dtype} rounding alone (3 layers factorized at full rank, nothing dropped): "
                           f"{f.metric:.4g} of the tolerance 0.01 ({100 * f.metric / 0.01:.0f}%)")
    assert view(a).rounding == line
    assert any(line.split(":")[0] in t for t in calibration_lines(view(a)))


def test_a_float32_model_gets_no_floor(digits_mlp, rows):
    a = auditor.audit(*digits_mlp, calibration=rows, cache=False, progress=False)
    cal = a.calibration
    assert cal.rounding_floor is None and "rounding" not in cal.seconds
    assert "rounding_floor" not in cal.to_dict()
    from auditor.render.parts.calibration import rounding_line, view
    from auditor.render.html import _calibration
    from auditor.render.terminal import calibration_lines

    assert rounding_line(cal) is None and view(a).rounding is None and view(a).md_rounding is None
    assert not any("rounding" in t for t in calibration_lines(view(a)))
    assert not any("rounding" in t for t in _calibration(a, charts=False)["calibration"]["budget"])
    assert "rounding" not in json.dumps(cal.to_dict())
    assert not [f for f in a.findings if f.code in ("LR017", "LR018")]


def test_a_model_of_blocks_is_floored_a_block_at_a_time_from_the_decompositions_tier_3_reads(tmp_path):
    """The sample Llama in bfloat16 (four repeated blocks): the floor measured with one block's full-rank factors
    mapped at a time equals the whole factorized copy's measurement exactly, and leaves every layer's decomposition
    in the store the search then reads (a 1.1B audit decomposed each layer twice, once here and once in tier 3)."""
    pytest.importorskip("transformers")
    from pathlib import Path

    import transformers

    from auditor.calibration.references import evaluator_of
    from auditor.calibration.session import CalibrationSession
    from auditor.calibration.statistics.whiten import TruncatorStore
    from auditor.calibration.tiers.rounding import rounding_floor

    llama = Path(__file__).resolve().parents[1] / "sample_models" / "llama"
    model = transformers.LlamaForCausalLM.from_pretrained(str(llama), torch_dtype=torch.bfloat16).eval()
    text = (llama / "calib.txt").read_text(encoding="utf-8")[:4000]  # a few kilobytes: 16 windows of 64 tokens
    (tmp_path / "calib.txt").write_text(text[:text.rfind("\n") + 1], encoding="utf-8")
    cal = load_calibration(str(tmp_path / "calib.txt"), model, 0.5, tokenizer=str(llama), length=64)
    a = auditor.audit(model, (cal.fit[0].kwargs["input_ids"][:1],), spectra=False, cache=False, progress=False)
    layers = [l for l in a.layers if l.name.startswith("model.layers.")]
    assert len(layers) == 28
    session = CalibrationSession(model, cal, layers=layers)
    store = TruncatorStore(0)  # nothing kept in memory: every decomposition spilled and read back
    ev = evaluator_of(session)
    f = rounding_floor(model, layers, session, store, ev)
    assert f is not None and f.layers == 28 and f.dtype == "bfloat16"
    assert len(store) + store.spilled == 28  # each layer decomposed once, for the floor and the search alike
    with session.measuring():
        whole = ev.measure(factorize(model, f.ranks, session))
    assert f.metric == whole.value and f.metric > 0
