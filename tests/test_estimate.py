"""``--estimate`` (auditor/speed/estimate.py): the model's arithmetic with injected measurements (no clock), the JSON
keys, the refusal of a calibrated audit whose estimated peak exceeds the memory available, and that --estimate runs no
audit."""

import json

import pytest
import torch

from auditor.errors import AuditError
from auditor.speed import estimate as est

BLOCK = ((8, 4), (4, 8))
SHAPES = est.Shapes(weight_bytes=1000, layers=BLOCK + BLOCK + ((10, 4),), block_layers=BLOCK, blocks=2,
                    flop_params=168, block_flop_params=64)
WORK = est.Workload(fit_rows=24, holdout_rows=8, tokens=16, batch_rows=4, outputs=10, token_inputs=True,
                    formats=("text", "json"), threads=1)
MEASURED = est.Measurements(base_rss=100, load_seconds=1.0, block_forward=0.5, block_backward=1.0,
                            block_saved_bytes=1000, hidden_bytes=256, decompose_seconds=2.0, decompose_shape=(8, 4),
                            eig_seconds=0.8, eig_width=2, gemm_flops=1e3, seconds=3.0)


def test_forward_is_the_block_times_the_blocks_and_the_rest_by_its_parameters():
    # 2 blocks of 64 multiplied parameters and a head of 40: 2 + 40/64 blocks' worth
    assert est.forward_seconds(SHAPES, MEASURED) == pytest.approx(0.5 * 2.625)
    assert est.forward_seconds(SHAPES, MEASURED, backward=True) == pytest.approx(2.625)


def test_stage_seconds_exact():
    s = est.stage_seconds(SHAPES, WORK, MEASURED)
    # whitened: the products (out > in: 2 m n^2 + 5 n^3, out <= in: m n^2 + m^2 n + m^3 multiply-adds, 2 FLOPs each at
    # gemm_flops, one thread's rate unmeasured) and an eigendecomposition of min(m, n)^3 at what the measured (8, 4)'s
    # 2 s left after its 2 x 576 / 1e3 s of products: 0.848 / 4^3 a k^3
    eig = (2.0 - 2 * 576 / 1e3) / 4**3
    decomp = 2 * (2 * 576 / 1e3 + eig * 64) + 2 * (2 * 448 / 1e3 + eig * 64) + (2 * 640 / 1e3 + eig * 64)
    grams = 2 * 24 * 16 * (16 + 64 + 16 + 64 + 16) / 1e3  # X^T X over every fit token, per layer
    factors = 2 * (128 + 128 + 128 + 128 + 160) / 1e3  # full rank: m n min(m, n) a layer (the rounding floor's plan)
    planned = 2 * (4 * 32 * 32 / 12 + 40 * 40 / 14) / 1e3  # at the break-even bound: m n (m n / (m + n))
    # W*'s solve a layer: F C (m n^2), the Cholesky factor (n^3 / 6) and two triangular solves (n^2 m); a tall
    # layer's loss-aware fit also solves T (n^3 / 6 + n^3) and carries its moment (2 n^3)
    carried = 64 / 6 + 64 + 128
    solves = 2 * (2 * (128 + 64 / 6 + 128 + carried) + 2 * (256 + 512 / 6 + 256) + (160 + 64 / 6 + 160 + carried)) / 1e3
    fwd = 1.3125
    assert s == pytest.approx({
        "load": 1.0, "trace": 2 * fwd, "reports": 0.6,
        "spectra": 2 * (4 * 128 + 160) / 1e3 + 0.8 / 2**3 * 5 * 4**3,  # the Grams, then their eigenvalues
        "calibration data": 3 / 4 * fwd,  # the first batch's first two rows together, its second alone
        # 24 fit rows in batches of 4; every layer's decomposition, kept, cut at full rank (one thread's rate unmeasured)
        "statistics": 6 * fwd + grams + decomp + factors,
        # the dense model on the 4 search and 4 verification rows, and the search's first stage (its 4 rows) again
        "references": (4 + 4 + 4) / 4 * fwd,
        # every fit row (4096 positions / 16 > 24); its loss-aware truncations, kept, cut at full rank
        "gradients": 6 * (2 * fwd + 2 * 2.625) + decomp + factors,
        # search half: 4 rows; 10 plans, 3 on every row; each plan's factors sliced from the gradient pass's cuts
        "tier 3": (4 + 7 * 4 + 3 * 4) / 4 * fwd,
        # the chosen plan's default (sequential) fit: per fit batch one dense run of the block reading every stage's
        # rows, a fitted run of each stage (at most one a layer of the block's 2, each ending as its layer is reached:
        # none of the block, then half of it), the fitted block once more, the head's stage 2 whole runs; C and G per layer,
        # each W* truncated; each of the 2 blocks' refinement (not the head's: nothing outside the blocks is refined):
        # 8 epochs of the block's forward and backward (0.5 + 1 s) over 5 of the 6 fit batches, the sixth held back
        # and run forward before the first epoch and after each
        "verification": 2 * 1 * fwd + ((2.5 * 128 / 168 + 2 * 40 / 168) * 6 * fwd + 2 * grams + decomp + solves
                                                 + 2 * (8 * 5 * (0.5 + 1.0) + 9 * 0.5)),
        # SVD-LLM's uniform truncation beside each of the 5 frontier plans (of the 10) on the rows each read (every
        # one of the 4 search rows: the head's 4 too), and the chosen plan's on the 4 verification rows, sliced from
        # tier 1's cuts (nothing decomposed or multiplied again)
        "uniform baseline": (5 * 4 + 4) / 4 * fwd,
        "plan check": planned})
    assert s["statistics"] == pytest.approx(154.003)
    # bfloat16 weights: the rounding floor (every layer at full rank, sliced from the gradient pass's cuts, the
    # dense reference and one measurement on the 4 search rows, of the copy factored at full rank: each of the 5
    # layers 16 multiply-adds more a position, k (m + n) - m n, on the forward's 168)
    bf16 = est.Shapes(**{**SHAPES.__dict__, "element_bytes": 2})
    low = est.stage_seconds(bf16, WORK, MEASURED)
    assert est.full_rank_ratio(SHAPES) == pytest.approx(1 + 80 / 168)
    assert low["rounding floor"] == pytest.approx(1 * fwd + 1 * fwd * (1 + 80 / 168))
    assert {k: v for k, v in low.items() if k != "rounding floor"} == s
    # --probe: no loss-aware store; the floor (bf16), the search and the baseline cut from tier 1's decompositions
    probes = est.Workload(**{**WORK.__dict__, "sensitivity": "probes"})
    p, plow = est.stage_seconds(SHAPES, probes, MEASURED), est.stage_seconds(bf16, probes, MEASURED)
    assert p["gradients"] == pytest.approx(2 * 5 * 1 * fwd)  # 5 layers at two ranks, one batch of search rows (no cut)
    assert p["tier 3"] == s["tier 3"] and p["uniform baseline"] == s["uniform baseline"]
    assert plow["rounding floor"] == low["rounding floor"] and plow["tier 3"] == s["tier 3"]
    assert est.stage_seconds(SHAPES, est.Workload(**{**WORK.__dict__, "sensitivity": ""}), MEASURED)[
        "gradients"] == 0.0


