"""Language-model metrics and padding: held-out perplexity and next-token KL equal hand computations on a tiny random
GPT-2 with a right-padded batch (the pads excluded); padded batches give the Grams of their real tokens only; the
default metric follows the model; the prefix cache gives the uncached numbers for a metric that slices its batch and
for a tied weight whose first-declared use runs last; ``--holdout 0`` is refused where the metric is measured; the
exported model measures what plan.json says."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from auditor.calibration import input_statistics, load_calibration
from auditor.calibration.measure.metric import Evaluator, Metric, is_causal_lm
from auditor.calibration.stage import metric_of
from auditor.calibration.statistics.stats import by_name
from auditor.calibration.tiers.sweep import measure_floors
from auditor.errors import AuditError
from auditor.structure.layers import ParamTable, collect_layers

transformers = pytest.importorskip("transformers")

LENGTHS = [8, 5, 3]  # real tokens per row of the right-padded held-out batch
PAD = 0


def _gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _ids(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 61, (rows, width), generator=g)


def _padded(ids: torch.Tensor, lengths: list[int]) -> dict[str, torch.Tensor]:
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    return {"input_ids": torch.where(mask.bool(), ids, torch.full_like(ids, PAD)), "attention_mask": mask}


@pytest.fixture(scope="module")
def lm():
    model = _gpt2()
    fit = {"input_ids": _ids(6, 8, 1), "attention_mask": torch.ones(6, 8, dtype=torch.long)}
    held = _padded(_ids(3, 8, 2), LENGTHS)
    cal = load_calibration(fit, model, holdout=held, batch_size=8)
    return model, cal, held


def _row_logprobs(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """log-softmax of the logits of one row's n real tokens, run alone (no pad in the input at all)."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids[None, :n]).logits[0].double(), -1)


def _hand_perplexity(model: nn.Module, held: dict[str, torch.Tensor]) -> float:
    nll, count = 0.0, 0
    for r, n in enumerate(LENGTHS):
        ids = held["input_ids"][r]
        logp = _row_logprobs(model, ids, n)
        for t in range(n - 1):
            nll -= float(logp[t, ids[t + 1]])
            count += 1
    assert count == sum(LENGTHS) - len(LENGTHS)  # 13 predicted tokens; the 11 pads predict and are predicted never
    return math.exp(nll / count)


