"""The calibrated audit bounded by one block, beyond tier 1: the gradient pass runs each repeated block checkpointed
and keeps one part's second moments in memory (the rest on disk), with the same sums bit for bit as the whole graph
held in memory; tier 3 keeps one part's decompositions in memory (the rest on disk), read back bit for bit; a plan is
measured on a copy that shares the model's weights. Counted, never timed: what is held in memory is compared with
one part's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration
from auditor.calibration.tiers import fisher
from auditor.calibration.tiers.fisher import Moments, output_gradients
from auditor.calibration.measure.metric import Metric
from auditor.calibration.statistics.stats import by_name, input_statistics
from auditor.calibration.statistics.whiten import Truncator, TruncatorStore, part_bytes, truncator_bytes
from auditor.factorize import factorize
from auditor.structure.layers import ParamTable, collect_layers

transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _llama(depth: int) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=depth,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def _setup(depth: int):
    model = _llama(depth)
    g = torch.Generator().manual_seed(1)
    rows = {"input_ids": torch.randint(0, 64, (12, 10), generator=g)}
    cal = load_calibration(rows, model, holdout=0.25, batch_size=3)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    return model, cal, layers


@pytest.mark.parametrize("kind", ["perplexity", "output"])
def test_gradient_pass_by_block_equals_the_whole_graph_bit_for_bit(monkeypatch, kind):
    import torch.utils.checkpoint as ckpt

    model, cal, layers = _setup(3)
    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    by_block = output_gradients(model, layers, cal, Metric(kind=kind))
    assert len(calls) == 3 * len(cal.fit)  # every block of every fit batch ran checkpointed
    # the same pass with nothing checkpointed and every second moment in memory (the pass before issue 28's item 5)
    monkeypatch.setattr(fisher, "_blocks", lambda model, layers: None)
    whole = output_gradients(model, layers, cal, Metric(kind=kind))
    assert set(by_block.second) == set(whole.second) and len(whole.second) == 3 * 7 + 2
    assert all(np.array_equal(by_block.second[k], whole.second[k]) for k in whole.second)
    assert (by_block.count, by_block.scale, by_block.passes) == (whole.count, whole.scale, whole.passes)
    assert not whole.second.files  # no blocks: no budget, nothing on disk


class _Twice(nn.Module):
    """A module called twice in one forward (``mix``), a tall layer (``wide``, its gradient carried through F)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.wide = nn.Linear(8, 24)
        self.head = nn.Linear(24, 16)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        h = torch.tanh(self.mix(h))
        h = self.mix(h) + h
        return self.head(torch.relu(self.wide(h)))


def _all_at_once(model, layers, cal, metric, samples=fisher.SAMPLES, seed=0):
    """The pass before issue 37: every hooked output's gradient edge kept, every gradient of a backward returned
    together by one ``torch.autograd.grad`` over the edges, added in call order; nothing checkpointed."""
    from torch.autograd.graph import get_gradient_edge

    from auditor.calibration.measure.metric import main_output
    from auditor.calibration.metrics.common import row_mask

    acc = fisher._Accumulator(by_name(layers), dict(model.named_parameters(remove_duplicate=False)))
    got = []

    def hook(path):
        def fn(mod, args, out):
            out = out if out.requires_grad else out.detach().requires_grad_(True)
            got.append((path, get_gradient_edge(out)))
            return out
        return fn

    modules = acc.hook_paths(dict(model.named_modules(remove_duplicate=False)))
    handles = [m.register_forward_hook(hook(p)) for p, m in modules.items()]
    p = fisher._Pass(metric.spec.gradient == "likelihood", metric.spec.scored_positions, samples,
                     torch.Generator().manual_seed(seed), torch.device("cpu"))
    try:
        with torch.enable_grad():
            for b in cal.fit:
                got.clear()
                y = main_output(model(*b.args, **b.kwargs))
                keep = row_mask(b)
                for k, loss in enumerate(fisher._losses(y, b, keep, p)):
                    grads = torch.autograd.grad(loss(), [e for _, e in got], retain_graph=k < samples - 1,
                                                allow_unused=True)
                    for (path, _), g in zip(got, grads):
                        if g is not None:
                            acc.put(acc.terms(path, g, keep))
    finally:
        for h in handles:
            h.remove()
    return acc


