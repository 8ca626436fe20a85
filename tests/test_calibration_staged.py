"""Tier 3's staged measurements (auditor/calibration/measure/staged.py): a plan decided on the head of the search rows reads
only those; a plan near the tolerance reads every search row (stage by stage, doubling) and gets what the Evaluator
gives on them; the dense model runs once per row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from auditor.calibration.data.inputs import Batch, Calibration
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.measure.staged import StagedEvaluator, stage_ends
from auditor.errors import AuditError


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def _batches(rows: int = 64, per: int = 8) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [Batch((torch.randn(per, 16, generator=g),), {}) for _ in range(rows // per)]


def _noisy(model: nn.Module, scale: float) -> nn.Module:
    import copy

    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return new


def _on(model: nn.Module, batches: list[Batch], tol: float, other: nn.Module):
    return Evaluator(model, Calibration([], batches), Metric(tolerance=tol)).measure(other)


def test_a_plan_far_from_the_tolerance_reads_the_head_only_and_one_near_it_every_row():
    dense, batches = _net(), _batches()
    near = _noisy(dense, 0.05)
    tol = _on(dense, batches, 0.01, near).value  # the tolerance at the plan's own value: the head cannot decide it
    staged = StagedEvaluator(dense, batches, Metric(tolerance=tol))
    assert staged.head.rows == 16  # a quarter of 64 rows, at least 16

    far = _noisy(dense, 1.0)
    m = staged.measure(far)
    head = _on(dense, batches[:2], tol, far)  # the head: the first 16 rows
    assert staged.last_rows == 16 and not m.ok
    assert m.value == pytest.approx(head.value, rel=1e-9) and m.top1 == pytest.approx(head.top1, rel=1e-12)

    m = staged.measure(near)
    every = _on(dense, batches, tol, near)
    assert staged.last_rows == 64 and staged.full == 1
    assert m.value == pytest.approx(every.value, rel=1e-9) and m.top1 == pytest.approx(every.top1, rel=1e-12)
    assert staged.evaluations == 2 and staged.reference == 0.0


def test_the_dense_model_runs_once_per_row():
    dense, batches = _net(), _batches()
    near, far = _noisy(dense, 0.05), _noisy(dense, 1.0)  # copies made before the dense model is counted
    tol = _on(_net(), batches, 0.01, near).value
    calls: list[int] = []
    dense.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    staged = StagedEvaluator(dense, batches, Metric(tolerance=tol))
    assert sum(calls) == 16 + 8  # the head, and batch 0 again: the forward must repeat
    staged.measure(near)
    staged.measure(near)
    staged.measure(far)
    assert staged.full == 2 and sum(calls) == 64 + 8  # the tail once, when a plan first needed it


def test_few_search_rows_are_measured_in_one_stage():
    dense, batches = _net(), _batches(rows=24)
    staged = StagedEvaluator(dense, batches, Metric(tolerance=1e-9))
    m = staged.measure(_noisy(dense, 1.0))
    assert staged.stages == 1 and staged.last_rows == 24
    assert m.value == pytest.approx(_on(dense, batches, 1e-9, _noisy(dense, 1.0)).value, rel=1e-9)


def test_a_forward_that_does_not_repeat_is_refused():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    with pytest.raises(AuditError, match="does not repeat"):
        StagedEvaluator(dense, _batches(), Metric(tolerance=0.01))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(20, 16), nn.Linear(16, 20)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(input_ids)))


@pytest.mark.parametrize("kind", ["perplexity", "kl"])
def test_a_language_models_staged_value_is_the_evaluators_on_the_rows_it_read(kind):
    dense = _TinyLM().eval()
    g = torch.Generator().manual_seed(3)
    batches = [Batch((), {"input_ids": torch.randint(0, 20, (8, 12), generator=g)}) for _ in range(8)]
    near, far = _noisy(dense, 0.02), _noisy(dense, 0.0)
    with torch.no_grad():
        far.head.weight.mul_(8.0)  # confident logits: far from the dense model's perplexity and distribution

    def on(rows: list[Batch], tol: float, other: nn.Module):
        return Evaluator(dense, Calibration([], rows), Metric(kind=kind, tolerance=tol)).measure(other)

    tol = on(batches, 1.0, near).value
    staged = StagedEvaluator(dense, batches, Metric(kind=kind, tolerance=tol))
    m = staged.measure(far)
    assert staged.last_rows == 16 and not m.ok
    assert m.value == pytest.approx(on(batches[:2], tol, far).value, rel=1e-6)
    m, every = staged.measure(near), on(batches, tol, near)
    assert staged.last_rows == 64 and m.value == pytest.approx(every.value, rel=1e-6)
    if kind == "kl":
        assert m.top1 == pytest.approx(every.top1, rel=1e-12) and all(v.rows_scorer._dense is staged.head.rows_scorer._dense for v in staged.built[1:])
    else:
        ref = Evaluator(dense, Calibration([], batches), Metric(kind=kind, tolerance=tol)).reference
        assert staged.reference == pytest.approx(ref, rel=1e-9) and m.absolute == pytest.approx(every.absolute, rel=1e-9)


def test_unbatched_examples_are_never_cut():
    dense = _net()
    g = torch.Generator().manual_seed(4)
    batches = [Batch((torch.randn(16, generator=g),), {}) for _ in range(10)]  # one example each: "rows" 16
    staged = StagedEvaluator(dense, batches, Metric(tolerance=1e-9))
    assert len(staged.head.batches) == 1 and all(b.args[0].shape == (16,) for part in staged._parts for b in part)
    assert sum(len(part) for part in staged._parts) == 10
    m = staged.measure(_noisy(dense, 1.0))
    assert m.value == pytest.approx(_on(dense, batches[:1], 1e-9, _noisy(dense, 1.0)).value, rel=1e-9)


@pytest.mark.parametrize("rows, ends", [(1, [1]), (24, [24]), (32, [16, 32]), (64, [16, 32, 64]), (82, [16, 32, 82]),
                                        (128, [16, 32, 64, 128]), (160, [16, 32, 64, 160])])
def test_the_stages_double_from_the_head_to_the_last_search_row(rows, ends):
    assert stage_ends(rows) == ends


def test_a_plan_reads_stages_until_its_interval_leaves_the_tolerance():
    dense, batches = _net(), _batches(rows=128)
    near = _noisy(dense, 0.05)
    every = _on(dense, batches, 0.01, near).value
    for factor, rows in ((3.0, 16), (1.3, 32), (1.2, 64), (1.05, 128)):  # the tolerance nearer the plan's value
        staged = StagedEvaluator(dense, batches, Metric(tolerance=every * factor))
        m = staged.measure(near)
        assert staged.last_rows == rows and staged.full == (rows == 128) and m.ok
        assert m.value == pytest.approx(_on(dense, batches[:rows // 8], 0.01, near).value, rel=1e-9)


@pytest.mark.parametrize("rows", [16, 32, 64])
def test_measure_rows_reads_exactly_a_plans_stages_whatever_its_interval_says(rows):
    """The uniform baseline beside a plan reads the rows the plan read: ``measure_rows`` stops at that stage's end
    (a model far from the tolerance included, which ``measure`` would decide on the head) and gives what the
    Evaluator gives on those rows."""
    dense, batches = _net(), _batches()
    far = _noisy(dense, 1.0)
    staged = StagedEvaluator(dense, batches, Metric(tolerance=0.01))
    assert stage_ends(64) == [16, 32, 64]
    m = staged.measure_rows(far, rows)
    ref = _on(dense, batches[:rows // 8], 0.01, far)
    assert staged.last_rows == staged.rows_read == rows and staged.full == 0 and staged.evaluations == 1
    assert m.value == pytest.approx(ref.value, rel=1e-9) and m.top1 == pytest.approx(ref.top1, rel=1e-12)
    assert not staged.measure(far).ok and staged.last_rows == 16  # measure decides it on the head alone


def test_the_references_evaluator_runs_no_second_repeat_check():
    """Beside a staged search, which ran the dense repeat check on the first search rows, the references' evaluator
    on every search row runs the dense model once a row, not batch 0 once more; built alone (``evaluator_of``) it
    runs the check itself."""
    from auditor.calibration.references import evaluator_of, references_of
    from auditor.calibration.session import CalibrationSession

    dense = _net()
    session = CalibrationSession(dense, Calibration(_batches(16), _batches()), Metric(tolerance=0.01), split=True)
    calls: list[int] = []
    dense.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    refs = references_of(session)
    assert refs.search.repeats_checked
    before = sum(calls)
    assert refs.evaluator.rows_read == refs.search_rows
    assert sum(calls) - before == refs.search_rows  # the dense reference, once a row
    calls.clear()
    evaluator_of(session)
    assert sum(calls) == refs.search_rows + 8  # and batch 0 again: the forward must repeat