def _perturbed(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        w = other.transformer.h[0].mlp.c_fc.weight
        w.add_(0.3 * torch.randn(w.shape, generator=g))
    return other


def test_perplexity_equals_a_hand_computation_with_the_pads_excluded(lm):
    model, cal, held = lm
    ev = Evaluator(model, cal, Metric(kind="perplexity", tolerance=0.02))
    want = _hand_perplexity(model, held)
    assert ev.reference == pytest.approx(want, rel=1e-5)
    other = _perturbed(model)
    m = ev.measure(other)
    ppl = _hand_perplexity(other, held)
    assert m.absolute == pytest.approx(ppl, rel=1e-5)
    assert m.value == pytest.approx(ppl / want - 1, rel=1e-4, abs=1e-6)  # the relative increase
    assert m.ok == (ppl / want - 1 <= 0.02)
    assert ev.measure(model).value == pytest.approx(0.0, abs=1e-12)
    assert not ev.metric.higher_is_better and ev.metric.label == "perplexity increase"


def test_pads_change_the_perplexity_when_counted(lm):
    """The same rows with the pads counted as tokens give another number: the test above can tell."""
    model, cal, held = lm
    unmasked = {"input_ids": held["input_ids"], "attention_mask": torch.ones_like(held["attention_mask"])}
    cal2 = load_calibration({k: v for k, v in cal.fit[0].kwargs.items()}, model, holdout=unmasked, batch_size=8)
    assert Evaluator(model, cal2, Metric(kind="perplexity")).reference != pytest.approx(
        _hand_perplexity(model, held), rel=1e-3)


def test_kl_equals_a_hand_computation(lm):
    model, cal, held = lm
    ev = Evaluator(model, cal, Metric(kind="kl"))
    other = _perturbed(model)
    total, count, agree = 0.0, 0, 0
    for r, n in enumerate(LENGTHS):
        ids = held["input_ids"][r]
        p, q = _row_logprobs(model, ids, n)[: n - 1], _row_logprobs(other, ids, n)[: n - 1]
        total += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += n - 1
    m = ev.measure(other)
    assert m.value == pytest.approx(total / count, rel=1e-4)
    assert m.value > 1e-4  # the perturbation moved the distribution: a number that can differ
    assert m.top1 == agree / count
    assert ev.measure(model).value == pytest.approx(0.0, abs=1e-6)
    w = model.transformer.h[0].mlp.c_fc.weight
    saved = w.detach().clone()
    with torch.no_grad():  # the evaluator's dense copy is its own: the sweep changes the caller's model in place
        w.copy_(other.transformer.h[0].mlp.c_fc.weight)
    try:
        assert ev.measure(model).value == pytest.approx(total / count, rel=1e-4)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_padded_batches_give_the_grams_of_their_real_tokens(lm):
    model, _, held = lm
    model = copy.deepcopy(model).double()  # in float64 the padded and the unpadded forward agree to 1e-15
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    padded = input_statistics(model, layers, load_calibration(held, model, holdout=0, batch_size=8))
    rows = [{"input_ids": held["input_ids"][r: r + 1, :n]} for r, n in enumerate(LENGTHS)]
    alone = input_statistics(model, layers, load_calibration(rows, model, holdout=0))
    assert set(padded.layers) == set(alone.layers) and len(padded.layers) >= 10
    for name, inp in alone.layers.items():
        got = padded.layers[name]
        assert got.rows == inp.rows, name
        assert got.gram == pytest.approx(inp.gram, rel=1e-10, abs=1e-10), name
    assert padded.layers["transformer.h.0.attn.c_attn"].rows == sum(LENGTHS) == 16  # of 24 positions
    assert padded.layers["transformer.wte"].gram[PAD] == 0  # the pad id is never a lookup
    assert padded.layers["transformer.wte"].gram.sum() == 16


def test_output_error_leaves_the_pads_out(lm):
    model, cal, held = lm
    ev = Evaluator(model, cal)
    other = _perturbed(model)
    err2 = ref2 = 0.0
    with torch.no_grad():
        for r, n in enumerate(LENGTHS):
            ids = held["input_ids"][r: r + 1, :n]
            y, y0 = other(input_ids=ids).logits.double(), model(input_ids=ids).logits.double()
            err2 += float((y - y0).pow(2).sum())
            ref2 += float(y0.pow(2).sum())
    assert ev.measure(other).value == pytest.approx(math.sqrt(err2 / ref2), rel=1e-5)


def test_the_default_metric_follows_the_model(lm):
    model, cal, _ = lm
    opts = SimpleNamespace(metric=None, tolerance=None)
    assert metric_of(opts, model, cal).kind == "perplexity"
    assert metric_of(SimpleNamespace(metric="kl", tolerance=0.05), model, cal) == Metric(tolerance=0.05, kind="kl")
    assert metric_of(SimpleNamespace(metric="output-error", tolerance=None), model, cal).kind == "output"

    class Ids(nn.Module):  # not Hugging Face: logits over its vocabulary with input_ids in
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(61, 8), nn.Linear(8, 61)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(input_ids))

    class Pos(Ids):  # the same taking its ids positionally (the sample char transformer's way): output error
        def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return self.head(self.emb(idx))

    ids = _ids(8, 6, 3)
    assert is_causal_lm(Ids(), load_calibration({"input_ids": ids}, Ids()).measure[0])
    pos = Pos()
    assert not is_causal_lm(pos, load_calibration({"idx": ids}, pos).measure[0])
    assert metric_of(opts, pos, load_calibration({"idx": ids}, pos)).kind == "output"
    assert metric_of(opts, nn.Linear(4, 4), None).kind == "output"
    with pytest.raises(AuditError, match="neither a metric name nor a function"):
        metric_of(SimpleNamespace(metric="perplexty", tolerance=None), model, cal)


def test_holdout_zero_is_refused_where_the_metric_is_measured(lm):
    model, cal, _ = lm
    none_held = load_calibration(cal.fit[0].kwargs, model, holdout=0)
    with pytest.raises(AuditError, match=r"holds nothing out \(--holdout 0\): the measured numbers .* would come "
                                         r"from the 6 rows the statistics were fitted on"):
        Evaluator(model, none_held)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 6)).eval()


