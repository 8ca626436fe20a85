"""The masked-token metric: on a tiny random BertForMaskedLM with a right-padded held-out batch and a fixed mask,
the masked-token perplexity (labels at the masked positions, pads excluded) equals a hand computation, its increase
is what the tolerance judges, and a masked LM gets it by default."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration
from auditor.calibration.data.inputs import Batch
from auditor.calibration.measure.metric import NO_LABELS, Evaluator, Metric, is_causal_lm, is_masked_lm
from auditor.calibration.metrics.common import masked_targets
from auditor.calibration.session import metric_of
from auditor.errors import AuditError

transformers = pytest.importorskip("transformers")

VOCAB, PAD, MASK = 53, 0, 1
LENGTHS = [8, 6, 3]  # real tokens per row
MASKED = [(0, 1), (0, 5), (1, 0), (1, 4), (2, 2), (2, 6)]  # (row, position); (2, 6) is a pad: never scored


def _bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, pad_token_id=PAD, initializer_range=0.3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg).eval()


def _held() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    orig = torch.randint(2, VOCAB, (3, 8), generator=g)
    mask = torch.zeros_like(orig)
    for r, n in enumerate(LENGTHS):
        mask[r, :n] = 1
    orig = torch.where(mask.bool(), orig, torch.full_like(orig, PAD))
    ids, labels = orig.clone(), torch.full_like(orig, -100)
    for r, t in MASKED:
        ids[r, t] = MASK
        labels[r, t] = orig[r, t]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, orig


@pytest.fixture(scope="module")
def mlm():
    model = _bert()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (6, 8), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    fit = {"input_ids": ids, "attention_mask": torch.ones(6, 8, dtype=torch.long), "labels": labels}
    held, orig = _held()
    return model, load_calibration(fit, model, holdout=held, batch_size=8), held, orig


def _hand(model: nn.Module, held: dict[str, torch.Tensor], orig: torch.Tensor) -> float:
    """exp(mean cross-entropy) over the masked real positions, each row run alone without its pads."""
    nll, count = 0.0, 0
    for r, n in enumerate(LENGTHS):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=held["input_ids"][r:r + 1, :n]).logits[0].double(), -1)
        for rr, t in MASKED:
            if rr == r and t < n:
                nll -= float(logp[t, orig[r, t]])
                count += 1
    assert count == 5  # the masked pad is not scored
    return math.exp(nll / count)


def _perturbed(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = other.cls.predictions.transform.dense.weight
        w.add_(0.3 * torch.randn(w.shape, generator=g))
    return other


def test_masked_perplexity_equals_a_hand_computation(mlm):
    model, cal, held, orig = mlm
    ev = Evaluator(model, cal, Metric(kind="masked", tolerance=0.02))
    want = _hand(model, held, orig)
    assert ev.reference == pytest.approx(want, rel=1e-5)
    assert 1.0 < want < 10 * VOCAB
    other = _perturbed(model)
    ppl = _hand(other, held, orig)
    m = ev.measure(other)
    assert m.absolute == pytest.approx(ppl, rel=1e-5)
    assert m.value == pytest.approx(ppl / want - 1.0, rel=1e-4)
    assert abs(m.value) > 1e-2 and m.ok == (m.value <= 0.02)
    assert ev.measure(model).value == pytest.approx(0.0, abs=1e-6)
    assert not ev.metric.higher_is_better and ev.metric.label == "masked-token perplexity increase"
    assert NO_LABELS not in cal.warnings


def test_the_masked_positions_are_the_labels(mlm):
    """Scoring every position instead (no labels) gives another number, and says so on the calibration."""
    model, cal, held, orig = mlm
    plain = {"input_ids": held["input_ids"], "attention_mask": held["attention_mask"]}
    cal2 = load_calibration(plain, model, holdout=plain, batch_size=8)
    assert NO_LABELS not in cal2.warnings
    ev = Evaluator(model, cal2, Metric(kind="masked"))
    assert NO_LABELS in ev.warnings and NO_LABELS not in cal2.warnings
    nll, count = 0.0, 0
    with torch.no_grad():
        for r, n in enumerate(LENGTHS):
            ids = held["input_ids"][r:r + 1, :n]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            nll -= float(logp[torch.arange(n), ids[0]].sum())
            count += n
    assert ev.reference == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert ev.reference != pytest.approx(_hand(model, held, orig), rel=1e-2)
    none = dict(held, labels=torch.full_like(held["labels"], -100))
    with pytest.raises(AuditError, match="no masked position"):
        Evaluator(model, load_calibration(none, model, holdout=none, batch_size=8), Metric(kind="masked"))
    bad = Batch((), dict(held, labels=held["labels"][:, :4]))  # (the loader's forward refuses it first for BERT)
    with pytest.raises(AuditError, match="labels shaped like input_ids"):
        masked_targets(bad)


def test_a_masked_lm_gets_the_masked_metric_by_default(mlm):
    model, cal, _, _ = mlm
    assert is_masked_lm(model) and not is_causal_lm(model, cal.measure[0])
    opts = SimpleNamespace(metric=None, tolerance=None)
    assert metric_of(opts, model, cal) == Metric(kind="masked")
    for name in ("masked-ce", "masked-perplexity", "MLM"):
        assert metric_of(SimpleNamespace(metric=name, tolerance=0.05), model, cal) == Metric(kind="masked",
                                                                                             tolerance=0.05)
    assert metric_of(SimpleNamespace(metric="output-error", tolerance=None), model, cal).kind == "output"
    with pytest.raises(ValueError, match="lower-is-better"):
        Metric(kind="masked", higher_is_better=True)
