"""The block refinement (auditor/calibration/statistics/refine.py): a block's factors trained together on its output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration
from auditor.calibration.statistics import refine as rf
from auditor.calibration.statistics.sequential import sequential_fit
from auditor.calibration.statistics.whiten import Pinned, Truncator
from auditor.surgery import checked_plan


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8).double()
        self.k = nn.Linear(8, 8).double()
        self.up = nn.Linear(8, 16).double()
        self.down = nn.Linear(16, 8).double()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.q(x)) * self.k(x) * scale
        return x + self.down(torch.relu(self.up(x)))


def _inputs(batches: int, seed: int = 1) -> list[tuple[tuple[object, ...], dict[str, object]]]:
    g = torch.Generator().manual_seed(seed)
    one = torch.ones(1, dtype=torch.float64)
    return [((torch.randn(6, 10, 8, generator=g, dtype=torch.float64), one), {}) for _ in range(batches)]


def _planned(blk: _Block, rank: int = 3) -> list[tuple[object, str, tuple[np.ndarray, np.ndarray]]]:
    plan = checked_plan(blk, {n: rank for n in ("q", "k", "up", "down")})
    return [(layer, f"{name}.weight", Truncator(layer, getattr(blk, name).weight, None).factors(r))
            for name, (layer, r) in plan.items()]


def _error(blk: _Block, weights: dict[str, torch.Tensor], inputs, targets) -> float:
    """The block's squared error summed over ``inputs`` with ``weights`` (name -> weight) in place."""
    with torch.no_grad():
        return sum(float(((torch.func.functional_call(blk, weights, a, k) - t) ** 2).mean())
                   for (a, k), t in zip(inputs, targets))


def test_the_refined_factors_lower_the_blocks_error_on_the_batches_held_out_of_training() -> None:
    torch.manual_seed(0)
    blk = _Block()
    inputs = _inputs(8)
    with torch.no_grad():
        targets = [blk(*a, **k) for a, k in inputs]
    planned = _planned(blk)
    before = {k: v.clone() for k, v in blk.state_dict().items()}
    got = rf.refine_block(blk, planned, rf.Batches(inputs, targets, [None] * 8), lambda o: o)
    assert sorted(got) == ["down", "k", "q", "up"]
    assert all(torch.equal(v, blk.state_dict()[k]) for k, v in before.items())  # the block is read, not written
    assert all(p.grad is None for p in blk.parameters())
    closed = {f"{layer.name}.weight": Truncator(layer, getattr(blk, layer.name).weight, None).weight(3)
              for layer, _, _ in planned}
    refined = {f"{n}.weight": got[n].weight(3) for n in got}
    for layer, _, (a, b) in planned:  # the rank and the shapes are kept
        assert got[layer.name].a.shape == a.shape and got[layer.name].b.shape == b.shape
        assert np.linalg.matrix_rank(got[layer.name].a[0] @ got[layer.name].b[0]) == 3
    held = slice(7, 8)  # CHECK = 8: the last of 8 batches is held out of the training
    assert rf.CHECK == 8
    assert _error(blk, refined, inputs[held], targets[held]) < 0.9 * _error(blk, closed, inputs[held], targets[held])


def test_no_epoch_better_than_the_closed_form_keeps_the_closed_form() -> None:
    """A step so large the first epoch diverges: the check batch's error rises, nothing is returned, and the fit
    keeps the closed-form factors bit for bit. One batch (nothing to hold out) or no epoch: nothing either."""
    torch.manual_seed(0)
    blk = _Block()
    inputs = _inputs(4)
    with torch.no_grad():
        targets = [blk(*a, **k) for a, k in inputs]
    assert rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 4), lambda o: o, lr=1e3) == {}
    assert rf.refine_block(blk, _planned(blk), rf.Batches(inputs[:1], targets[:1], [None]), lambda o: o) == {}
    assert rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 4), lambda o: o, epochs=0) == {}
    assert rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 4), lambda o: o) != {}


def test_linears_train_factored_to_the_factors_their_product_in_place_gives() -> None:
    """Each plain nn.Linear runs as (x B^T) A^T while its block is refined: the same map multiplied in another order,
    so in float64 the refined factors equal those trained with the product A B as the weight to rounding; the block's
    own modules are back in place afterwards, after an error too."""
    torch.manual_seed(0)
    blk = _Block()
    inputs = _inputs(8)
    with torch.no_grad():
        targets = [blk(*a, **k) for a, k in inputs]
    modules = dict(blk.named_children())
    factored = rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 8), lambda o: o)
    assert dict(blk.named_children()) == modules
    product = rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 8), lambda o: o, factored=False)
    assert sorted(factored) == sorted(product) == ["down", "k", "q", "up"]
    for n in factored:
        np.testing.assert_allclose(factored[n].a, product[n].a, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(factored[n].b, product[n].b, rtol=1e-9, atol=1e-12)

    def broken(o: object) -> torch.Tensor:
        assert type(blk.q).__name__ == "_LowRank"  # swapped while it runs
        raise RuntimeError("hidden")

    with pytest.raises(RuntimeError, match="hidden"):
        rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, [None] * 8), broken)
    assert dict(blk.named_children()) == modules and all(type(m) is nn.Linear for m in modules.values())