def _points(model: nn.Module, cal, metric, cache: bool) -> dict[str, list[tuple[int, float]]]:
    layers = collect_layers(model, ParamTable.of(model))
    f = measure_floors(model, layers, cal, metric=metric, align=4, search="all", prefix_cache=cache)
    return {k: v.points for k, v in f.floors.items()}


def test_a_metric_that_slices_its_batch_gets_the_uncached_numbers():
    model = _stack()
    dense = copy.deepcopy(model)
    x = torch.randn(96, 12, generator=torch.Generator().manual_seed(1))
    cal = load_calibration([x[:48], x[48:]], model, holdout=0.5)  # one fit batch, one held-out batch of 48 rows

    def first_half(m: nn.Module, batches: list) -> float:
        err = ref = 0.0
        for b in batches:
            h = b[: b.shape[0] // 2]  # the same data pointer as the batch: the old cache key matched it
            y, y0 = m(h), dense(h)
            err += float((y - y0).pow(2).sum())
            ref += float(y0.pow(2).sum())
        return -err / ref

    cached = _points(model, cal, first_half, True)
    assert cached == _points(model, cal, first_half, False)
    assert any(v < -1e-3 for pts in cached.values() for _, v in pts)


class _Tied(nn.Module):
    """``late`` is declared first and owns the weight; ``early``, declared after it, holds the same weight and runs
    first: replaying ``early`` while ``late`` is swept would give the dense value of a truncated weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.late = nn.Linear(16, 16)
        self.early = nn.Linear(16, 16)
        self.early.weight = self.late.weight
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.late(torch.tanh(self.early(x)))))


def test_a_tied_weight_used_first_by_its_later_module_is_never_replayed():
    model = _Tied().eval()
    x = torch.randn(80, 16, generator=torch.Generator().manual_seed(2))
    cal = load_calibration({"x": x}, model, holdout=0.5, batch_size=40)
    layers = [l for l in collect_layers(model, ParamTable.of(model)).values() if l.name == "late"]
    assert layers and layers[0].aliases
    cached = measure_floors(model, layers, cal, align=4, search="all", prefix_cache=True).floors["late"].points
    assert cached == measure_floors(model, layers, cal, align=4, search="all", prefix_cache=False).floors["late"].points


FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.4)
        self.fc2 = nn.Linear(48, 48)
        self.fc3 = nn.Linear(48, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x))))))


def model():
    torch.manual_seed(0)
    return Net()  # in training mode, as constructed: dropout on
'''


def test_the_exported_model_measures_what_plan_json_says(cli_inproc, tmp_path):
    from safetensors.torch import save_file

    from auditor.factorize import load_factorized
    from auditor.sources.factory import import_user_module

    src = tmp_path / "drop.py"
    src.write_text(FACTORY)
    x = torch.randn(240, 16, generator=torch.Generator().manual_seed(3))
    save_file({"x": x}, tmp_path / "cal.safetensors")
    (tmp_path / "plan.toml").write_text('[ranks]\nfc2 = 8\n')
    out = tmp_path / "fact"
    r = cli_inproc("factorize", f"{src}:model", "--plan", tmp_path / "plan.toml", "--calibration",
                   tmp_path / "cal.safetensors", "-o", out, "--no-cache", "--allow-miss")
    assert r.returncode == 0, r.stderr  # the plan misses the tolerance: --allow-miss writes it and exits 0
    measured = json.loads((out / "plan.json").read_text())["measured"]
    model = import_user_module(str(src), "model").model()
    back = load_factorized(model, out).eval()
    assert model.training  # the factory's model as given; the evaluator below puts it in eval mode
    cal = load_calibration(tmp_path / "cal.safetensors", model, 0.25)
    from auditor.calibration.measure.verify import split_rows, with_holdout

    verify = with_holdout(cal, split_rows(cal.holdout)[1])  # plan.json's number: the verification rows'
    value = Evaluator(model.eval(), verify).measure(back).value
    assert measured["metric"] == "relative output error" and value > 1e-3
    assert measured["value"] == pytest.approx(value, rel=1e-9)
