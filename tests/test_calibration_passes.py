"""The calibration stage's parts that issue 36 made one of each: the kinds answer the gradient pass's questions, one
loop patches repeated blocks, one recovery settings type validated once, frozen report rows, one protocol for what
tier 3 measures plans with, one truncator store."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from auditor import kinds
from auditor.calibration import load_calibration
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.recovery import RecoverySettings
from auditor.calibration.statistics.stream import patched_forwards
from auditor.calibration.statistics.whiten import TruncatorStore
from auditor.calibration.tiers.fisher import GRADIENT_KINDS
from auditor.calresults import LayerCalibration
from auditor.errors import AuditError
from auditor.kinds.base import LayerKind
from auditor.options import AuditOptions, RecoveryOptions
from auditor.results import Kind, Layer


def _layer(kind: str, m: int = 6, n: int = 4) -> Layer:
    return Layer(name="x", param="x.weight", kind=kind, module_type="Linear", shape=(m, n), m=m, n=n)


def test_the_gradient_pass_asks_the_kinds_and_a_new_kind_is_in_it():
    assert sorted(GRADIENT_KINDS) == sorted([Kind.LINEAR, Kind.CONV1D_HF, Kind.EMBEDDING])
    assert Kind.CONV not in GRADIENT_KINDS and Kind.RNN not in GRADIENT_KINDS
    emb, lin = kinds.for_kind(Kind.EMBEDDING), kinds.for_kind(Kind.LINEAR)
    assert emb.function_shape(_layer(Kind.EMBEDDING)) == (4, 6) and lin.function_shape(_layer(Kind.LINEAR)) == (6, 4)
    w = torch.arange(24.0).reshape(6, 4)
    assert lin.function_view(_layer(Kind.LINEAR), w) is w
    assert torch.equal(kinds.for_kind(Kind.CONV1D_HF).function_view(_layer(Kind.CONV1D_HF), w), w.t())
    assert emb.lookup_counts and not lin.lookup_counts and lin.cut_to_rank1 and not emb.cut_to_rank1

    class ScaledKind(LayerKind):
        kind = "scaled-36"
        finds = {}
        gradient_sensitivity = True

    kinds.register(ScaledKind())
    try:
        assert "scaled-36" in GRADIENT_KINDS  # a live view: nobody edits a table
    finally:
        kinds.registry.unregister(kinds.for_kind("scaled-36"))
    assert "scaled-36" not in GRADIENT_KINDS


def test_patched_forwards_restores_each_blocks_own_forward_also_on_error():
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    own = lambda x: x  # noqa: E731 - an instance attribute of its own, kept as it was
    blocks[1].forward = own
    seen = []
    with pytest.raises(RuntimeError, match="stop"):
        with patched_forwards(blocks, lambda i, blk: (lambda *a, **k: seen.append(i) or i)):
            assert [blk(torch.zeros(2)) for blk in blocks] == [0, 1]
            raise RuntimeError("stop")
    assert seen == [0, 1]
    assert "forward" not in blocks[0].__dict__ and blocks[1].__dict__["forward"] is own


def test_one_recovery_settings_type_with_one_check():
    assert issubclass(RecoverySettings, RecoveryOptions)
    bad = dict(lr=-1.0)
    with pytest.raises(AuditError) as via_options:
        AuditOptions(calibration="c.pt", budget=0.5, recover_steps=3, recover_lr=-1.0)
    with pytest.raises(AuditError) as via_settings:
        RecoverySettings(steps=3, **bad).check()
    assert str(via_options.value) == str(via_settings.value) == (
        "recovery learning rate -1.0 is not a positive finite number. Give e.g. --recover-lr 0.0001.")
    with pytest.raises(AuditError, match="recovery gradient clip 0 is not a positive finite number"):
        RecoverySettings(steps=3, clip=0).check()
    with pytest.raises(TypeError):
        RecoverySettings(3, 1e-4, "factors", "auto", 0, False, None)  # the recovery's own fields are keywords only


def test_the_report_rows_are_frozen():
    row = LayerCalibration("fc", 10, 4, {}, 2, "factorize", "", [(0, 1.0)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.floor = None  # type: ignore[misc]


def test_an_evaluator_says_the_rows_it_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    cal = load_calibration({"input": torch.randn(40, 4)}, model, holdout=0.25)
    ev = Evaluator(model, cal, Metric())
    assert ev.rows_read == cal.holdout_rows == 10
    assert ev.measure(model).value == 0.0 and ev.evaluations == 1


def test_one_truncator_store_spills_or_drops_what_does_not_fit():
    class T:  # a Truncator's arrays: F (1, 4, 4) and one U (4 x 4), float64
        def __init__(self) -> None:
            self.f = np.zeros((1, 4, 4))
            self.u = [np.zeros((4, 4))]

        def parts(self) -> dict[str, list[np.ndarray]]:
            return {"u": self.u}

    dropped = TruncatorStore(300, spill=False)
    dropped["a"], dropped["b"] = T(), T()
    assert list(dropped) == ["a"] and dropped.bytes == 256 and dropped.refused == 1 and dropped.spilled == 0
    assert dropped.get("b") is None