@pytest.mark.parametrize("kind", ["perplexity", "output"])
def test_gradients_added_as_each_node_runs_equal_all_at_once_bit_for_bit(kind):
    model, cal, layers = _setup(3)
    now = output_gradients(model, layers, cal, Metric(kind=kind))  # checkpointed blocks, taps
    before = _all_at_once(model, layers, cal, Metric(kind=kind))
    assert set(now.second) == set(before.second) and len(now.second) == 3 * 7 + 2
    assert all(np.array_equal(now.second[k], before.second[k]) for k in before.second)
    assert now.count == before.count and now.passes == 2 * len(cal.fit)


def test_a_module_called_twice_adds_its_calls_in_call_order():
    model = _Twice().eval()
    g = torch.Generator().manual_seed(1)
    cal = load_calibration({"input_ids": torch.randint(0, 16, (12, 6), generator=g)}, model, holdout=0.25,
                           batch_size=3)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    now = output_gradients(model, layers, cal, Metric(kind="output"))
    before = _all_at_once(model, layers, cal, Metric(kind="output"))
    assert {"mix", "wide", "head"} <= set(now.second) and set(now.second) == set(before.second)
    assert all(np.array_equal(now.second[k], before.second[k]) for k in before.second)
    assert now.count["mix"] == 2 * now.count["head"] == 2 * 2 * 9 * 6  # two calls, two samples, 9 fit rows of 6


def test_one_output_gradient_is_alive_at_a_time(monkeypatch):
    """Counted, not timed: whenever an output gradient is added up, how many distinct buffers the gradients added
    before it in the same backward still hold. All at once: every one (3 blocks x 7 layers + the head and the
    embeddings, held until the backward ends); added as each node runs: at most one (the residual stream's
    gradient, which autograd adds the blocks' branches into in place; each layer's own is freed once its node
    has passed it on)."""
    import weakref

    model, cal, layers = _setup(3)
    seen, held = [], []
    real = fisher._Accumulator.terms

    def counted(self, path, g, keep):
        if len(seen) == 3 * 7 + 2:  # a new backward
            seen.clear()
        held.append(len({r().data_ptr() for r in seen if r() is not None}))
        seen.append(weakref.ref(g))
        return real(self, path, g, keep)

    monkeypatch.setattr(fisher._Accumulator, "terms", counted)
    output_gradients(model, layers, cal, Metric(kind="perplexity"))
    assert len(held) == 2 * len(cal.fit) * (3 * 7 + 2) and max(held) == 1
    held.clear()
    _all_at_once(model, layers, cal, Metric(kind="perplexity"))
    assert max(held) == 3 * 7 + 1  # the pass before: the last one added finds every other held


def test_second_moments_in_memory_are_one_part_of_the_model():
    """Counted: at depth 2 and 6 the moments held in memory are at most the largest part's (one block's layers, or
    one layer outside the blocks), and the rest are on disk."""
    for depth in (2, 6):
        model, cal, layers = _setup(depth)
        g = output_gradients(model, layers, cal, Metric(kind="perplexity"))
        block = sum(8 * min(layers[k].m, layers[k].n) ** 2 for k in layers if k.startswith("model.layers.0."))
        outside = max(8 * min(layers[k].m, layers[k].n) ** 2 for k in ("model.embed_tokens", "lm_head"))
        assert g.second.budget == max(block, outside)
        assert g.second.bytes <= g.second.budget
        assert len(g.second.files) >= (depth - 1) * 7  # every block but (at most) one on disk


def test_freed_heap_is_handed_back_after_each_fit_batch(monkeypatch):
    """glibc's malloc_trim (no allocator setting changed) after every fit batch and every layer's gradient costs."""
    from auditor.calibration.statistics.whiten import whitened_spectra
    from auditor.calibration.tiers.fisher import gradient_sensitivity

    model, cal, layers = _setup(2)
    calls = []
    monkeypatch.setattr(fisher, "trim_heap", lambda: calls.append(1))
    stats = input_statistics(model, list(layers.values()), cal)
    spectra = whitened_spectra(layers, dict(model.named_parameters()), stats)
    sens = gradient_sensitivity(model, layers, cal, Metric(kind="perplexity"), stats, spectra)
    assert len(calls) == len(cal.fit) + len(sens.costs) - len(sens.scaled)


def test_moments_on_disk_add_up_as_in_memory():
    rng = np.random.default_rng(0)
    terms = [(f"l{i % 3}", rng.standard_normal((5, 5))) for i in range(9)]
    mem, disk = Moments(), Moments(budget=0)
    for name, s in terms:
        mem.add(name, s.copy())
        disk.add(name, s.copy())
    assert list(disk.files) == ["l0", "l1", "l2"] and not disk.mem and list(mem) == list(disk)
    assert all(np.array_equal(mem[k], disk[k]) for k in mem)
    del disk["l1"]
    assert "l1" not in disk and len(disk) == 2


