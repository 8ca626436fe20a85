"""Log-probabilities a chunk of positions at a time (auditor/calibration/metrics/chunks.py) give the whole-batch
computation's numbers bit for bit: the picked log-probabilities, the sampled labels, the NLL's gradient in the
logits, the KL terms; and no chunk holds more than CHUNK_VALUES logits."""

from __future__ import annotations

import pytest
import torch

from auditor.calibration.metrics import chunks
from auditor.calibration.metrics.chunks import Scored, kl_terms

V = 50


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_VALUES", 3 * V + 7)  # 3 positions a chunk: several chunks, a short last one


def _batch(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (3 * torch.randn(3, 7, V, generator=g)).to(dtype)
    keep = torch.rand(3, 6, generator=g) > 0.3
    tgt = torch.randint(0, V, (3, 6), generator=g)
    return y, keep, tgt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_picked_and_sampled_equal_the_whole_batch(dtype):
    y, keep, tgt = _batch(dtype)
    sc = Scored.of(y, keep, tgt)
    whole = torch.log_softmax(y[:, :-1][keep].float(), dim=-1)
    assert len(sc) == int(keep.sum()) == 13 and len(list(sc.spans())) == 5
    assert torch.equal(sc.picked(), whole.gather(1, tgt[keep][:, None])[:, 0])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):  # successive draws from one generator, as the gradient pass makes them
        assert torch.equal(sc.sample(g1), torch.multinomial(whole.exp(), 1, generator=g2)[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nll_gradient_equals_autograd_through_log_softmax(dtype):
    y, keep, tgt = _batch(dtype, 1)
    labels = tgt[keep]
    a = y.clone().requires_grad_(True)
    b = y.clone().requires_grad_(True)
    loss = Scored.of(a, keep, tgt).nll(labels)
    whole = torch.log_softmax(b[:, :-1][keep].float(), dim=-1)
    ref = -whole.gather(1, labels[:, None]).sum()
    (ga,) = torch.autograd.grad(loss, [a])
    (gb,) = torch.autograd.grad(ref, [b])
    assert ga.dtype == dtype and torch.equal(ga, gb)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert ga[:, -1].abs().sum() == 0  # the last position predicts nothing: no gradient


def test_kl_terms_equal_the_whole_batch():
    y, keep, tgt = _batch(torch.float32, 2)
    z = y + 0.5 * torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    k, same = kl_terms(Scored.of(y, keep, tgt), Scored.of(z, keep, tgt))
    p = torch.log_softmax(y[:, :-1][keep], -1)
    q = torch.log_softmax(z[:, :-1][keep], -1)
    assert torch.equal(k, (p.exp() * (p - q)).sum(-1))
    assert torch.equal(same, p.argmax(-1) == q.argmax(-1))
    assert 0 < int(same.sum()) < len(same)


def test_no_chunk_holds_more_than_chunk_values():
    y, keep, tgt = _batch(torch.float32)
    seen = []
    real = Scored.chunk_logits

    def spy(self, s):
        out = real(self, s)
        seen.append(out.numel())
        return out

    sc = Scored.of(y, keep, tgt)
    Scored.chunk_logits = spy  # type: ignore[method-assign]
    try:
        sc.picked()
    finally:
        Scored.chunk_logits = real  # type: ignore[method-assign]
    assert max(seen) <= chunks.CHUNK_VALUES and sum(seen) == 13 * V


def test_nothing_scored():
    y, keep, tgt = _batch(torch.float32)
    sc = Scored.of(y, torch.zeros_like(keep), tgt)
    assert len(sc) == 0 and sc.picked().shape == (0,) and sc.sample(torch.Generator()).shape == (0,)


transformers = pytest.importorskip("transformers")


def _lm(vocab: int = 96):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_batches_cut_to_the_logits_budget(monkeypatch):
    """A batch whose float32 logits would pass LOGITS_BUDGET is cut into batches of fewer rows: the same rows in
    the same order, the same digest; under the budget nothing is cut."""
    from auditor.calibration import load_calibration
    from auditor.calibration.data import inputs

    model = _lm()
    ids = torch.randint(0, 96, (20, 16), generator=torch.Generator().manual_seed(2))
    whole = load_calibration({"input_ids": ids}, model, holdout=0.25, batch_size=8)
    assert [b.rows for b in whole.fit] == [8, 7] and [b.rows for b in whole.holdout] == [5]
    monkeypatch.setattr(inputs, "LOGITS_BUDGET", 3 * 16 * 96 * 4 + 5)  # three rows of 16 positions x 96 logits
    cut = load_calibration({"input_ids": ids}, model, holdout=0.25, batch_size=8)
    assert [b.rows for b in cut.fit] == [3, 3, 2, 3, 3, 1] and [b.rows for b in cut.holdout] == [3, 2]
    assert cut.digest == whole.digest
    for a, b in ((cut.fit, whole.fit), (cut.holdout, whole.holdout)):
        assert torch.equal(torch.cat([x.kwargs["input_ids"] for x in a]), torch.cat([x.kwargs["input_ids"] for x in b]))


class _Scaled(torch.nn.Module):
    """A model with an input that is not batched (a (rows,) vector of scales whose length happens to be the rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _lm()

    def forward(self, input_ids, scale):
        return self.lm(input_ids=input_ids).logits * scale.mean()


class _SeqFirst(torch.nn.Module):
    """A sequence-first model: its output is (positions, rows, vocabulary); dim 0 of its input is positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(96, 16)
        self.mix = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.head = torch.nn.Linear(16, 96)

    def forward(self, input_ids):
        return self.head(self.mix(self.emb(input_ids)))


def test_nothing_is_cut_where_rows_are_not_independent_or_not_all_batched(monkeypatch):
    """The cut needs every tensor batched along dim 0 and rows whose outputs do not depend on each other: an unbatched
    input whose length equals the rows, a sequence-first model and a model left in training mode (the probe runs in
    eval mode and writes nothing) are left whole."""
    from auditor.calibration import load_calibration
    from auditor.calibration.data import inputs

    monkeypatch.setattr(inputs, "LOGITS_BUDGET", 3 * 16 * 96 * 4 + 5)
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(2))
    scaled = load_calibration([{"input_ids": ids, "scale": torch.arange(1.0, 9.0)}], _Scaled(), holdout=0.0)
    assert [b.rows for b in scaled.fit] == [8]
    seq = load_calibration({"input_ids": ids.T.contiguous()}, _SeqFirst().eval(), holdout=0.0, batch_size=16)
    assert [b.rows for b in seq.fit] == [16]  # 16 positions first: not rows
    bn = torch.nn.Sequential(torch.nn.Embedding(96, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 96))
    before = bn[1].num_batches_tracked.clone()
    mean = bn[1].running_mean.clone()
    load_calibration({"input_ids": ids}, bn.train(), holdout=0.0, batch_size=8)  # the probes and the load's check
    assert torch.equal(bn[1].num_batches_tracked, before) and torch.equal(bn[1].running_mean, mean) and bn.training


def test_row_scorers_refuse_logits_of_another_length():
    """The per-row perplexity and KL scorers check the logits against the ids as the whole-batch scorers do: a model
    whose output has one more position is one line, not a silently misaligned score."""
    from auditor.calibration.data.inputs import Batch
    from auditor.calibration.metrics import kl, perplexity
    from auditor.errors import AuditError

    class Longer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = _lm()

        def forward(self, input_ids):
            y = self.lm(input_ids=input_ids).logits
            return torch.cat([y, y[:, -1:]], dim=1)

    b = [Batch((), {"input_ids": torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(4))})]
    for kind in (perplexity.KIND, kl.KIND):
        with pytest.raises(AuditError, match="needs logits"):
            kind.row_scorer(Longer(), b).sums(Longer())