def test_padding_is_not_fitted() -> None:
    """The error is taken at the real positions only: where a batch's padded positions hold garbage targets, the
    refinement with the mask equals the refinement of targets that are right there."""
    torch.manual_seed(0)
    blk = _Block()
    inputs = _inputs(4)
    with torch.no_grad():
        targets = [blk(*a, **k) for a, k in inputs]
    masks = [torch.ones(6, 10, dtype=torch.bool) for _ in inputs]
    for m in masks:
        m[:, 7:] = False
    spoiled = [t.clone() for t in targets]
    for t in spoiled:
        t[:, 7:] = 1e3
    clean = rf.refine_block(blk, _planned(blk), rf.Batches(inputs, targets, masks), lambda o: o)
    masked = rf.refine_block(blk, _planned(blk), rf.Batches(inputs, spoiled, masks), lambda o: o)
    assert clean.keys() == masked.keys() and clean
    for n in clean:
        np.testing.assert_array_equal(clean[n].a, masked[n].a)


LLAMA = Path(__file__).resolve().parents[1] / "sample_models" / "llama"


def _windows(tokenizer, name: str, n: int, length: int = 128) -> torch.Tensor:
    ids = tokenizer.encode((LLAMA / name).read_text(encoding="utf-8"), add_special_tokens=False)
    return torch.tensor(ids[: n * length]).view(n, length)


def test_the_sequential_fit_refines_the_blocks_layers_on_a_trained_llama() -> None:
    """The shipped sample Llama (trained weights), its attention q/o and MLP Linears of all four blocks at rank 24:
    the sequential fit refines all planned layers of each block whose check batch it improves, or none of them
    (measured: blocks 1-3; the first, whose inputs no factorized layer changed, kept its closed form), leaves the
    model untouched, and on text it never read (the model's holdout.txt) the refined model's perplexity increase is
    lower than the closed form's (+83.1% and +67.2% when measured; asserted: at least a tenth lower)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(LLAMA))
    model = transformers.LlamaForCausalLM.from_pretrained(str(LLAMA), dtype=torch.float32).eval()
    cal = load_calibration({"input_ids": _windows(tokenizer, "calib.txt", 64)}, model, holdout=0.0, batch_size=8)
    names = [f"model.layers.{i}.{p}" for i in range(4) for p in ("self_attn.q_proj", "self_attn.o_proj",
                                                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    plan = checked_plan(model, {n: 24 for n in names})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refined, closed = sequential_fit(model, plan, cal), sequential_fit(model, plan, cal, refine=0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    blocks = {n.split(".")[2] for n in refined.refined}  # whole blocks are refined, two at least
    assert len(blocks) >= 2 and set(refined.refined) == {n for n in names if n.split(".")[2] in blocks}
    assert closed.refined == () and all(isinstance(closed.truncators[n], Pinned) for n in names)
    for n in names[:5]:  # block 0 reads the dense inputs: where it is not refined, the closed form bit for bit
        if n not in refined.refined:
            assert torch.equal(refined.truncators[n].weight(24), closed.truncators[n].weight(24))
    held = _windows(tokenizer, "holdout.txt", 32)

    def perplexity(fitted=None) -> float:
        weights = {f"{n}.weight": fitted.truncators[n].weight(24) for n in names} if fitted is not None else {}
        with torch.no_grad():
            logits = torch.func.functional_call(model, weights, (held,)).logits.double()
        logp = torch.log_softmax(logits[:, :-1], -1)
        return math.exp(-float(logp.gather(2, held[:, 1:, None]).mean()))

    dense = perplexity()
    up_refined, up_closed = perplexity(refined) / dense - 1, perplexity(closed) / dense - 1
    assert 0.5 < up_closed < 1.2 and up_refined < 0.9 * up_closed


def _gpt2_fit_case():
    """A 2-block GPT-2 (Conv1D layers, stored transposed), 16 windows of 32 random ids, three layers planned at 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300,
                                                                 n_positions=64)).eval()
    ids = torch.randint(0, 300, (16, 32), generator=torch.Generator().manual_seed(0))
    cal = load_calibration({"input_ids": ids}, model, holdout=0.0, batch_size=2)
    names = ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_proj")
    return model, cal, checked_plan(model, {n: 8 for n in names})