def test_the_sequential_fit_runs_each_stage_to_its_first_layer():
    """A Llama-7B block (q, k, v, o 4096 x 4096, gate and up 11,008 x 4096, down 4096 x 11,008): one dense run, each
    layer a stage whose fitted run ends as it is reached, the fitted block once more; the head a stage of two whole
    runs; a model without blocks runs each stage on the whole model twice, ending likewise."""
    sq, wide = 4096 * 4096, 11008 * 4096
    block = ((4096, 4096),) * 4 + ((11008, 4096),) * 2 + ((4096, 11008),)
    cum = [sq, 2 * sq, 3 * sq, 4 * sq, 4 * sq + wide, 4 * sq + 2 * wide, 4 * sq + 3 * wide]
    share = sum(c / cum[-1] for c in cum[:-1])  # the first layer's run reads the block's input alone: 0
    assert share == pytest.approx(2.1606, abs=1e-4)  # against 7 runs of the whole block
    head = 32000 * 4096
    llama = est.Shapes(0, block * 32 + ((32000, 4096),), block, 32, 32 * cum[-1] + head, cum[-1])
    inside = 32 * cum[-1] / (32 * cum[-1] + head)
    assert est.fit_runs(llama) == pytest.approx((share + 2) * inside + 2 * (1 - inside))  # the head: the tail
    assert est.fit_runs(est.Shapes(0, block)) == pytest.approx(2 * share)


def test_layers_reading_one_input_share_one_gram():
    """A block whose first two layers read one input (measured: stages of 2 and 1 layers) has two Grams a fit pass,
    not three: the statistics pass and the fit compute one for q, k and v; the layers outside the blocks one each."""
    block = ((8, 4), (8, 4), (4, 8))
    sh = est.Shapes(1000, block + block + ((10, 4),), block, 2, 216, 96)
    me = est.Measurements(**{**MEASURED.__dict__, "stage_layers": (2, 1), "stage_shares": (2 / 3, 1.0)})
    assert est.gram_flops(sh, 10, me) == 2 * 10 * (2 * (16 + 64) + 16)
    assert est.gram_flops(sh, 10, me, blocks_only=True) == 2 * 10 * (16 + 64)
    assert est.gram_flops(sh, 10, MEASURED) == 2 * 10 * (2 * (16 + 16 + 64) + 16)  # unmeasured: one a layer
    # held likewise: a block's Grams one an input (and two copies of the largest), the fit's sums one stage's
    assert est._block_grams(sh, me) == 8 * (16 + 64) + 2 * 8 * 64
    assert est._block_grams(sh, MEASURED) == est._block_grams(sh) == 8 * (16 + 16 + 64) + 2 * 8 * 64
    assert est._fit_sums(sh) == 3 * 8 * 64  # C, G and the product being added, at the widest input
    staged, each = est.stage_seconds(sh, WORK, me), est.stage_seconds(
        sh, WORK, est.Measurements(**{**me.__dict__, "stage_layers": (1, 1, 1)}))
    saved = 2 * 24 * 16 * 2 * 16 / 1e3  # a Gram of width 4 in each of 2 blocks, over the 24 x 16 fit positions
    assert each["statistics"] - staged["statistics"] == pytest.approx(saved)
    assert each["verification"] - staged["verification"] == pytest.approx(2 * saved, rel=1e-3)  # C and G


def test_the_measured_stages_and_forwards_recording_gradients_are_used_where_measured():
    """Measured stage shares replace the per-layer bound in the sequential fit; a forward recording for a backward
    (grad_forward) is the gradient pass's and the refinement's training steps', the plain forward everything else's."""
    assert est.fit_runs(SHAPES, (0.25, 1.0)) == pytest.approx((0.25 + 2) * 128 / 168 + 2 * 40 / 168)
    me = est.Measurements(**{**MEASURED.__dict__, "grad_forward": 0.75, "stage_shares": (0.25, 1.0)})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    fwd, gfwd = 1.3125, 0.75 * 2.625
    assert s["gradients"] - plain["gradients"] == pytest.approx(6 * 2 * (gfwd - fwd))
    fit_gap = ((1.25 + 2) - (1.5 + 2)) * 128 / 168 * 6 * fwd  # the stages: 0.25 + 1 of the block, not 0.5 + 1
    assert s["verification"] - plain["verification"] == pytest.approx(fit_gap + 2 * 8 * 5 * (0.75 - 0.5))
    assert {k: v for k, v in s.items() if k not in ("gradients", "verification")} == {
        k: v for k, v in plain.items() if k not in ("gradients", "verification")}


def test_the_loss_aware_truncations_are_counted_as_measured():
    """The gradient pass's decompositions, and the sequential fit's of W*, are loss-aware: where one was timed
    (loss_seconds, at decompose_shape) each layer's is its products (out <= in: m n^2 + 2 m^2 n + 3 m^3; out > in:
    m n^2 + 4 n^3) and its eigendecomposition scaled from what the measured one left after its products, not the
    whitened decomposition's."""
    me = est.Measurements(**{**MEASURED.__dict__, "loss_seconds": 3.0})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    eig = (2.0 - 2 * 576 / 1e3) / 4**3
    decomp = 2 * (2 * 576 / 1e3 + eig * 64) + 2 * (2 * 448 / 1e3 + eig * 64) + (2 * 640 / 1e3 + eig * 64)
    # loss-aware products: out > in m n^2 + 4 n^3, out <= in m n^2 + 2 m^2 n + 3 m^3; decompose_shape (8, 4) has 384
    cost = {(8, 4): 8 * 16 + 4 * 64, (4, 8): 4 * 64 + 2 * 16 * 8 + 3 * 64, (10, 4): 10 * 16 + 4 * 64}
    eig_loss = (3.0 - 2 * 384 / 1e3) / 4**3  # what the measured 3 s left after its products, a k^3
    loss = sum(k * (2 * cost[sh] / 1e3 + eig_loss * 64) for sh, k in (((8, 4), 2), ((4, 8), 2), ((10, 4), 1)))
    assert s["gradients"] - plain["gradients"] == pytest.approx(loss - decomp)
    assert s["verification"] - plain["verification"] == pytest.approx(loss - decomp)
    assert {k: v for k, v in s.items() if k not in ("gradients", "verification")} == {
        k: v for k, v in plain.items() if k not in ("gradients", "verification")}
    # made on one BLAS thread, as the calibration runs: its products at one thread's rate where measured
    one = est.Measurements(**{**me.__dict__, "gemm1_flops": 500.0})
    eig_one = (3.0 - 2 * 384 / 500) / 4**3
    assert est.loss_decompositions_seconds(SHAPES, one) == pytest.approx(
        sum(k * (2 * cost[sh] / 500 + eig_one * 64) for sh, k in (((8, 4), 2), ((4, 8), 2), ((10, 4), 1))))


def test_the_statistics_count_the_blocks_as_measured_with_their_grams():
    """Where one block's forward with its statistics hooks was timed (stats_forward), the blocks' forwards and Grams
    are that time per batch and block; the layers outside the blocks keep their Gram products."""
    me = est.Measurements(**{**MEASURED.__dict__, "stats_forward": 2.0})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    block_grams = 2 * 24 * 16 * (16 + 64) / 1e3  # one block's two layers over every fit token
    assert s["statistics"] - plain["statistics"] == pytest.approx(2 * (6 * (2.0 - 0.5) - block_grams))
    assert {k: v for k, v in s.items() if k != "statistics"} == {k: v for k, v in plain.items() if k != "statistics"}