def test_truncator_store_reads_back_what_it_spilled(monkeypatch):
    model, cal, layers = _setup(2)
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj", "lm_head"]
    stats = input_statistics(model, [layers[n] for n in names], cal)
    params = dict(model.named_parameters())
    truncs = {n: Truncator(layers[n], params[layers[n].param], stats.layers[n]) for n in names}
    first = truncator_bytes(layers[names[0]])  # a tall map's cut: A_k (m x n) and B_k (n x n), less than F and U
    assert first == truncs[names[0]].cut_bytes == 8 * 32 * (48 + 32) < truncs[names[0]].f.nbytes * 2
    store = TruncatorStore(first)  # the first in memory, the others on disk
    for n, t in truncs.items():
        store[n] = t
    assert store.bytes == first and store.spilled == 2 and list(store) == names[:1]
    for n, t in truncs.items():
        back, cut = store.get(n), t.cut()
        for r in (1, 8, 32):  # the cut's slices: the truncation's factors (to rounding), and read back bit for bit
            assert all(np.array_equal(a, b) for a, b in zip(back.factors(r), cut.factors(r)))
            assert all(np.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(back.factors(r), t.factors(r)))
        assert torch.equal(back.weight(8), cut.weight(8))
    back = store.get(names[1])  # read back mapped, read-only: no copy in the heap left behind, and no F
    assert all(isinstance(x, np.memmap) and not x.flags.writeable for x in back.full[0])
    assert sorted(p.name for p in Path(store._dir.name).iterdir()) == ["t0.at0.npy", "t0.b0.npy", "t1.at0.npy",
                                                                        "t1.b0.npy"]
    assert store.get("missing") is None
    # the audit's budget: the largest part (a block's layers together, or one layer outside the blocks)
    want = max(sum(truncator_bytes(layers[k]) for k in layers if k.startswith(f"model.layers.{i}."))
               for i in range(2))
    assert part_bytes(model, list(layers.values())) == max(want, *(truncator_bytes(layers[k])
                                                                   for k in ("model.embed_tokens", "lm_head")))
    store.close()


def test_a_plan_measured_on_a_copy_sharing_the_weights_is_the_same_model():
    model, cal, layers = _setup(2)
    stats = input_statistics(model, list(layers.values()), cal)
    plan = {"model.layers.0.mlp.up_proj": 8, "model.layers.1.self_attn.o_proj": 8}
    own, shared = factorize(model, plan, stats), factorize(model, plan, stats, share=True)
    x = cal.measure[0].kwargs["input_ids"]
    with torch.no_grad():
        assert torch.equal(own(input_ids=x).logits, shared(input_ids=x).logits)
    kept = {p.data_ptr() for p in model.parameters()}
    assert shared.lm_head.weight is model.lm_head.weight  # shared, not copied
    new = [p for p in shared.parameters() if p.data_ptr() not in kept]
    assert sum(p.numel() for p in new) == sum(r * (layers[k].m + layers[k].n) for k, r in plan.items())
    assert not any(p.data_ptr() in kept for p in own.parameters())


def test_a_plan_measured_with_its_blocks_factors_mapped_is_the_same_model():
    """measured_copy: the same outputs as factorize's copy, the same parameter count; between forwards none of the
    blocks' factors is in memory, and while a block runs only its own are (counted, not timed)."""
    from auditor.calibration.apply import measured_copy
    from auditor.surgery import count_params

    model, cal, layers = _setup(3)
    stats = input_statistics(model, list(layers.values()), cal)
    plan = {"model.layers.0.mlp.up_proj": 8, "model.layers.1.self_attn.o_proj": 8, "model.layers.2.mlp.down_proj": 16,
            "model.layers.2.self_attn.q_proj": 8, "lm_head": 16}
    reuse = TruncatorStore(0)  # every decomposition spilled and read back, as the audit's beyond one part
    own, mapped = factorize(model, plan, stats, share=True), measured_copy(model, plan, stats, reuse)
    x = cal.measure[0].kwargs["input_ids"]
    kept = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def resident(m):  # bytes of the copy's own parameters that are not one number expanded
        return sum(p.numel() * p.element_size() for p in m.parameters()
                   if p.untyped_storage().data_ptr() not in kept and p.stride() != (0,) * p.dim())

    def factor_bytes(names):
        return sum(4 * plan[k] * (layers[k].m + layers[k].n) for k in names)

    head = factor_bytes(["lm_head"])
    running = []
    for blk in mapped.model.layers:  # after the hook that maps the block's factors
        blk.register_forward_pre_hook(lambda mod, a: running.append(resident(mapped) - head))
    with torch.no_grad():
        assert torch.equal(own(input_ids=x).logits, mapped(input_ids=x).logits)
        assert torch.equal(own(input_ids=x).logits, mapped(input_ids=x).logits)  # mapped again: the same
    assert count_params(mapped) == count_params(own) < count_params(model)
    assert resident(mapped) == head  # between forwards: only the head's factors (outside the blocks) in memory
    each = [factor_bytes([k for k in plan if k.startswith(f"model.layers.{i}.")]) for i in range(3)]
    assert running == each * 2 and resident(own) == head + sum(each)  # while block i runs: its own alone
    real = mapped.model.layers[1].forward  # a block run without its hooks: refused, never NaN or zeros measured
    mapped.model.layers[1] = type("Bare", (nn.Module,), {"forward": lambda self, *a, **k: real(*a, **k)})()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"blocks \[1\] of the factorized copy ran without"):
        mapped(input_ids=x)
    reuse.close()