def test_a_positional_cache_is_not_kept_so_gpt2_blocks_refine() -> None:
    """GPT-2's blocks take their key/value cache positionally. Kept with the block's inputs, it grew each time the
    block ran again on them (every stage of the sequential fit, every batch of the block-by-block statistics), and
    the refinement's second step backpropagated into the first step's keys and values ("backward through the graph
    a second time"). The kept inputs hold None in its place; the fit refines GPT-2's blocks (Conv1D layers, stored
    transposed) and leaves the model untouched."""
    from auditor.calibration.statistics.stream import _is_cache, first_inputs

    model, cal, plan = _gpt2_fit_case()
    with torch.no_grad():
        kept = first_inputs(model, model.transformer.h[0], cal.fit, torch.device("cpu"))
    assert len(kept) == 8 and not any(_is_cache(a) for args, kw in kept for a in (*args, *kw.values()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = sequential_fit(model, plan, cal)
    assert set(done.refined) <= set(plan) and done.refined
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_refinement_on_a_named_device_moves_each_batch_there_and_leaves_the_model_where_it_is(monkeypatch):
    """``Refinement(device=...)``: each batch's inputs, target and mask go through ``on_device`` to the device the
    factors train on, one batch at a time; the block's weights are read there as copies (the model itself never
    moved). On the CPU, named, the factors are the unnamed run's bit for bit."""
    model, cal, plan = _gpt2_fit_case()
    plain = sequential_fit(model, plan, cal)
    moved: list[torch.device] = []
    real = rf.on_device

    def spy(obj, device):
        moved.append(device)
        return real(obj, device)

    monkeypatch.setattr(rf, "on_device", spy)
    named = sequential_fit(model, plan, cal, refine=rf.Refinement(rf.EPOCHS, torch.device("cpu")))
    assert moved and set(moved) == {torch.device("cpu")} and named.refined == plain.refined and plain.refined
    for n in plan:
        assert all(np.array_equal(x, y) for x, y in zip(named.truncators[n].factors(8), plain.truncators[n].factors(8)))
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_while_a_block_refines_its_closed_forms_wait_on_disk_and_its_fitted_weights_are_not_held(monkeypatch):
    """Once a planned layer's master factors are made, its closed-form factors are written to the fit's scratch
    folder (memory-mapped) and its fitted weight is dropped until the refinement ends. A refinement that keeps no
    epoch then leaves every factor and fitted weight the fit without refinement gives, bit for bit: made again from
    the spilled closed forms, block 1 is fitted on the same inputs."""
    from auditor.calibration.statistics import sequential as seq

    model, cal, plan = _gpt2_fit_case()
    closed = seq.sequential_fit(model, plan, cal, refine=0)
    fitters, seen = [], []
    real_refine, real_block = seq._Fitter.refine, seq.refine_block

    def capture(self, *args, **kwargs):
        fitters.append(self)
        return real_refine(self, *args, **kwargs)

    def kept_none(blk, planned, *args, **kwargs):
        items = list(planned)  # every layer's masters would be made by now
        f = fitters[-1]
        seen.append({layer.name: (f.out[layer.name].on_disk, layer.name in f.fitted) for layer, _, _ in items})
        real_block(blk, iter(items), *args, **kwargs)  # trained, then nothing kept
        return {}

    monkeypatch.setattr(seq._Fitter, "refine", capture)
    monkeypatch.setattr(seq, "refine_block", kept_none)
    got = seq.sequential_fit(model, plan, cal)
    assert seen == [{"transformer.h.0.attn.c_attn": (True, False), "transformer.h.0.mlp.c_fc": (True, False)},
                    {"transformer.h.1.mlp.c_proj": (True, False)}]
    assert not got.refined and set(got.truncators) == set(plan)
    # refined, the closed forms' files are removed: the scratch folder holds each layer's factors once
    monkeypatch.setattr(seq, "refine_block", real_block)
    refined = seq.sequential_fit(model, plan, cal)
    assert refined.refined and refined.scratch is not None
    names = sorted(p.name for p in Path(refined.scratch.name).iterdir())
    assert len([n for n in names if ".a" in n and n.endswith(".npy")]) == len(plan), names
    for n in plan:
        assert all(np.array_equal(x, y) for x, y in zip(got.truncators[n].factors(8), closed.truncators[n].factors(8)))
        assert torch.equal(got.truncators[n].weight(8), closed.truncators[n].weight(8))


def test_on_device_moves_every_tensor_in_nested_inputs_and_keeps_the_rest():
    from collections import namedtuple

    Pair = namedtuple("Pair", "cos sin")
    t = torch.ones(2)
    got = rf.on_device(((t, Pair(t, t)), {"mask": [t, None], "flag": True, "name": "x"}), torch.device("meta"))
    (a, pair), kw = got
    assert a.device.type == "meta" and isinstance(pair, Pair) and pair.sin.device.type == "meta"
    assert kw["mask"][0].device.type == "meta" and kw["mask"][1] is None and kw["flag"] is True and kw["name"] == "x"
    assert rf.on_device(t, torch.device("cpu")) is t  # where it is already: the same tensor, no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_refinement_trains_on_cuda_and_returns_host_factors():
    model, cal, plan = _gpt2_fit_case()
    done = sequential_fit(model, plan, cal, refine=rf.Refinement(rf.EPOCHS, torch.device("cuda")))
    assert done.refined and all(p.device.type == "cpu" for p in model.parameters())
    for n in done.refined:
        a, b = done.truncators[n].factors(8)
        assert isinstance(a, np.ndarray) and np.isfinite(a).all() and np.isfinite(b).all()
        assert done.truncators[n].weight(8).device.type == "cpu"