def test_the_repeat_check_compares_a_chunk_at_a_time(monkeypatch):
    """The dense model's determinism check compares two runs' outputs in float64 a chunk at a time: the same
    relative gap as over the whole output (NaN with NaN and the same infinity equal), another shape infinite."""
    from auditor.calibration.measure import metric

    monkeypatch.setattr(metric, "REPEAT_CHUNK", 7)
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[0, 0, 0], x[1, 1, 1] = float("nan"), float("inf")
    y = x.clone()
    assert metric._repeat_gap(x, y) == 0.0
    y[2, 4, 3] += 0.5
    scale = float(torch.where(torch.isfinite(x.double()), x.double().abs(), torch.zeros(1, dtype=torch.float64)).max())
    gap = abs(float(y[2, 4, 3].double()) - float(x[2, 4, 3].double())) / scale
    assert metric._repeat_gap(x, y) == pytest.approx(gap, rel=1e-12) and gap > 0
    assert metric._repeat_gap(x, y[:2]) == float("inf")


def test_equal_runs_are_no_gap_without_a_float64_copy(monkeypatch):
    """Two runs equal element for element in their own dtype (a deterministic forward's) are a gap of 0 in one pass:
    no chunk is made float64; runs that differ (or hold a NaN, which equals nothing) are compared in float64."""
    from auditor.calibration.measure import metric

    made: list[int] = []
    real = torch.Tensor.double
    monkeypatch.setattr(torch.Tensor, "double", lambda t: made.append(t.numel()) or real(t))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert metric._repeat_gap(x, x.clone()) == 0.0 and made == []
    y = x.clone()
    y[3, 5] += 1.0
    assert metric._repeat_gap(x, y) > 0 and made
    made.clear()
    x[0, 0] = float("nan")
    assert metric._repeat_gap(x, x.clone()) == 0.0 and made  # NaN with NaN: equal, found the slow way


