"""Tiers 2 and 3 with bounded memory: the prefix cache keeps at most its byte budget (the earliest calls of every
batch), and the floors measured at any budget, 0 included, are the numbers of the uncached sweep exactly; the sweep
works on the caller's model in place and gives it back bit for bit (also after a failed evaluation); tier 3 keeps
its per-layer decompositions within a budget, with the same plans at any budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration, plan_for_budget, tier1
from auditor.calibration.statistics.whiten import TruncatorStore
from auditor.calibration.tiers.budget import curves_from_spectra
from auditor.calibration.measure.metric import Metric
from auditor.calibration.statistics.stats import by_name
from auditor.calibration.tiers.sweep import PrefixCache, Sweeper, _storages, default_cache_bytes, measure_floors
from auditor.errors import AuditError
from auditor.structure.layers import ParamTable, collect_layers

transformers = pytest.importorskip("transformers")

SWEPT = ("model.layers.0.mlp.down_proj", "model.layers.2.self_attn.o_proj", "model.layers.3.mlp.up_proj", "lm_head")
HIDDEN = 32
ROWS, WIDTH = 2, 12  # one held-out batch: rows x positions


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    model = _llama()
    g = torch.Generator().manual_seed(1)
    fit = [{"input_ids": torch.randint(0, 64, (4, WIDTH), generator=g)} for _ in range(2)]
    held = [{"input_ids": torch.randint(0, 64, (ROWS, WIDTH), generator=g)} for _ in range(3)]
    cal = load_calibration(fit, model, holdout=held)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    layers = {k: layers[k] for k in SWEPT}
    stats, spectra = tier1(model, layers, cal, align=8)
    return model, cal, layers, stats, spectra


def _points(model, cal, layers, stats, metric=None, **kw) -> dict[str, list[tuple[int, float]]]:
    f = measure_floors(model, layers, cal, metric=metric, align=8, stats=stats, search="all", **kw)
    return {k: v.points for k, v in f.floors.items()}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v) for k, v in before.items())


BLOCK_OUTPUT = ROWS * WIDTH * HIDDEN * 4  # one decoder block's output on one held-out batch (float32), in bytes


@pytest.mark.parametrize("kind", ["perplexity", "kl"])
def test_any_budget_measures_the_uncached_numbers(llama, kind):
    model, cal, layers, stats, _ = llama
    before = _state(model)
    metric = Metric(kind=kind, tolerance=0.05)
    plain = _points(model, cal, layers, stats, metric, prefix_cache=False)
    assert any(v > 0 for pts in plain.values() for _, v in pts)
    for budget in (None, 0, BLOCK_OUTPUT, 5 * BLOCK_OUTPUT + 7):
        assert _points(model, cal, layers, stats, metric, prefix_cache_bytes=budget) == plain
    assert _same(model, before)


def _cache(model, cal, layers, stats, budget):
    return Sweeper(model, layers, cal, align=8, stats=stats, prefix_cache_bytes=budget).cache


def _counted(cache: PrefixCache) -> int:
    """The bytes the stored outputs keep alive, counted here: each storage once."""
    seen: dict = {}
    for batch in cache.outputs:
        for outs in batch.values():
            for out in outs:
                seen.update(_storages(out))
    return sum(seen.values())


def test_the_store_never_exceeds_its_budget_and_keeps_the_earliest_calls(llama):
    model, cal, layers, stats, _ = llama
    full = _cache(model, cal, layers, stats, 2**40)
    assert full.dropped == 0 and full.bytes == _counted(full) == full.peak_bytes
    # per batch: embed_tokens, rotary_emb (cos and sin), blocks 0-2 (block 3 ends after every swept block layer's
    # first call: never replayed, never stored; nor are the final norm's and lm_head's outputs, the logits) and the
    # decoder's output (replayed for lm_head)
    assert sorted(full.outputs[0]) == ["model", "model.embed_tokens", "model.layers.0", "model.layers.1",
                                       "model.layers.2", "model.rotary_emb"]
    assert full.bytes == 3 * (5 * BLOCK_OUTPUT + 2 * WIDTH * (HIDDEN // 4) * 4)
    for budget in (BLOCK_OUTPUT - 1, BLOCK_OUTPUT, 2 * BLOCK_OUTPUT + 1, full.bytes // 2, full.bytes - 1):
        c = _cache(model, cal, layers, stats, budget)
        assert c.peak_bytes <= budget and _counted(c) == c.bytes <= budget
        assert c.dropped > 0 and c.bytes > budget - 2 * BLOCK_OUTPUT
        for b, outs in enumerate(c.outputs):  # every batch keeps a prefix of its storable calls, in forward order
            ends = sorted((e, p, k) for p, es in c.ends[b].items() for k, e in enumerate(es)
                          if k < len(full.outputs[b].get(p, ())))
            kept = [k < len(outs.get(p, ())) for _, p, k in ends]
            assert kept == sorted(kept, reverse=True)
    half = _cache(model, cal, layers, stats, full.bytes // 2)
    assert all(len(b) > 0 for b in half.outputs)  # the earliest calls of every batch, not the first batches whole


def test_a_budget_of_zero_stores_nothing_and_everything_runs(llama):
    model, cal, layers, stats, _ = llama
    sweeper = Sweeper(model, layers, cal, align=8, stats=stats, prefix_cache_bytes=0)
    c = sweeper.cache
    assert c.bytes == c.peak_bytes == 0 and all(not b for b in c.outputs) and c.dropped > 0
    calls = []
    base = sweeper.evaluations
    h = model.model.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        sweeper.floor("model.layers.3.mlp.up_proj", search="all")
    finally:
        h.remove()
    n = sweeper.evaluations - base
    assert n == 2 and len(calls) == 3 * n  # block 0 ran (its MLP did) on every held-out batch of every evaluation
    full = Sweeper(model, layers, cal, align=8, stats=stats, prefix_cache_bytes=2**40)
    calls.clear()
    h = model.model.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        full.floor("model.layers.3.mlp.up_proj", search="all")
    finally:
        h.remove()
    assert calls == []  # with the whole prefix stored, block 0 is replayed: its MLP never runs


def test_bad_budgets_are_refused(llama):
    model, cal, layers, stats, _ = llama
    for bad in (-1, 1.5, True, "1G", float("nan")):
        for cache in (True, False):
            with pytest.raises(ValueError, match="prefix_cache_bytes must be a whole number of bytes"):
                Sweeper(model, layers, cal, align=8, stats=stats, prefix_cache=cache, prefix_cache_bytes=bad)
    import numpy as np

    assert Sweeper(model, layers, cal, align=8, stats=stats, prefix_cache_bytes=np.int64(5)).cache.budget == 5
    assert 0 <= default_cache_bytes() <= 8 * 2**30


def test_the_sweep_works_in_place_and_restores_the_model_and_its_modes(llama):
    model, cal, layers, stats, _ = llama
    before = _state(model)
    model.train()
    model.model.layers[1].eval()  # a model half in training mode comes back exactly so
    modes = [m.training for m in model.modules()]
    try:
        sweeper = Sweeper(model, layers, cal, align=8, stats=stats)
        assert sweeper.work is model  # no copy of the weights
        assert [m.training for m in model.modules()] == modes and _same(model, before)
        sweeper.floor("model.layers.2.self_attn.o_proj")
        assert [m.training for m in model.modules()] == modes and _same(model, before)
        seen: list[bool] = []
        armed: list[int] = []  # the calls the session's checks of a user metric made (repeatable, unchanged model)

        def fail(m: nn.Module, batches: list) -> float:
            seen.append(not torch.equal(m.lm_head.weight, before["lm_head.weight"]))
            if armed and len(seen) > armed[0] and seen[-1]:  # the first call on a truncated weight
                raise RuntimeError("stop")
            return 1.0

        s2 = Sweeper(model, layers, cal, align=8, stats=stats, metric=fail)
        armed.append(len(seen))
        with pytest.raises(AuditError, match="stop"):
            s2.floor("lm_head")
        assert seen[-1]  # the metric saw the truncated weight, in the caller's model, and it was written back
        assert [m.training for m in model.modules()] == modes and _same(model, before)
    finally:
        model.eval()


def test_tier3_keeps_decompositions_within_a_budget_with_the_same_plans(llama):
    model, cal, layers, stats, spectra = llama
    before = _state(model)
    curves = curves_from_spectra(spectra, layers, align=8)
    metric = Metric(kind="perplexity", tolerance=0.05)
    a = plan_for_budget(model, layers, cal, curves, metric=metric, stats=stats)
    b = plan_for_budget(model, layers, cal, curves, metric=metric, stats=stats, reuse_bytes=0)
    assert (a.plan, a.removed, a.metric, [p.metric for p in a.tries]) == \
        (b.plan, b.removed, b.metric, [p.metric for p in b.tries])
    assert a.evaluations > 1 and _same(model, before)
    kept = TruncatorStore(3 * HIDDEN * HIDDEN * 8, spill=False)  # what does not fit is dropped

    from auditor.calibration.statistics.whiten import Truncator
    from auditor.results import Kind, Layer

    square = Layer("x", "x.weight", Kind.LINEAR, "Linear", (HIDDEN, HIDDEN), HIDDEN, HIDDEN)
    t = Truncator(square, torch.eye(HIDDEN), None)  # kept as its cut: A_k and B_k, 2 x 32 x 32 float64
    kept["x"] = t
    kept["y"] = t
    assert list(kept) == ["x"] and kept.bytes == 2 * HIDDEN * HIDDEN * 8 and kept.refused == 1
    assert TruncatorStore(0, spill=False).budget == 0