def _llama_block() -> tuple[torch.nn.Module, tuple[tuple, dict]]:
    """A one-block Llama's block (width 64, GQA 4/2, intermediate 192) and the inputs its model's forward gave it
    (no cache, no graph)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=192, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    block = model.model.layers[0]
    seen = []
    block.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)), use_cache=False)
    return block, seen[0]


def test_a_llama_blocks_stages_are_watched_as_the_fit_forms_them():
    """q, k and v read one tensor, gate and up another: four stages, each ending at its last layer's share of the
    block's multiplied parameters; a module called twice gives none (the fit's runs do not stop then)."""
    block, (args, kwargs) = _llama_block()
    with torch.no_grad(), est._StageWatch(block) as watch:
        block(*args, **kwargs)
    q, kv, o, up = 64 * 64, 32 * 64, 64 * 64, 192 * 64
    total = q + 2 * kv + o + 3 * up
    assert watch.shares() == pytest.approx(((q + 2 * kv) / total, (q + 2 * kv + o) / total,
                                           (total - up) / total, 1.0))
    assert watch.counts() == (3, 1, 2, 1)  # q, k, v; o; gate, up; down
    twice = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with est._StageWatch(twice) as watch:
        twice(twice(torch.zeros(1, 4)))
    assert watch.shares() == () and watch.counts() == ()


def test_a_stages_truncations_are_counted_on_every_core_at_once():
    """The sequential fit truncates a stage's layers on every core at once, each layer to the first thread free, the
    stages one after another: a Llama block's q, k, v on 2 cores take two of their times, gate and up one."""
    times = [1.0, 1.0, 1.0, 2.0, 3.0, 3.0, 4.0]
    assert est.staged_seconds(times, (3, 1, 2, 1), 2) == 2.0 + 2.0 + 3.0 + 4.0
    assert est.staged_seconds(times, (3, 1, 2, 1), 4) == 1.0 + 2.0 + 3.0 + 4.0
    assert est.staged_seconds(times, (3, 1, 2, 1), 1) == sum(times)
    assert est.staged_seconds(times, (3, 1, 2), 2) == sum(times)  # counts that miss a layer: each layer a stage
    assert est.staged_seconds([3.0, 1.0, 1.0], (3,), 2) == 3.0  # the first thread busy, the second takes both
    # a stage of fewer layers than cores: each layer on its share of the threads, at the measured speed-up of all
    # the cores (1.6 here) interpolated linearly from one thread (4 cores, 2 layers: 2 threads each, 1.2x)
    assert est.staged_seconds(times, (3, 1, 2, 1), 2, 1.6) == pytest.approx(2.0 + 2.0 / 1.6 + 3.0 + 4.0 / 1.6)
    assert est.staged_seconds(times, (3, 1, 2, 1), 4, 1.6) == pytest.approx(1.0 + 2.0 / 1.6 + 3.0 / 1.2 + 4.0 / 1.6)
    assert est.staged_seconds(times, (3, 1, 2, 1), 1, 1.6) == sum(times)
    # the toy block's two layers, one stage, on two threads: the longer of the two, each block
    two = est.Workload(**{**WORK.__dict__, "threads": 2})
    me = est.Measurements(**{**MEASURED.__dict__, "stage_shares": (1.0,), "stage_layers": (2,)})
    eig = (2.0 - 2 * 576 / 1e3) / 4**3  # as in test_stage_seconds_exact
    first, second = 2 * (576 + 128 + 64 / 6 + 128) / 1e3 + eig * 64, 2 * (448 + 256 + 512 / 6 + 256) / 1e3 + eig * 64
    head = 2 * (640 + 160 + 64 / 6 + 160) / 1e3 + eig * 64  # each with W*'s solve (not carried: not loss-aware)
    assert est.fit_decompositions_seconds(SHAPES, two, me, False) == pytest.approx(2 * max(first, second) + head)
    assert est.fit_decompositions_seconds(SHAPES, WORK, me, False) == pytest.approx(2 * (first + second) + head)


def test_the_refinement_at_its_most_epochs():
    """Every fit batch but the last one in CHECK trained forward and backward EPOCHS times; the held-back ones run
    forward EPOCHS + 1 times; a partial last batch counts its rows; one fit batch refines nothing."""
    def at(fit_rows: int, batch_rows: int) -> float:
        return est.refinement_seconds(est.Workload(**{**WORK.__dict__, "fit_rows": fit_rows,
                                                      "batch_rows": batch_rows}), 1.0, 3.0)

    assert at(48, 32) == pytest.approx((8 * 32 * 3.0 + 9 * 16 * 1.0) / 32)  # the 7B calibration: 32 + 16 rows
    assert at(24, 4) == pytest.approx(8 * 5 * 3.0 + 9 * 1.0)
    assert at(64, 4) == pytest.approx((8 * 56 * 3.0 + 9 * 8 * 1.0) / 4)  # 16 batches: the last 2 held back
    assert at(4, 4) == 0.0 and at(0, 4) == 0.0


def test_the_refinement_counts_the_factored_step_measured_at_the_budgets_ranks():
    """With a budget the refinement's step is the block's factored training step measured at the ranks the budget
    leaves (refine.step_seconds), every block's; the share kept is what the budget's parameters leave of the blocks'
    multiplied weights, 1 without a budget (the dense block counted: the bound)."""
    me = est.Measurements(**{**MEASURED.__dict__, "refine_step": 0.25})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    assert plain["verification"] - s["verification"] == pytest.approx(2 * 8 * 5 * (1.5 - 0.25))
    assert {k: v for k, v in s.items() if k != "verification"} == {
        k: v for k, v in plain.items() if k != "verification"}
    # timed on a device (the refinement trains there): each check a third of that step, not the host's forward
    there = est.Measurements(**{**me.__dict__, "device_linalg": (0.5, 0.5, 1e12)})
    assert est.refinement_slack(SHAPES, WORK, there) == pytest.approx(2 * 7 * (5 * 0.25 + 0.25 / 3))
    assert est.refinement_slack(SHAPES, WORK, me) == pytest.approx(2 * 7 * (5 * 0.25 + 0.5))
    assert est.kept_share(SHAPES, 200, 0.2) == pytest.approx(1 - 0.2 * 200 / 128)  # 2 blocks of 64
    assert est.kept_share(SHAPES, 200, None) == 1.0 and est.kept_share(SHAPES, 200, 0.9) == 0.05
    assert est.kept_share(est.Shapes(**{**SHAPES.__dict__, "block_layers": ()}), 200, 0.2) == 1.0