def test_the_refusal_of_ids_beyond_the_logits_names_the_tokens_scored():
    """The kinds' ``scored`` words (next-token, masked-token) stay words beside their ``scored_positions`` method:
    ids beyond the logits are refused in one line naming which tokens the metric scores."""
    from auditor.calibration.data.inputs import Batch
    from auditor.calibration.metrics import masked, perplexity
    from auditor.errors import AuditError

    class WideIn(torch.nn.Module):  # looks up 200 ids, scores 96
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(200, 16), torch.nn.Linear(16, 96)

        def forward(self, input_ids):
            return self.head(self.emb(input_ids))

    wide_in = WideIn()
    b = [Batch((), {"input_ids": torch.full((2, 6), 150)})]
    for kind, words in ((perplexity.KIND, "the next-token metric"), (masked.KIND, "the masked-token metric")):
        with pytest.raises(AuditError, match=f"{words} scores them against the model's 96 logits"):
            kind.row_scorer(wide_in, b)


def test_the_first_rows_stand_for_the_first_batch_where_rows_are_independent():
    """The read runs the first batch's first two rows together and its second alone; where those show the rows
    independent (a language model) the whole first batch is not run again (a 7B model's batch is minutes of CPU);
    where they cannot (a sequence-first model, an unbatched input) the whole first batch runs, as before."""
    from auditor.calibration import load_calibration

    def rows_run(model: torch.nn.Module, **batch: torch.Tensor) -> list[int]:
        seen: list[int] = []
        hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(int(k["input_ids"].shape[0])),
                                               with_kwargs=True)
        try:
            load_calibration([batch], model, holdout=0.0)
        finally:
            hook.remove()
        return seen

    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(2))
    assert rows_run(_lm(), input_ids=ids) == [2, 1]
    assert rows_run(_Scaled(), input_ids=ids, scale=torch.arange(1.0, 9.0)) == [2, 1, 8]