def test_large_arrays_are_mapped_where_glibc_is_the_allocator():
    import ctypes.util
    import platform

    from auditor.calibration.session import map_large_arrays

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c")
    assert map_large_arrays() is False  # this process is a host (the test run), not the tool's own: left alone
    code = ("from auditor._env import own_process; own_process(); "
            "from auditor.calibration.session import map_large_arrays; print(map_large_arrays())")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(bool(glibc))  # in the tool's own process, set wherever glibc is the allocator


def test_the_plan_check_measures_the_reviewed_plan_with_one_blocks_factors_mapped(monkeypatch, tmp_path):
    """The plan check builds its copy with measured_copy too (the 7B audit's peak was its copy of every factor):
    the reviewed plan, which no search would choose (ranks 7 and 5), fitted as factorize writes it by default (the
    sequential fit), is measured on a copy whose blocks' factors are mapped while each block runs; the number it
    reports is that copy's."""
    from safetensors.torch import save_file

    import auditor
    from auditor.calibration import apply

    model = _llama(3)
    ids = torch.randint(0, 64, (24, 10), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, str(tmp_path / "calib.safetensors"))
    plan = {"model.layers.0.mlp.up_proj": 7, "model.layers.2.self_attn.o_proj": 5}
    copies, mapped = [], []
    real_copy, real_map = apply.measured_copy, apply._MappedFactors.map

    def copy(model, ranks, *args):
        copies.append(dict(ranks))
        return real_copy(model, ranks, *args)

    def map_block(self, i):
        mapped.append((copies[-1] if copies else None, i))  # tier 3's copies are made by its own import
        real_map(self, i)

    monkeypatch.setattr(apply, "measured_copy", copy)
    monkeypatch.setattr(apply._MappedFactors, "map", map_block)
    a = auditor.audit(model, ids[:1], plan={"ranks": plan}, calibration=str(tmp_path / "calib.safetensors"),
                      cache=False, progress=False)
    check = a.calibration.plan_check
    assert check is not None and check.layers == 2 and check.measured == check.measured  # measured, not NaN
    assert copies[-1] == plan and check.fit == "sequential"  # the last copy made is the plan check's
    assert sorted({i for p, i in mapped if p == plan}) == [0, 2]  # its factors mapped block by block


def test_a_wide_heads_gradient_is_carried_back_a_chunk_of_rows_at_a_time(monkeypatch):
    """A carried output gradient (out > in) larger than CARRY_VALUES is gathered, cast and carried back through F a
    chunk of rows at a time: the head's second moment as the whole gradient at once gives it."""
    model, cal, layers = _setup(2)
    whole = output_gradients(model, layers, cal, Metric(kind="perplexity"))
    calls = []
    real = fisher._carried_in_chunks
    monkeypatch.setattr(fisher, "_carried_in_chunks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fisher, "CARRY_VALUES", 3 * 64)  # three rows of the 64-wide head's gradient a chunk
    chunked = output_gradients(model, layers, cal, Metric(kind="perplexity"))
    assert calls and set(chunked.second) == set(whole.second) and chunked.count == whole.count
    for k in whole.second:  # float32 GEMMs of other row counts: equal to float32 rounding of the matrix's scale
        a, b = chunked.second[k], whole.second[k]
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), k