def test_the_factored_step_is_timed_on_the_block_and_puts_its_modules_back():
    """refine.step_seconds times a real training step on a Llama block with its Linears factored (the quicker of
    two), and leaves the block's modules and weights as they were."""
    from auditor.calibration.statistics.refine import step_seconds
    from auditor.calibration.statistics.stream import hidden_state

    block, inputs = _llama_block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    kinds = [type(m) for m in block.modules()]
    ticks = iter(range(1000))
    took = step_seconds(block, inputs, 0.5, hidden_state, lambda: float(next(ticks)))
    assert took == 1.0  # each timed step: one tick of the fake clock between its two reads
    assert [type(m) for m in block.modules()] == kinds
    assert all(torch.equal(v, block.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in block.parameters())
    # on a named device (here the CPU, named): the same step, the block's weights and the inputs copied there
    assert step_seconds(block, inputs, 0.5, hidden_state, lambda: float(next(ticks)), device=torch.device("cpu")) == 1.0
    assert all(torch.equal(v, block.state_dict()[k]) for k, v in before.items())


def test_the_least_wall_stops_every_refinement_after_its_first_epoch():
    """The wall's floor: every block's refinement stopped after one epoch (5 training batches forward and backward,
    the held-back one forward twice) instead of all 8; said under the table and in the JSON."""
    e = est.predict(SHAPES, WORK, MEASURED)
    fwd, bwd = 0.5, 1.0  # each of the 2 blocks'
    assert e.slack_seconds == pytest.approx(2 * ((8 * 5 * (fwd + bwd) + 9 * fwd) - (5 * (fwd + bwd) + 2 * fwd)))
    assert e.as_dict()["least_wall_seconds"] == pytest.approx(e.wall_seconds - e.slack_seconds, abs=1e-3)
    table = est.render_table(e)
    assert "  at least        10.0 min" in table and "stopped after one epoch" in table
    assert max(len(line) for line in table.splitlines()) <= 120
    plain = est.predict(est.Shapes(**{**SHAPES.__dict__, "block_layers": ()}), WORK, MEASURED)
    assert plain.slack_seconds == 0 and "at least" not in est.render_table(plain)


def test_the_gradient_pass_counts_its_sampling_and_its_moments_where_measured():
    """A likelihood metric samples labels over the vocabulary at every gradient position SAMPLES times (per logit:
    logit_seconds), and every sample's output gradients go into each layer's moment (2 min(m, n)^2 float32
    multiply-adds per position, and 2 m n more where out > in, carried back)."""
    me = est.Measurements(**{**MEASURED.__dict__, "logit_seconds": 1e-6, "gemm32_flops": 1e4})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    positions = 24 * 16  # every fit row (4096 positions / 16 > 24), 16 tokens each
    per = 2 * 5 * 4 ** 2 + 2 * (8 * 4 + 8 * 4 + 10 * 4)  # every layer's min side is 4; three have out > in
    assert s["gradients"] - plain["gradients"] == pytest.approx(2 * positions * 10 * 1e-6 + 2 * positions * per / 1e4)
    assert {k: v for k, v in s.items() if k != "gradients"} == {k: v for k, v in plain.items() if k != "gradients"}


def test_the_gradient_pass_backward_carries_to_the_inputs_alone_where_measured():
    """The gradient pass's backward computes no weight's gradient (its taps are the graph's ends): where the block's
    backward to its inputs alone was measured (block_carry) the pass counts it; the refinement, whose factors make
    every planned weight's gradient, counts the whole backward."""
    me = est.Measurements(**{**MEASURED.__dict__, "block_carry": 0.25})
    s, plain = est.stage_seconds(SHAPES, WORK, me), est.stage_seconds(SHAPES, WORK, MEASURED)
    assert plain["gradients"] - s["gradients"] == pytest.approx(6 * 2 * (1.0 - 0.25) * 2.625)
    assert {k: v for k, v in s.items() if k != "gradients"} == {k: v for k, v in plain.items() if k != "gradients"}


def test_the_byte_plan_is_a_stage_of_its_own_when_asked():
    """--budget-bytes: every layer's options (a rank SVD and two corrections) and the plans that factorize
    (BYTE_DECOMPOSITIONS decompositions of every layer) and fifteen plans measured on the verification rows; its
    peak holds one plan's replacement weights (every rewritten layer in the model's dtype) and two float64 copies of
    the largest."""
    wl = est.Workload(**{**WORK.__dict__, "byte_plan": True})
    s, plain = est.stage_seconds(SHAPES, wl, MEASURED), est.stage_seconds(SHAPES, WORK, MEASURED)
    eig = (2.0 - 2 * 576 / 1e3) / 4**3  # as in test_stage_seconds_exact
    decomp = 2 * (2 * 576 / 1e3 + eig * 64) + 2 * (2 * 448 / 1e3 + eig * 64) + (2 * 640 / 1e3 + eig * 64)
    assert s["rank or bits"] == pytest.approx(9 * decomp + 15 * 1 * 1.3125)  # 4 verification rows: one batch
    assert {k: v for k, v in s.items() if k != "rank or bits"} == plain
    by = {st.name: st.peak_bytes for st in est.predict(SHAPES, wl, MEASURED).stages}
    assert by["rank or bits"] == 1100 + (2560 + 3 * 2560) + 1000 + 4 * (2 * (32 + 32) + 40) + 2 * 8 * 40


def test_peak_disk_and_device_exact():
    e = est.predict(SHAPES, WORK, MEASURED, available=5)
    by = {st.name: st.peak_bytes for st in e.stages}
    assert [st.name for st in e.stages] == [n for n in est.STAGES if n not in ("rounding floor", "rank or bits")]
    assert by["statistics"] == 1100 + 2 * 6 * 256 + 1000 + (8 * 16 + 8 * 64 + 2 * 8 * 64) + 2 * 8 * 40
    # the output's logits (2560) and their gradient, three copies of one chunk of them (the whole batch here:
    # metrics/chunks.py); one output gradient at a time, the widest (10): it, its kept rows and its float copy
    assert by["gradients"] == 1100 + 2 * 2560 + 3 * 2560 + 2 * 256 + 1000 + 256 + 3 * 4 * 16 * 10 * 4 + 640 == 23988
    # tier 3, the verification and the plan check: one block's factors at a time (192 bytes) and the head's, outside
    # the blocks (112), not every layer's (496); the last two fit the plan as factorize does: one block's fitted
    # weights (float32) and truncators (float64) and the head's (the finished blocks' on disk), three kept hidden
    # states per fit batch, one stage's C and G and the product being added at the widest input (8), and the dense
    # rows its stages read on every fit batch (each layer a stage, unmeasured: inputs 4 and 8 wide, the hidden
    # state's 256 bytes 4 wide)
    fit = (4 * (32 + 32) + 8 * ((8 * 4 + 16) + (4 * 4 + 64))) + (4 * 40 + 8 * (10 * 4 + 16)) + 3 * 6 * 256 \
        + 3 * 8 * 64 + 6 * 256 * (4 + 8) // 4
    plan = 2560 + 3 * 2560  # the output's logits, three copies of one chunk of them
    # the refinement: the fit's own without its sums and dense rows, one batch's graph (the saved 1000) and one
    # block's factors at half rank four times over (float32 masters, gradients, two moments: 4 x 192)
    refine = fit - 3 * 8 * 64 - 6 * 256 * (4 + 8) // 4 + 1000 + 4 * 192
    # one after another, so the largest: here the fit's stages (its sums and dense rows), none of the three added
    assert fit > plan + 1000 + 304 > refine
    assert (by["tier 3"], by["verification"], by["plan check"]) == (1100 + plan + 1000 + 304 + 1664,
                                                                     1100 + fit, 1100 + fit)
    assert e.peak_rss_bytes == by["gradients"] == 23988
    # wider hidden states (2560 bytes): their dense rows by the measured stages (q, k, v one stage reading one input;
    # here both layers, one 4-wide input) or each layer a stage
    wide = est.Measurements(**{**MEASURED.__dict__, "hidden_bytes": 2560})
    each = {st.name: st.peak_bytes for st in est.predict(SHAPES, WORK, wide).stages}["verification"]
    assert each == 1100 + fit + 3 * 6 * (2560 - 256) + 6 * (2560 - 256) * (4 + 8) // 4
    one = est.predict(SHAPES, WORK, est.Measurements(**{**wide.__dict__, "stage_shares": (1.0,), "stage_layers": (2,)}))
    assert {st.name: st.peak_bytes for st in one.stages}["verification"] == each - 6 * 2560 * 8 // 4
    # a vocabulary of 100: the fitted plan's measurement holds the most (its logits, three copies of a chunk)
    vocab = est.Workload(**{**WORK.__dict__, "outputs": 100})
    got = {st.name: st.peak_bytes for st in est.predict(SHAPES, vocab, MEASURED).stages}["verification"]
    assert got == 1100 + 4 * 25600 + 1000 + 304
    # a block's graph larger than the fit's sums and rows, one output: the refinement holds the most
    big = est.Measurements(**{**MEASURED.__dict__, "block_saved_bytes": 20000})
    narrow = est.Workload(**{**WORK.__dict__, "outputs": 1})
    got = {st.name: st.peak_bytes for st in est.predict(SHAPES, narrow, big).stages}["verification"]
    assert got == 1100 + fit - 3 * 8 * 64 - 6 * 256 * (4 + 8) // 4 + 20000 + 4 * 192
    # the Grams, the kept truncators cut (tier 1's and the gradient pass's: 2 x 8 min(m, n) (m + n)) and the moments
    cuts = 2 * 8 * (4 * 4 * 12 + 4 * 14)
    assert e.disk_bytes == 2 * (20000 + 2000 * 5) + 8 * 176 + cuts + 640
    assert e.peak_device_bytes is None
    on = est.predict(SHAPES, est.Workload(**{**WORK.__dict__, "device": "cuda", "offload": True}), MEASURED)
    assert on.peak_device_bytes == (1000 - 64 * 4) + 1000 + 2 * 6 * 256 + 1664
    assert e.wall_seconds == pytest.approx(sum(est.stage_seconds(SHAPES, WORK, MEASURED).values()))


def test_uncalibrated_has_no_calibration_stages():
    e = est.predict(SHAPES, est.Workload(0, 0, 16, 1, 10, calibrated=False), MEASURED)
    assert [s.name for s in e.stages] == ["load", "trace", "spectra", "reports"]


def test_short_of_memory_line_and_fix():
    wide = est.Measurements(**{**MEASURED.__dict__, "hidden_bytes": 2560})  # the verification's fit the peak
    e = est.predict(SHAPES, WORK, wide)
    peak = e.peak_rss_bytes
    assert peak == {st.name: st.peak_bytes for st in e.stages}["verification"]
    assert est.short_of_memory(e, peak) is None and est.short_of_memory(e, None) is None
    line = est.short_of_memory(e, peak - 1)
    assert "verification" in line and "available" in line
    # weights mapped from the checkpoint are paged from disk: the check counts what must be held
    mapped = est.predict(est.Shapes(**{**SHAPES.__dict__, "mapped_bytes": 600}), WORK, wide)
    assert mapped.peak_rss_bytes == e.peak_rss_bytes and mapped.needed_bytes == e.peak_rss_bytes - 600
    assert est.short_of_memory(mapped, peak - 600) is None
    assert est.short_of_memory(mapped, peak - 1 - 600).startswith(
        "the audit is estimated to peak at 0 MiB of host memory (in its verification stage: the sequential fit's "
        "float64 Grams and whitenings n x n, the largest 8 x 8, the 0 MiB of weights mapped from the checkpoint not "
        "counted)")
    assert "  of it 0 MiB the weights, mapped from the checkpoint (paged from disk as read): 0 MiB must be held" \
        in est.render_table(mapped)
    assert "--calibration-max-rows" in est.FIX and "--offload" in est.FIX and "--scheduler" in est.FIX


def test_short_of_disk_line_and_the_check_before_the_audit(monkeypatch):
    """What the audit writes (the spilled statistics, the kept bases, the moments, the reports) against the scratch
    folder's free space: one line and the fix before it starts, none where it fits or the space is unknown."""
    from types import SimpleNamespace

    from auditor.options import AuditOptions

    e = est.predict(SHAPES, WORK, MEASURED)
    assert est.short_of_disk(e, e.disk_bytes, "/scratch") is None and est.short_of_disk(e, None, "/scratch") is None
    assert est.short_of_disk(e, e.disk_bytes - 1, "/scratch") == (
        "the audit is estimated to write 0 MiB to /scratch (spilled statistics and kept decompositions) but 0 MiB is "
        "free there")
    # with the cache on the Grams go beside its entry, not to the scratch folder: not counted there
    assert e.gram_bytes == 8 * (3 * 4**2 + 2 * 8**2) and est.short_of_disk(e, e.disk_bytes - e.gram_bytes, "/s") \
        and est.short_of_disk(e, e.disk_bytes - e.gram_bytes, "/s", cached=True) is None
    monkeypatch.setattr(est, "estimate_loaded", lambda *a, **k: e)
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), example_inputs=None, source="x")
    options = AuditOptions(calibration="x.safetensors", cache=False)
    assert est.refuse_if_short(loaded, options, available=2**40, free_disk=e.disk_bytes) is e
    with pytest.raises(AuditError) as refused:
        est.refuse_if_short(loaded, options, available=2**40, free_disk=e.disk_bytes - 1)
    assert str(refused.value).startswith("the audit is estimated to write 0 MiB to ") and "TMPDIR" in str(
        refused.value)
    with pytest.raises(AuditError, match="of host memory"):  # memory is checked first
        est.refuse_if_short(loaded, options, available=1, free_disk=0)


MODELS = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def net():
    torch.manual_seed(0)
    return Net()
'''


@pytest.fixture
def small(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "m.py").write_text(MODELS)
    save_file({"x": torch.randn(64, 16, generator=torch.Generator().manual_seed(0))}, str(tmp_path / "cal.safetensors"))
    return tmp_path


def test_shapes_of_a_model_with_blocks():
    import importlib.util
    import sys
    import types

    mod = types.ModuleType("estimate_models")
    exec(MODELS, mod.__dict__)
    sh = est.shapes_of(mod.net())
    assert sh.blocks == 2 and sh.block_layers == ((32, 16), (16, 32))
    assert sh.layers == ((32, 16), (16, 32), (32, 16), (16, 32), (4, 16))
    assert sh.flop_params == 4 * 512 + 64 and sh.block_flop_params == 1024


def test_the_gradient_rows_are_those_the_gradient_pass_reads():
    """The gradient pass reads each fit batch's first rows, the same share of each rounded up, joined into batches
    (tiers/sensitivity.gradient_rows): the estimate counts the rows and batches that gives, here 15 rows in 4 batches
    of a 135M shape's 36 fit rows of 512 positions in batches of 5 (GRADIENT_POSITIONS / 512 would be 8 in 2)."""
    transformers = pytest.importorskip("transformers")
    from auditor.calibration import load_calibration
    from auditor.calibration.tiers.sensitivity import gradient_rows

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (48, 512), generator=torch.Generator().manual_seed(0))
    cal = load_calibration({"input_ids": ids}, model, holdout=0.25, batch_size=5)
    picked, _ = gradient_rows(cal)
    wl = est.Workload(**{**WORK.__dict__, "fit_rows": cal.fit_rows, "tokens": 512, "batch_rows": 5})
    assert (cal.fit_rows, est.gradient_rows(wl)) == (36, (15, 4))
    assert est.gradient_rows(wl) == (sum(b.rows for b in picked.fit), len(picked.fit))
    assert est.gradient_rows(est.Workload(**{**wl.__dict__, "tokens": 64})) == (36, 8)  # 2,304 positions: every row
    assert est.gradient_rows(est.Workload(**{**wl.__dict__, "token_inputs": False, "tokens": 1})) == (36, 8)


def test_a_head_tied_to_the_embedding_is_multiplied_though_counted_once():
    """A language model whose output head is its input embedding: the table is a lookup (not a layer), but the head
    multiplies it by every position, so the forward's multiplied parameters count it (and a forward outside the
    blocks scales by it); untied, the head is a layer of its own."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True)
    tied = est.shapes_of(transformers.LlamaForCausalLM(cfg))
    block = 32 * 32 * 2 + 16 * 32 * 2 + 48 * 32 * 3  # q, o; k, v (2 of 4 heads); gate, up, down
    assert tied.block_flop_params == block and tied.embedding_params == 256 * 32
    assert tied.flop_params == 2 * block + 256 * 32 and (256, 32) not in tied.layers
    cfg.tie_word_embeddings = False
    untied = est.shapes_of(transformers.LlamaForCausalLM(cfg))
    assert untied.flop_params == tied.flop_params and untied.layers[-1] == (256, 32)


def test_the_statistics_pass_is_timed_only_where_a_blocks_grams_fit_the_memory():
    """Timing the statistics pass accumulates one block's float64 Grams (a Llama-2-70B block's, with the two copies
    of the widest, 23 GB: the estimate was killed for memory on a 24 GiB host): where they pass STATS_ROOM of the
    memory available it is not timed (stats_forward 0: counted from the block's forward and the Grams' products)."""
    import types

    from auditor.calibration.data.inputs import Batch

    mod = types.ModuleType("estimate_models")
    exec(MODELS, mod.__dict__)
    model = mod.net()
    sh = est.shapes_of(model)
    grams = 8 * (16 * 16 + 32 * 32) + 2 * 8 * 32 * 32  # up's and down's inputs, and two copies of the wider
    assert est.stats_timed(sh, None) and est.stats_timed(sh, 2 * grams) and not est.stats_timed(sh, 2 * grams - 1)
    batch = Batch((torch.randn(4, 16),), {})
    timed = est.measure(model, batch, sh, est.Process(100), asked=est.Asked(room=2 * grams))
    skipped = est.measure(model, batch, sh, est.Process(100), asked=est.Asked(room=2 * grams - 1))
    assert timed.stats_forward > 0 and skipped.stats_forward == 0 and skipped.block_forward > 0
    assert est.stage_seconds(sh, WORK, skipped)["statistics"] > 0  # counted from the forward and the products


def test_estimate_json_keys_and_no_audit(cli_inproc, small, monkeypatch):
    import auditor.pipeline

    def no_audit(*a, **k):
        raise AssertionError("--estimate ran the audit")

    monkeypatch.setattr(auditor.pipeline, "audit_source", no_audit)
    monkeypatch.setattr(auditor.pipeline, "audit", no_audit)
    res = cli_inproc(f"{small}/m.py:net", "--calibration", f"{small}/cal.safetensors", "--estimate", "--format",
                     "json", "-o", str(small / "out"))
    assert res.returncode == 0, res.stderr
    e = json.loads(res.stdout)["estimate"]
    assert {"wall_seconds", "peak_rss_bytes", "peak_device_bytes", "disk_bytes", "stages"} <= set(e)
    assert [s["stage"] for s in e["stages"]] == [n for n in est.STAGES if n not in ("rounding floor", "rank or bits")]
    assert e["wall_seconds"] == pytest.approx(sum(s["wall_seconds"] for s in e["stages"]), abs=0.01)
    assert e["peak_rss_bytes"] == max(s["peak_rss_bytes"] for s in e["stages"])
    assert e["basis"]["rows"]["search"] == 8  # 64 rows: 48 fit, 16 held out, cut in two
    by = {s["stage"]: s["wall_seconds"] for s in e["stages"]}
    me = e["basis"]["measurements"]
    assert me["block_forward"] > 0  # the read runs the first batch once: two blocks and the head (64 of 1,024 params)
    assert me["block_carry"] > 0 and me["block_backward"] > 0  # the backward to the inputs alone, and the whole
    assert me["stats_forward"] > 0 and me["grad_forward"] > 0 and len(me["stage_shares"]) == 2  # two stages a block
    assert by["trace"] == 0 and by["calibration data"] == pytest.approx(me["block_forward"] * (2 + 64 / 1024), abs=1e-3)
    assert not (small / "out").exists()  # nothing written
    for shape in ((), ("--input-shape", "2,16")):  # without inputs nothing is timed but the decompositions
        table = cli_inproc(f"{small}/m.py:net", "--estimate", *shape)
        assert table.returncode == 0 and "stage" in table.stdout and "reports" in table.stdout, table.stderr
        assert "\nstatistics " not in table.stdout and "\ngradients " not in table.stdout  # no calibrated stage


def test_calibrated_audit_refuses_when_short_of_memory(cli_inproc, small, monkeypatch):
    import auditor.sources.hf

    monkeypatch.setattr(auditor.sources.hf, "available_memory", lambda: 50 * 2**20)
    res = cli_inproc(f"{small}/m.py:net", "--calibration", f"{small}/cal.safetensors", "-o", str(small / "out"))
    assert res.returncode == 2, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "estimated to peak at" in lines[0] and "50 MiB is available" in lines[0]
    assert "--calibration-max-rows" in lines[0] and "Traceback" not in res.stderr
    assert not (small / "out").exists()


def test_the_check_never_blocks_an_audit_it_cannot_measure(small, monkeypatch):
    """A forward the estimate cannot time (here: it raises) is not refused by the check; the audit reports it."""
    from types import SimpleNamespace

    from auditor.options import AuditOptions

    def broken(*a, **k):
        raise RuntimeError("cannot time this forward")

    monkeypatch.setattr(est, "estimate_loaded", broken)
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), example_inputs=None, source="x")
    assert est.refuse_if_short(loaded, AuditOptions(calibration="x.safetensors"), available=1) is None
    assert est.refuse_if_short(loaded, AuditOptions(), available=1) is None  # no calibration: no check


def test_a_config_without_weights_is_estimated_from_two_blocks_built_on_the_cpu(cli_inproc, tmp_path, monkeypatch):
    """A Hugging Face directory with only a config (built on the meta device) is timed on two of its blocks built
    from the config; the weights' bytes are the whole model's (16 blocks, bf16), the trace runs the example input
    (64 positions), not a calibration batch (32 x 48), and inputs that do not fit are one line, exit 2."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
           "max_position_embeddings": 128, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    save_file({"input_ids": torch.randint(0, 97, (64, 48), generator=torch.Generator().manual_seed(0))},
              str(tmp_path / "cal.safetensors"))
    import auditor.sources.checkpoint as ck

    monkeypatch.setattr(ck, "MAP_MIN_BYTES", 0)  # as large a model's checkpoint would load: mapped
    res = cli_inproc(str(tmp_path / "llama"), "--calibration", str(tmp_path / "cal.safetensors"), "--compute-dtype",
                     "float32", "--input-ids", "1,64", "--estimate", "--format", "json")
    assert res.returncode == 0, res.stderr
    e = json.loads(res.stdout)["estimate"]
    assert e["basis"]["measured_on"] == "2 of 16 blocks built from the config (no weights: the load not measured)"
    params = 2 * 97 * 64 + 16 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert e["basis"]["shapes"]["weight_bytes"] == 2 * params + 2 * 8 * 4  # and the two rotary float32 buffers
    assert e["mapped_bytes"] == 2 * params  # the checkpoint it would read: safetensors, mapped, not copied
    assert e["needed_bytes"] == e["peak_rss_bytes"] - 2 * params
    me = e["basis"]["measurements"]
    forward = me["block_forward"] * (16 + 97 * 64 / (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128))  # + the head
    trace = next(s["wall_seconds"] for s in e["stages"] if s["stage"] == "trace")
    assert trace == pytest.approx(2 * forward * 64 / (32 * 48), abs=2e-3)


def test_estimate_inputs_that_do_not_fit_are_one_line(cli_inproc):
    res = cli_inproc("sample_models/digits.py:mlp", "--calibration", "sample_models/chargpt_calib.safetensors",
                     "--estimate")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: the inputs do not fit DigitsMLP.forward: RuntimeError: mat1 and mat2 must "
                                 "have the same dtype")


def test_the_linear_algebra_is_timed_at_the_quicker_of_two_runs():
    """A busy machine's pause in one run is not the work's cost: each of the whitened decomposition, the product on
    one thread and the eigenvalues (on one thread, as each spectra thread makes them) counts its quicker run (one
    decomposition timed once read 3.4x slow at 1.1B), and the product on every thread, a millisecond's work, the
    quickest of GEMM_REPEATS."""
    assert est.GEMM_REPEATS == 5
    ticks = iter([0.0,  # measuring starts
                  0.0, 1.5, 2.0, 3.0, 3.0, 5.0, 5.0, 6.5, 6.5, 7.0,  # the product on every thread: 1.5, 1, 2, 1.5, 0.5
                  7.0, 17.0, 17.0, 19.0,  # decompositions: 10 s, then 2 s
                  19.0, 23.0, 23.0, 25.0,  # the product on one thread: 4 s, then 2 s
                  25.0, 28.0, 28.0, 30.5,  # eigenvalues: 3 s, then 2.5 s
                  31.0])
    me = est.measure(torch.nn.Linear(4, 8), None, SHAPES, est.Process(100, 0.0), clock=lambda: next(ticks))
    assert (me.decompose_seconds, me.eig_seconds, me.seconds) == (2.0, 2.5, 31.0)
    assert me.decompose_shape == (4, 4)  # square, as wide as the widest short side (capped at 768)
    assert me.gemm_flops == pytest.approx(2.0 * 2 * 512**3 / 0.5)  # X^T X of (1024, 512) in the quickest 0.5 s
    assert me.gemm1_flops == pytest.approx(2.0 * 2 * 512**3 / 2.0)  # on one thread, the quicker 2 s


def _module_constants(tree) -> set[str]:
    """The UPPER_CASE names a module assigns at its top level."""
    import ast

    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and n.id.isupper():
                    names.add(n.id)
    return names


def test_the_estimate_defines_none_of_the_calibrations_constants():
    """A constant of the calibration (the gradient pass's positions, the backstops, the stages' rows, ...) copied into
    the estimate drifts from the code it stands for: each is imported from its owner, never assigned here."""
    import ast
    from pathlib import Path

    import auditor.calibration

    root = Path(auditor.calibration.__file__).parent
    owners: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for name in _module_constants(ast.parse(path.read_text())):
            owners.setdefault(name, []).append(str(path.relative_to(root.parent)))
    assert {"GRADIENT_POSITIONS", "VERIFY_BACKSTOPS", "MIN_HEAD", "SAMPLES", "SEARCH_SHARE", "CHUNK_VALUES"} <= set(owners)
    mine = _module_constants(ast.parse(Path(est.__file__).read_text()))
    copied = {n: owners[n] for n in sorted(mine & set(owners))}
    assert not copied, f"auditor/speed/estimate.py redefines the calibration's constants: import them from {copied}"
    # and what it reads is the calibration's own object
    from auditor.calibration.tiers import fisher, passes, sensitivity

    assert (est.GRADIENT_POSITIONS, est.SAMPLES, est.VERIFY_BACKSTOPS) == (
        sensitivity.GRADIENT_POSITIONS, fisher.SAMPLES, passes.VERIFY_BACKSTOPS)


@pytest.mark.parametrize("held", [2, 7, 16, 33, 48, 64])
def test_the_estimates_rows_are_those_the_calibration_reads(held):
    """The rows the cost model counts are those the stages read: the gradient pass's share of the fit rows
    (``sensitivity.gradient_rows``), the held-out rows' search and verification parts (``verify.split_rows``), and the
    rows a plan far from the tolerance reads (the staged evaluator's first stage)."""
    from auditor.calibration.data.inputs import Batch, Calibration
    from auditor.calibration.measure.staged import _stages
    from auditor.calibration.measure.verify import split_rows
    from auditor.calibration.tiers.sensitivity import gradient_rows

    def batches(rows: int, per: int = 8) -> list:
        ids = torch.randint(0, 50, (rows, 128), generator=torch.Generator().manual_seed(rows))
        return [Batch((), {"input_ids": ids[i:i + per]}) for i in range(0, rows, per)]

    cal = Calibration(batches(64), batches(held))  # 8,192 fit positions: the gradient pass reads half of each batch
    wl = est.Workload(cal.fit_rows, cal.holdout_rows, 128, 8, 50, token_inputs=True)
    rows = est._rows(wl)
    assert rows["gradient"] == gradient_rows(cal)[0].fit_rows == 32
    search, verify = split_rows(cal.holdout)
    assert (rows["search"], rows["verify"]) == (sum(b.rows for b in search), sum(b.rows for b in verify))
    head = sum(b.rows for b in _stages(search, rows["search"])[0])
    full = est.FULL_PLANS
    assert rows["tier3"] == rows["search"] + (rows["plans"] - full) * head + full * rows["search"]


def test_decompositions_are_their_products_on_one_thread_and_an_eigendecomposition():
    """The whitened decompositions run on one BLAS thread: their products at that thread's measured rate, and each
    layer's eigendecomposition of min(m, n) rows scaled by k^3 from what the measured one left after its products
    (none left: nothing added). A 4,096-wide square layer was predicted at a fifth of its 27.5 s when the whole
    decomposition was scaled by its products."""
    one = est.Measurements(**{**MEASURED.__dict__, "gemm1_flops": 500.0})
    assert est.decompositions_seconds(SHAPES, one) == pytest.approx(2 * 2 * 576 / 500 + 2 * 2 * 448 / 500
                                                                    + 2 * 640 / 500)  # 2.304 s of products > 2 s
    slow = est.Measurements(**{**one.__dict__, "decompose_seconds": 2.304 + 6.4})  # 0.1 s a k^3 of eigenvectors
    assert est.decompositions_seconds(SHAPES, slow) == pytest.approx(est.decompositions_seconds(SHAPES, one)
                                                                     + 5 * 0.1 * 4**3)
    # each decomposition cut as it is kept (m n min(m, n) at the one thread's rate). Tier 1's are made block by block
    # as each block's statistics are read, on every thread at once (one BLAS thread each), then the head's alone:
    # a block's (8, 4) and (4, 8) side by side (2.304 + 0.512 and 1.792 + 0.512 s), the head's (2.56 + 0.64 s) on
    # one thread. The gradient pass's all at once, divided by the threads.
    two = est.Workload(**{**WORK.__dict__, "threads": 2})
    s1, s2 = est.stage_seconds(SHAPES, WORK, one), est.stage_seconds(SHAPES, two, one)
    cuts = 2 * (4 * 128 + 160) / 500
    assert est.tier1_seconds(SHAPES, one, 1) == pytest.approx(est.decompositions_seconds(SHAPES, one) + cuts)
    assert est.tier1_seconds(SHAPES, one, 2) == pytest.approx(2 * (2.304 + 0.512) + 2.56 + 0.64)
    assert s1["statistics"] - s2["statistics"] == pytest.approx(
        est.tier1_seconds(SHAPES, one, 1) - est.tier1_seconds(SHAPES, one, 2))
    assert s1["gradients"] - s2["gradients"] == pytest.approx((est.loss_decompositions_seconds(SHAPES, one) + cuts) / 2)
    # the fit's truncations of W*: each layer a stage here, alone on both threads at the measured speed-up (2x)
    fit1, fit2 = (est.fit_decompositions_seconds(SHAPES, w, one, True) for w in (WORK, two))
    assert fit2 == pytest.approx(fit1 / 2) and s1["verification"] - s2["verification"] == pytest.approx(fit1 - fit2)
    assert s2["spectra"] == pytest.approx(est.spectra_seconds(SHAPES, one, 2))  # two spectra threads
    assert {k: v for k, v in s1.items() if k not in ("statistics", "gradients", "verification", "spectra")} == {
        k: v for k, v in s2.items() if k not in ("statistics", "gradients", "verification", "spectra")}


def test_the_spectra_run_largest_first_on_their_threads_at_one_threads_rate():
    """spectra/executor.py's ThreadExecutor: min(4, cores) threads, the layers largest first, each to the first
    thread free, each on cores // threads BLAS threads: a layer's Gram at the one thread's product rate and its
    eigenvalues scaled by k^3 from the one timed on one thread. 2.1x the measured wall when counted one after another
    at every thread's rate (the 7B-wide depth-2 shape: 150 s against 71 s)."""
    me = est.Measurements(**{**MEASURED.__dict__, "gemm1_flops": 500.0, "eig_seconds": 0.8, "eig_width": 2})
    unit = 0.8 / 2**3
    block = [2 * 128 / 500 + unit * 64, 2 * 128 / 500 + unit * 64]  # (8, 4) and (4, 8): m n min(m, n) = 128
    head = 2 * 160 / 500 + unit * 64  # (10, 4)
    times = sorted(block + block + [head], reverse=True)
    assert est.spectra_seconds(SHAPES, me, 1) == pytest.approx(sum(times))
    # the head (7.04 s) first, then the four block layers (6.912 s each), each to the thread free first
    assert est.spectra_seconds(SHAPES, me, 2) == pytest.approx(max(times[0] + times[3], times[1] + times[2] + times[4]))
    # 8 cores: 4 threads of 2 BLAS threads each, at the measured 2x of all 8 over one interpolated: 1 + 1/7
    four = max(times[0], times[1] + times[4], times[2], times[3])
    assert est.spectra_seconds(SHAPES, me, 8) == pytest.approx(four / (1 + 1 / 7))


def test_decompositions_timed_on_a_device_are_counted_there():
    """--device cuda: tier 1's and the gradient pass's decompositions are made on the device (statistics/ondevice.py),
    one after another there, so the statistics and the gradients count the device's timings, not the host threads'."""
    gradients = est.Workload(**{**WORK.__dict__, "sensitivity": "gradients"})
    host = est.stage_seconds(SHAPES, gradients, MEASURED)
    on = est.Measurements(**{**MEASURED.__dict__, "device_linalg": (0.1, 0.2, 1e5)})
    dev = est.stage_seconds(SHAPES, gradients, on)
    whiten, loss = est.device_decompositions(SHAPES, on)
    # each scaled as the host's are: the products at the device's rate, the eigenvectors by k^3 from the one timed
    assert whiten == pytest.approx(est._linalg_seconds(SHAPES, 0.1, (8, 4), est._whiten_cost, 1e5))
    assert loss == pytest.approx(est._linalg_seconds(SHAPES, 0.2, (8, 4), est._loss_cost, 1e5))
    assert host["statistics"] - dev["statistics"] == pytest.approx(est.decompositions_seconds(SHAPES, MEASURED) - whiten)
    assert host["gradients"] - dev["gradients"] == pytest.approx(
        est.loss_decompositions_seconds(SHAPES, MEASURED) - loss)
    assert est.device_decompositions(SHAPES, MEASURED) is None
    shown = est.render_table(est.predict(SHAPES, gradients, on))
    assert "timed and counted on the device" in shown and max(len(line) for line in shown.splitlines()) <= 120
    assert "on the device" not in est.render_table(est.predict(SHAPES, gradients, MEASURED))
    took = est.time_device_linalg(torch.device("cpu"), (24, 16))  # the timing itself, the CPU standing in
    assert all(t > 0 for t in took)


def test_the_estimate_times_the_decompositions_on_the_audits_device(cli_inproc, small, monkeypatch):
    """--estimate with --device naming an accelerator times tier 1's and the gradient pass's decompositions there
    and says so (here the CPU stands in for the device); one this machine lacks is counted on the host, said."""
    table = cli_inproc(f"{small}/m.py:net", "--calibration", f"{small}/cal.safetensors", "--estimate")
    assert table.returncode == 0 and "on the device" not in table.stdout, table.stderr
    monkeypatch.setattr(est, "_accelerator", lambda spec: torch.device("cpu"))
    res = cli_inproc(f"{small}/m.py:net", "--calibration", f"{small}/cal.safetensors", "--estimate", "--format",
                     "json")
    assert res.returncode == 0, res.stderr
    whiten, loss, flops = json.loads(res.stdout)["estimate"]["basis"]["measurements"]["device_linalg"]
    assert whiten > 0 and loss > 0 and flops > 0
    table = cli_inproc(f"{small}/m.py:net", "--calibration", f"{small}/cal.safetensors", "--estimate")
    assert "decompositions timed and counted on the device" in table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 120
    if not torch.cuda.is_available():
        monkeypatch.undo()
        assert est._accelerator("cuda") is None and est._accelerator("cpu") is None and est._accelerator(None) is None
