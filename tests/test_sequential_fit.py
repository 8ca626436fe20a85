"""The sequential, output-anchored fit (auditor/calibration/statistics/sequential.py) against direct least squares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from auditor.calibration.data.inputs import Batch
from auditor.calibration.statistics.sequential import (PULL_ROWS, RIDGE, fitted_map, fitted_truncator, pull,
                                                       sequential_truncators)
from auditor.calibration.statistics.stats import input_statistics
from auditor.calibration.statistics.whiten import DAMP, Truncator
from auditor.surgery import checked_plan


def _lam(xh: np.ndarray, damp: float) -> float:
    return damp * float(np.mean(np.sum(xh * xh, axis=0)))


def _ridge(x: np.ndarray, xh: np.ndarray, w: np.ndarray, damp: float) -> np.ndarray:
    """argmin_M ||X W^T - X^ M^T||^2 + lambda ||M - W||^2 by a least-squares solve of the stacked system."""
    s = np.sqrt(_lam(xh, damp))
    a = np.vstack([xh, s * np.eye(xh.shape[1])])
    y = np.vstack([x @ w.T, s * w.T])
    return np.linalg.lstsq(a, y, rcond=None)[0].T


def _truncated(xh: np.ndarray, wstar: np.ndarray, r: int, damp: float) -> np.ndarray:
    """The rank-r map closest to W* on the shifted inputs (damped as the whitening damps): reduced-rank regression
    of the stacked system's fitted values (their top-r right singular vectors)."""
    s = np.sqrt(_lam(xh, damp))
    a = np.vstack([xh, s * np.eye(xh.shape[1])])
    v = np.linalg.svd(a @ wstar.T, full_matrices=False)[2][:r].T
    return (wstar.T @ v @ v.T).T


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    x = g.standard_normal((60, 7)) @ g.standard_normal((7, 7))
    xh = x + 0.3 * g.standard_normal(x.shape)
    return x, xh, g.standard_normal((5, 7))


@pytest.mark.parametrize("ridge", [0.0, 1e-3, RIDGE])
def test_fitted_map_is_the_least_squares_solution(ridge: float) -> None:
    x, xh, w = _data()
    got, lam = fitted_map(w, x.T @ xh, xh.T @ xh, ridge)
    np.testing.assert_allclose(got, _ridge(x, xh, w, ridge), rtol=1e-9, atol=1e-11)
    assert lam == pytest.approx(_lam(xh, ridge))
    if ridge == 0.0:  # the plain least-squares solution
        np.testing.assert_allclose(got, np.linalg.lstsq(xh, x @ w.T, rcond=None)[0].T, rtol=1e-9, atol=1e-11)


def test_the_pull_shrinks_as_inputs_over_rows_past_two_rows_per_input() -> None:
    assert PULL_ROWS == 2
    assert pull(RIDGE, 512, 1_000) == RIDGE  # the digits MLP's second layer: under 2 rows per input, the whole pull
    assert pull(RIDGE, 784, 1_000) == RIDGE
    assert pull(RIDGE, 500, 1_000) == RIDGE  # exactly 2 rows per input
    assert pull(RIDGE, 192, 60_000) == pytest.approx(RIDGE * 2 * 192 / 60_000, rel=1e-15)  # 6.4e-5
    assert pull(RIDGE, 6, 0) == RIDGE  # nothing counted: the whole pull


def test_fitted_map_is_the_weight_when_the_inputs_do_not_move() -> None:
    x, _, w = _data(1)
    got, _ = fitted_map(w, x.T @ x, x.T @ x, 1e-3)
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("r", [1, 2, 4])
def test_rank_r_fit_is_reduced_rank_regression(r: int) -> None:
    x, xh, w = _data(2)
    lin = nn.Linear(7, 5, bias=False).double()
    layer = checked_plan(nn.Sequential(lin), {"0": r})["0"][0]
    trunc = fitted_truncator(layer, torch.from_numpy(w), (x.T @ xh)[None], (xh.T @ xh)[None], 1e-3, 1e-2)
    got = trunc.weight(r).numpy()
    np.testing.assert_allclose(trunc.f[0], _ridge(x, xh, w, 1e-2), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got, _truncated(xh, _ridge(x, xh, w, 1e-2), r, 1e-3), rtol=1e-8, atol=1e-10)
    a, b = trunc.factors(r)
    np.testing.assert_allclose(a[0] @ b[0], got, rtol=1e-9, atol=1e-11)


def test_second_factor_is_already_its_closed_form_refit() -> None:
    """With the first factor A fixed, the B that minimises the fit's objective (||X W^T - X^ B^T A^T||^2 + mu ||A B -
    W||^2, solved here as one least-squares problem in vec(B^T)) is the B the fit gives: refitting it changes nothing."""
    x, xh, w = _data(4)
    r, ridge = 3, 1e-2
    lin = nn.Linear(7, 5, bias=False).double()
    layer = checked_plan(nn.Sequential(lin), {"0": r})["0"][0]
    a, b = fitted_truncator(layer, torch.from_numpy(w), (x.T @ xh)[None], (xh.T @ xh)[None], DAMP, ridge).factors(r)
    a, b = a[0], b[0]
    mu = _lam(xh, ridge)
    n = xh.shape[1]
    design = np.vstack([np.kron(a, xh), np.sqrt(mu) * np.kron(a, np.eye(n))])  # vec(X^ B^T A^T), vec(B^T A^T)
    target = np.concatenate([(x @ w.T).T.ravel(), np.sqrt(mu) * w.ravel()])
    refit = np.linalg.lstsq(design, target, rcond=None)[0].reshape(r, n)  # vec(B^T) column by column: B's rows
    np.testing.assert_allclose(refit, b, rtol=1e-8, atol=1e-10)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Linear(6, 8).double()
        self.b = nn.Linear(6, 8).double()  # reads the same input as a: one stage with it
        self.c = nn.Linear(8, 5).double()
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)) + torch.relu(self.b(x)))


def _batches() -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [Batch((torch.randn(4, 10, 6, generator=g, dtype=torch.float64),), {}) for _ in range(3)]


def test_sequential_fit_against_a_direct_solution(monkeypatch) -> None:
    model, fit = _Net(), _batches()
    plan = checked_plan(model, {"a": 2, "b": 3, "c": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    maps = {}  # each layer's W*, read from its truncator before the fit keeps only its rank's factors
    real = Truncator.pinned
    monkeypatch.setattr(Truncator, "pinned", lambda self, r: maps.setdefault(self.layer.name, self.f) is None or
                        real(self, r))
    got = sequential_truncators(model, plan, fit)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the weights are back
    stats = input_statistics(model, [l for l, _ in plan.values()], fit)
    for name in ("a", "b"):  # the first stage reads the dense inputs: the independent fit, to rounding
        ind = Truncator(plan[name][0], getattr(model, name).weight, stats.layers[name])
        np.testing.assert_allclose(got[name].weight(plan[name][1]).numpy(), ind.weight(plan[name][1]).numpy(),
                                   rtol=1e-9, atol=1e-11)
    xs = torch.cat([b.args[0] for b in fit]).reshape(-1, 6)
    with torch.no_grad():
        x = (torch.tanh(model.a(xs)) + torch.relu(model.b(xs))).numpy()
        wa, wb = got["a"].weight(2), got["b"].weight(3)
        xh = (torch.tanh(xs @ wa.T + model.a.bias) + torch.relu(xs @ wb.T + model.b.bias)).numpy()
    w = model.c.weight.detach().numpy()
    assert xh.shape == (120, 8)  # 15 rows per input: the pull is RIDGE * 2 * 8 / 120
    wstar = _ridge(x, xh, w, RIDGE * 2 * 8 / 120)
    np.testing.assert_allclose(maps["c"][0], wstar, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(got["c"].weight(2).numpy(), _truncated(xh, wstar, 2, DAMP), rtol=1e-7, atol=1e-9)


def test_refit_dense_layers_against_a_direct_solution() -> None:
    """refit: a dense layer reading moved inputs is W* itself (not truncated), pulled as the fitted layers are; one
    reading the dense inputs is left alone; the planned layers' truncators are the plain sequential fit's."""
    from auditor.calibration.statistics.sequential import sequential_fit

    model, fit = _Net(), _batches()
    plan = checked_plan(model, {"a": 2})
    dense = {name: layer for name, (layer, _) in checked_plan(model, {"b": 3, "c": 2}).items()}
    done = sequential_fit(model, plan, fit, refit=dense)
    assert set(done.refitted) == {"c"}  # b reads the model's input, which nothing factorized moves
    np.testing.assert_array_equal(done.truncators["a"].weight(2).numpy(),
                                  sequential_truncators(model, plan, fit)["a"].weight(2).numpy())
    xs = torch.cat([b.args[0] for b in fit]).reshape(-1, 6)
    with torch.no_grad():
        x = (torch.tanh(model.a(xs)) + torch.relu(model.b(xs))).numpy()
        xh = (torch.tanh(xs @ done.truncators["a"].weight(2).T + model.a.bias) + torch.relu(model.b(xs))).numpy()
    w = model.c.weight.detach().numpy()
    wstar = _ridge(x, xh, w, RIDGE * 2 * 8 / 120)
    np.testing.assert_allclose(done.refitted["c"].numpy(), wstar, rtol=1e-8, atol=1e-10)
    assert np.linalg.norm(x @ w.T - xh @ wstar.T) < 0.9 * np.linalg.norm(x @ w.T - xh @ w.T)


def test_sequential_fit_keeps_outputs_closer_than_the_independent_one() -> None:
    model, fit = _Net(), _batches()
    plan = checked_plan(model, {"a": 2, "b": 2, "c": 2})
    seq = sequential_truncators(model, plan, fit)
    stats = input_statistics(model, [l for l, _ in plan.values()], fit)
    ind = {n: Truncator(l, getattr(model, n).weight, stats.layers[n]) for n, (l, _) in plan.items()}
    xs = torch.cat([b.args[0] for b in fit])
    with torch.no_grad():
        y = model(xs)

        def err(t: dict[str, Truncator]) -> float:
            wa, wb, wc = (t[n].weight(plan[n][1]) for n in "abc")
            h = torch.tanh(xs @ wa.T + model.a.bias) + torch.relu(xs @ wb.T + model.b.bias)
            return float(torch.linalg.norm(h @ wc.T + model.c.bias - y) / torch.linalg.norm(y))

        assert err(seq) < err(ind)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(6, 6).double()
        self.k = nn.Linear(6, 6).double()
        self.up = nn.Linear(6, 12).double()
        self.down = nn.Linear(12, 6).double()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.q(x)) * self.k(x) * scale
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(6, 6).double()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(6, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        scale = torch.ones(1, dtype=x.dtype)
        for blk in self.blocks:
            x = blk(x, scale)
        return self.head(x)


def test_block_by_block_is_the_whole_model_fit(monkeypatch) -> None:
    """The stages of repeated blocks run one block per pass (inputs to the next block carried, dense and fitted); the
    closed-form factors are those of whole-model passes, to rounding, and the stages are the call order's (q and k
    together). The block refinement, which only block by block runs, is off here (refine=0)."""
    from auditor.calibration.statistics import sequential as seq

    model = _Stack()
    fit = _batches()
    plan = checked_plan(model, {n: 3 for n in ("inp", "blocks.0.q", "blocks.0.k", "blocks.0.down", "blocks.1.up",
                                               "blocks.2.q", "blocks.2.down", "head")})
    seen: list[int] = []
    runs: list[int] = []
    real = seq._block_runs
    monkeypatch.setattr(seq, "_block_runs", lambda *a: runs.append(1) or real(*a))
    heads: list[int] = []
    hook = model.head.register_forward_hook(lambda *a: heads.append(1))
    block = seq.sequential_truncators(model, plan, fit, progress=lambda i, n: seen.append(n), refine=0)
    hook.remove()
    assert seen[-1] == 7 and len(runs) == 5  # q and k of block 0 read one input: one stage; inp and head outside
    # the head runs for the call order, the blocks' check and the tail's check (batch 0 through the model after the
    # blocks and through the whole model); its own stage's runs (3 batches, twice) stop as it is reached, its rows
    # read, and inp's stage stops each run before inp runs
    assert len(heads) == 1 + 1 + 2
    runs.clear()
    monkeypatch.setattr(seq, "find_blocks", lambda *a: None)
    whole = seq.sequential_truncators(model, plan, fit, refine=0)
    assert runs == []
    for name, (_, r) in plan.items():
        np.testing.assert_allclose(block[name].weight(r).numpy(), whole[name].weight(r).numpy(), rtol=1e-9,
                                   atol=1e-11)


def test_grouped_convolutions_are_fitted_per_group(monkeypatch) -> None:
    """A grouped convolution's rows are its unfolded patches per group (the kinds' own hooks): the first layer's fit
    is the independent one, the second's W* is W per group where nothing before it changed (rank = full)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=2), nn.ReLU(), nn.Conv2d(8, 6, 3, groups=2)).double()
    fit = [Batch((torch.randn(3, 4, 7, 7, dtype=torch.float64),), {}) for _ in range(2)]
    plan = checked_plan(model, {"0": 3, "2": 2})
    maps: dict = {}  # each layer's W*, read from its truncator before the fit keeps only its rank's factors
    real = Truncator.pinned
    monkeypatch.setattr(Truncator, "pinned", lambda self, r: maps.setdefault(self.layer.name, []).append(self.f)
                        or real(self, r))
    got = sequential_truncators(model, plan, fit)
    got = {n: (t, maps[n][-1]) for n, t in got.items()}
    stats = input_statistics(model, [l for l, _ in plan.values()], fit)
    ind = Truncator(plan["0"][0], model[0].weight, stats.layers["0"])
    assert got["0"][1].shape == (2, 4, 18) and got["2"][1].shape == (2, 3, 36)
    np.testing.assert_allclose(got["0"][0].weight(3).numpy(), ind.weight(3).numpy(), rtol=1e-9, atol=1e-11)
    sequential_truncators(model, checked_plan(model, {"0": 4, "2": 2}), fit)  # rank 4 = full for layer 0
    full = maps["2"][-1]
    np.testing.assert_allclose(full, Truncator(plan["2"][0], model[2].weight, None).f, rtol=1e-8, atol=1e-9)
    assert not np.allclose(got["2"][1], full, atol=1e-3)


def test_the_command_lines_fits_are_the_librarys() -> None:
    """--fit's choices are written out in the command (its --help imports no torch): the same words as apply.Fit."""
    from auditor.calibration.apply import ALL_FITS, METHODS, Fit
    from auditor.errors import AuditError

    from auditor.cli import factorize_command

    # the sequential fit's variants are its flags (--refit-dense, --no-refine)
    assert set(factorize_command.FITS) == set(METHODS) == \
        {f.label for f in ALL_FITS if not f.sequential} | {"sequential"}
    assert {Fit.of_sequential(refit, refine) for refit in (False, True) for refine in (False, True)} == \
        {f for f in ALL_FITS if f.sequential}
    assert Fit.of_sequential() == Fit.SEQUENTIAL and Fit.of_sequential(True) == Fit.SEQUENTIAL_REFIT
    assert [f.refines for f in ALL_FITS] == [False, True, False, True, False, False]
    assert [f.label for f in ALL_FITS] == ["independent", "sequential", "loss-aware", "sequential, refit dense",
                                           "sequential, closed form", "sequential, refit dense, closed form"]
    assert all(Fit.parse(f.label) == f for f in ALL_FITS)  # every label users wrote still reads
    assert Fit.parse("sequential, refit dense, closed form") == Fit("sequential", refit_dense=True, refine=False)
    with pytest.raises(AuditError, match=r"^refit_dense=True refits the dense layers in the sequential fit, which "
                                         r"needs a calibration and fit='sequential' \(got fit='loss-aware'\)"):
        Fit("loss-aware", refit_dense=True)
    with pytest.raises(AuditError, match=r"^refine=False turns off the sequential fit's block refinement"):
        Fit("independent", refine=False)
    with pytest.raises(AuditError, match="fit 'greedy' is not a way to fit the factors"):
        Fit("greedy")  # type: ignore[arg-type]
    from auditor.calibration.apply import DEFAULT_FIT

    assert DEFAULT_FIT.method in factorize_command.FITS and not hasattr(factorize_command, "DEFAULT_FIT")  # one constant


def test_the_library_default_writes_what_the_command_writes(cli_inproc, tmp_path) -> None:
    """One fit: ``auditor.factorize(model, plan, calibration=...)`` with default flags fits as ``lowrank-audit
    factorize`` does by default (apply.DEFAULT_FIT, the sequential fit with block refinement) on the char
    transformer, and says so; input statistics alone (no rows to fit on) fall back to the independent fit, named."""
    import json

    from safetensors.torch import load_file

    import auditor
    from auditor.calibration import input_statistics, load_calibration
    from auditor.calibration.apply import DEFAULT_FIT, Fit, default_fit
    from chargpt import chargpt

    calib, held = "sample_models/chargpt_calib.safetensors", "sample_models/chargpt_holdout.safetensors"
    plan = tmp_path / "plan.toml"
    plan.write_text('[ranks]\n"blocks.*.fc" = 48\n"blocks.*.out" = 48\n"blocks.*.q" = 32\n"blocks.*.k" = 32\n',
                    encoding="utf-8")
    r = cli_inproc("factorize", "sample_models/chargpt.py:chargpt", "--plan", plan, "--calibration", calib,
                   "--holdout", held, "--no-cache", "--allow-miss", "-o", tmp_path / "fact")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "fact" / "plan.json").read_text())
    assert meta["fit"] == DEFAULT_FIT.method == "sequential" and meta["block_refinement"] is True
    model = chargpt()[0]
    new = auditor.factorize(model, meta["plan"], calibration=load_calibration(calib, model, holdout=held))
    assert new.lowrank_fit == DEFAULT_FIT.label == "sequential"
    written, got = load_file(str(tmp_path / "fact" / "model.safetensors")), new.state_dict()
    assert sorted(written) == sorted(got)
    assert all(torch.allclose(written[k], got[k], rtol=1e-4, atol=1e-6) for k in written)
    stats = input_statistics(model, [l for l, _ in checked_plan(model, {"blocks.0.fc": 48}).values()],
                             load_calibration(calib, model, holdout=held))
    assert default_fit(stats) == Fit.INDEPENDENT and default_fit(None) == Fit.INDEPENDENT
    assert auditor.factorize(model, {"blocks.0.fc": 48}, calibration=stats).lowrank_fit == "independent"
    assert auditor.factorize(model, {"blocks.0.fc": 48}).lowrank_fit == "svd"


def test_a_pinned_truncation_is_the_truncators_at_its_rank_bit_for_bit() -> None:
    """Truncator.pinned(r) keeps only rank r's factors: factors(r) and weight(r) are the truncator's own numbers,
    whitened, grouped and loss-aware (both of its forms); another rank is refused; spilled, the same again."""
    import tempfile

    from auditor.calibration.statistics.whiten import Pinned

    torch.manual_seed(3)
    model, conv = nn.Sequential(nn.Linear(12, 9)).double(), nn.Sequential(nn.Conv2d(4, 6, 3, groups=2)).double()
    fit = [Batch((torch.randn(40, 12, dtype=torch.float64),), {})]
    plan = checked_plan(model, {"0": 4})
    stats = input_statistics(model, [plan["0"][0]], fit)
    layer, w = plan["0"][0], model[0].weight
    g = np.random.default_rng(0)
    f = np.asarray(w.detach().numpy())[None]
    truncs = [Truncator(layer, w, stats.layers["0"]), Truncator(layer, w, None),
              Truncator.from_bases(layer, w, f, {"u": [np.linalg.qr(g.standard_normal((9, 9)))[0]],
                                                 "w": [g.standard_normal((9, 9))]}),
              Truncator.from_bases(layer, w, f, {"z": [g.standard_normal((12, 9))], "y": [g.standard_normal((12, 9))]}),
              Truncator(checked_plan(conv, {"0": 2})["0"][0], conv[0].weight, None)]
    with tempfile.TemporaryDirectory() as d:
        for i, t in enumerate(truncs):
            r = 2 if i == 4 else 4
            for p in (t.pinned(r), t.pinned(r).spilled(f"{d}/{i}")):
                assert isinstance(p, Pinned) and p.nbytes < sum(a.nbytes for v in t.parts().values() for a in v) + t.f.nbytes
                for x, y in zip(p.factors(r), t.factors(r)):
                    assert np.array_equal(x, y)
                assert torch.equal(p.weight(r), t.weight(r))
            with pytest.raises(ValueError, match="fitted at rank"):
                t.pinned(r).factors(r - 1)


def test_finished_blocks_are_spilled_and_read_back_the_same(monkeypatch) -> None:
    """Block by block, a finished block's factors (and fitted weights) leave the heap for memory-mapped files: the
    fit's result is the same bit for bit as with everything kept in memory."""
    transformers = pytest.importorskip("transformers")
    from auditor.calibration import load_calibration
    from auditor.calibration.statistics import sequential as seq
    from auditor.structure.layers import ParamTable, collect_layers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    cal = load_calibration({"input_ids": torch.randint(0, 64, (48, 12), generator=torch.Generator().manual_seed(1))},
                           model, holdout=0.25, batch_size=4)
    names = [n for n in collect_layers(model, ParamTable.of(model)) if ".layers." in n]
    plan = checked_plan(model, {n: 4 for n in names})
    names = list(plan)
    assert len(names) == 21
    spilled = seq.sequential_fit(model, plan, cal, refine=2)
    mapped = [n for n, t in spilled.truncators.items()
              if all(isinstance(a.base if a.base is not None else a, np.memmap) or isinstance(a, np.memmap)
                     for a in (t.pairs[0] if hasattr(t, "pairs") else (t.a, t.b)))]
    assert sorted(mapped) == sorted(names) and spilled.scratch is not None  # every block finished, every layer out
    monkeypatch.setattr(seq._Fitter, "spill", lambda self, layers: None)
    kept = seq.sequential_fit(model, plan, cal, refine=2)
    assert kept.refined == spilled.refined and len(kept.refined) > 0
    for n in names:
        for x, y in zip(spilled.truncators[n].factors(4), kept.truncators[n].factors(4)):
            assert np.array_equal(x, y)


def _count_block_calls(monkeypatch) -> list[int]:
    """Every _Block forward counted in the list's one entry (the test may reset it)."""
    calls = [0]
    real = _Block.forward

    def counted(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(_Block, "forward", counted)
    return calls


def test_a_stage_after_the_blocks_runs_the_model_after_them_alone(monkeypatch) -> None:
    """The head's stage reads the last block's outputs (dense and fitted) with every block passing them on, not the
    blocks run again: 3 batches x 2 runs x 3 blocks fewer block forwards but the 3 of the check that the tail is the
    model (batch 0's output through it equal to the whole model's), the same factors bit for bit."""
    from auditor.calibration.statistics import sequential as seq

    model = _Stack()
    fit = _batches()
    plan = checked_plan(model, {n: 3 for n in ("blocks.0.q", "blocks.1.up", "blocks.2.down", "head")})
    calls = _count_block_calls(monkeypatch)
    tail = seq.sequential_truncators(model, plan, fit, refine=0)
    with_tail, calls[0] = calls[0], 0
    monkeypatch.setattr(seq, "_tail_runs", lambda *a: None)
    whole = seq.sequential_truncators(model, plan, fit, refine=0)
    assert calls[0] - with_tail == 3 * 2 * 3 - 3  # less the tail's check: batch 0 through the whole model once
    for name, (_, r) in plan.items():
        np.testing.assert_array_equal(tail[name].weight(r).numpy(), whole[name].weight(r).numpy())


def test_each_block_runs_dense_once_for_all_its_stages(monkeypatch) -> None:
    """A block's stages read their dense rows from one dense run of the block per batch (which also gives the
    block's dense output), not a dense run per stage (q and k together; up; down) and one more for the output
    (every block's but the last's, whose output nothing reads with refine=0): the same factors bit for bit."""
    from auditor.calibration.statistics import sequential as seq

    model = _Stack()
    fit = _batches()
    plan = checked_plan(model, {n: 3 for b in range(3) for n in (f"blocks.{b}.q", f"blocks.{b}.k",
                                                                 f"blocks.{b}.up", f"blocks.{b}.down")})
    calls = _count_block_calls(monkeypatch)
    once = seq.sequential_truncators(model, plan, fit, refine=0)
    with_once, calls[0] = calls[0], 0
    monkeypatch.setattr(seq, "_dense_rows", lambda *a: None)
    per_stage = seq.sequential_truncators(model, plan, fit, refine=0)
    # before: 3 dense stage runs a batch and the dense output run (but in the last block, which needs no output);
    # now one dense run a batch
    assert calls[0] - with_once == 3 * (3 + 1 - 1) * 2 + 3 * (3 - 1)
    for name, (_, r) in plan.items():
        for x, y in zip(once[name].factors(r), per_stage[name].factors(r)):
            np.testing.assert_array_equal(x, y)


def test_a_stage_run_stops_as_its_last_layer_is_reached(monkeypatch) -> None:
    """Each stage's fitted runs end as the stage's last layer is about to run, its rows read (q and k's stage before
    k, up's before up, down's before down), and q computes zeros of its shape meanwhile: no row of the stage reads
    it. The factors are those of runs through the whole block, bit for bit."""
    from auditor.calibration.statistics import sequential as seq

    model = _Stack()
    fit = _batches()
    plan = checked_plan(model, {n: 3 for b in range(3) for n in (f"blocks.{b}.q", f"blocks.{b}.k",
                                                                 f"blocks.{b}.up", f"blocks.{b}.down")})
    outs: list[tuple[str, bool]] = []
    hooks = [getattr(blk, n).register_forward_hook(lambda m, a, o, n=n: outs.append((n, bool((o == 0).all()))))
             for blk in model.blocks for n in ("q", "k", "up", "down")]
    stopped = seq.sequential_truncators(model, plan, fit, refine=0)
    ran_stopped, outs[:] = list(outs), []
    real = seq._call_order
    monkeypatch.setattr(seq, "_call_order", lambda *a: (real(*a)[0], False))  # the runs never stop
    whole = seq.sequential_truncators(model, plan, fit, refine=0)
    for h in hooks:
        h.remove()
    for name, (_, r) in plan.items():
        for x, y in zip(stopped[name].factors(r), whole[name].factors(r)):
            np.testing.assert_array_equal(x, y)
    assert [n for n, zero in outs if zero] == []
    assert [n for n, zero in ran_stopped if zero] == ["q"] * 3 * 3  # q and k's stage: 3 blocks x 3 batches
    calls = lambda ran, name: sum(n == name for n, _ in ran)  # noqa: E731
    # down ran to the end of every stage's runs (3 stages x 3 batches x 3 blocks); now in none; k in up's and
    # down's, not its own; up in down's alone
    assert calls(outs, "down") - calls(ran_stopped, "down") == 27
    assert calls(outs, "k") - calls(ran_stopped, "k") == 9
    assert calls(outs, "up") - calls(ran_stopped, "up") == 18


class _Positioned(_Block):
    """A block that adds a position table's rows (an embedding fed lookup counts, inside the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 6).double()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.pos(torch.arange(x.shape[-2])), scale)


def test_a_block_with_a_lookup_table_runs_dense_per_stage(monkeypatch) -> None:
    """A planned embedding inside a block is fed lookup counts, which both runs of a stage count: the block's stages
    then run dense each (no dense rows read at once), the factors those of that path bit for bit."""
    from auditor.calibration.statistics import sequential as seq

    model = _Stack()
    torch.manual_seed(4)
    model.blocks = nn.ModuleList(_Positioned() for _ in range(3))
    fit = _batches()
    plan = checked_plan(model, {n: 3 for b in range(3) for n in (f"blocks.{b}.pos", f"blocks.{b}.q",
                                                                 f"blocks.{b}.down")})
    real, got = seq._dense_rows, []
    monkeypatch.setattr(seq, "_dense_rows", lambda *a: got.append(real(*a)) or got[-1])
    mixed = seq.sequential_truncators(model, plan, fit, refine=0)
    assert got == [None, None, None]
    monkeypatch.setattr(seq, "_dense_rows", lambda *a: None)
    per_stage = seq.sequential_truncators(model, plan, fit, refine=0)
    for name, (_, r) in plan.items():
        for x, y in zip(mixed[name].factors(r), per_stage[name].factors(r)):
            np.testing.assert_array_equal(x, y)


def test_padded_bf16_rows_give_the_same_factors_read_once_or_per_stage(monkeypatch) -> None:
    """A bfloat16 Llama on padded rows (attention_mask zeros at the ends, left out of every sum): the dense rows read
    once a block, in bfloat16, give the factors the per-stage dense runs give, bit for bit, refinement included."""
    transformers = pytest.importorskip("transformers")
    from auditor.calibration import load_calibration
    from auditor.calibration.statistics import sequential as seq
    from auditor.structure.layers import ParamTable, collect_layers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::3, 8:] = 0  # every third row padded after 8 positions
    cal = load_calibration({"input_ids": ids, "attention_mask": mask}, model, holdout=0.25, batch_size=4)
    names = [n for n in collect_layers(model, ParamTable.of(model)) if ".layers." in n]
    plan = checked_plan(model, {n: 4 for n in names})
    once = seq.sequential_fit(model, plan, cal, refine=2)
    monkeypatch.setattr(seq, "_dense_rows", lambda *a: None)
    per_stage = seq.sequential_fit(model, plan, cal, refine=2)
    assert once.refined == per_stage.refined
    for n in plan:
        for x, y in zip(once.truncators[n].factors(4), per_stage.truncators[n].factors(4)):
            assert np.array_equal(x, y)


class _Mean(_Stack):
    """The head reads the mean of every block's output, not the last block's alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        scale = torch.ones(1, dtype=x.dtype)
        outs = []
        for blk in self.blocks:
            x = blk(x, scale)
            outs.append(x)
        return self.head(sum(outs) / len(outs))


class _Gated(nn.Module):
    """Each block returns (hidden, a gate of it); the head reads the last block's hidden state times its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Block()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inner(x, scale)
        return h, torch.sigmoid(h.mean(-1, keepdim=True))


class _GatedStack(_Stack):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.blocks = nn.ModuleList(_Gated() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        scale = torch.ones(1, dtype=x.dtype)
        for blk in self.blocks:
            x, g = blk(x, scale)
        return self.head(x * g)


@pytest.mark.parametrize("make", [_Mean, _GatedStack])
def test_a_head_that_reads_more_than_the_last_hidden_state_runs_the_whole_model(make, monkeypatch) -> None:
    """Where the model after the blocks reads more than the last block's hidden state (every block's output, or
    what a block returns beside it), the tail is not the model: the head's stage runs the whole model and its factors
    are the whole model's, bit for bit (the tail had fitted them on other inputs, exit 0)."""
    from auditor.calibration.statistics import sequential as seq

    model = make()
    prefix = "blocks.{}.inner." if make is _GatedStack else "blocks.{}."
    plan = checked_plan(model, {**{prefix.format(i) + "up": 3 for i in range(3)}, "head": 3})
    got = seq.sequential_truncators(model, plan, _batches(), refine=0)
    monkeypatch.setattr(seq, "_tail_runs", lambda *a: None)
    whole = seq.sequential_truncators(model, plan, _batches(), refine=0)
    for name, (_, r) in plan.items():
        np.testing.assert_array_equal(got[name].weight(r).numpy(), whole[name].weight(r).numpy())


def test_layers_reading_one_input_share_one_sum_added_in_place() -> None:
    from auditor.calibration.statistics.sequential import _Sums

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(20, 1, 6, generator=g, dtype=torch.float64),
                torch.randn(20, 1, 6, generator=g, dtype=torch.float64)) for _ in range(3)]
    want_c = sum((x[:, 0].T @ xh[:, 0]).numpy() for x, xh in batches)
    want_g = sum((xh[:, 0].T @ xh[:, 0]).numpy() for _, xh in batches)
    sums = _Sums()
    for x, xh in batches:  # q, k and v read one pair of tensors each batch
        sums.add({"q": (x, xh), "k": (x, xh), "v": (x, xh)})
    assert sums.cross["q"] is sums.cross["k"] is sums.cross["v"]  # one C and one G between them
    assert sums.gram["q"] is sums.gram["v"] and sums.gram["q"] is not sums.cross["q"]
    np.testing.assert_array_equal(sums.cross["k"][0], want_c)  # added once a batch, the same sums bit for bit
    np.testing.assert_array_equal(sums.gram["k"][0], want_g)
    assert sums.rows == {"q": 60, "k": 60, "v": 60}
    # a layer that stops sharing its input gets a sum of its own; the others keep theirs
    split = _Sums()
    (x0, xh0), (x1, xh1) = batches[:2]
    split.add({"q": (x0, xh0), "k": (x0, xh0)})
    split.add({"q": (x1, xh1), "k": (x1, xh0)})
    np.testing.assert_array_equal(split.cross["q"][0], (x0[:, 0].T @ xh0[:, 0] + x1[:, 0].T @ xh1[:, 0]).numpy())
    np.testing.assert_array_equal(split.cross["k"][0], (x0[:, 0].T @ xh0[:, 0] + x1[:, 0].T @ xh0[:, 0]).numpy())
    np.testing.assert_array_equal(split.gram["k"][0], (xh0[:, 0].T @ xh0[:, 0] * 2).numpy())
    same = _Sums()  # the dense and the fitted rows one tensor: C and G still two sums
    for x, _ in batches:
        same.add({"w": (x, x)})
    assert same.cross["w"] is not same.gram["w"]
    np.testing.assert_array_equal(same.cross["w"], same.gram["w"])


def test_the_ridged_solve_is_a_cholesky_solve_in_place_and_lu_where_not_positive_definite() -> None:
    from auditor.calibration.statistics.sequential import ridge_solve

    x, xh, w = _data(5)
    g, lam = xh.T @ xh, 0.3
    rhs = np.asfortranarray(w.T.copy())
    want = np.linalg.solve((g + g.T) / 2 + lam * np.eye(7), w.T)
    before = g.copy()
    np.testing.assert_allclose(ridge_solve(g, lam, rhs), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(g, before)  # the Gram itself is read, never written
    indefinite = -g  # G + lambda I not positive definite: solved by LU, as before
    np.testing.assert_allclose(ridge_solve(indefinite, lam, np.asfortranarray(w.T.copy())),
                               np.linalg.solve(-g + lam * np.eye(7), w.T), rtol=1e-9, atol=1e-11)


def test_a_tall_layers_moment_is_carried_through_the_solved_map() -> None:
    from auditor.calibration.statistics.sequential import weighted_truncator
    from auditor.calibration.statistics.whiten import weighted_bases
    from auditor.results import Kind, Layer

    g = np.random.default_rng(7)
    x = g.standard_normal((80, 4)) @ g.standard_normal((4, 4))
    xh = x + 0.2 * g.standard_normal(x.shape)
    f = g.standard_normal((9, 4))  # out > in: the moment is carried to input space, H = F^T G F
    layer = Layer("fc", "fc.weight", Kind.LINEAR, "Linear", (9, 4), 9, 4)
    cross, gram = (x.T @ xh)[None], (xh.T @ xh)[None]
    h = f.T @ np.diag(g.random(9) + 0.5) @ f
    got = weighted_truncator(layer, torch.from_numpy(f), cross, gram, (h, True, 500))
    fstar, lam = fitted_map(f, cross[0], gram[0], RIDGE)
    t = np.linalg.solve((gram[0] + gram[0].T) / 2 + lam * np.eye(4), cross[0].T + lam * np.eye(4)).T
    _, bases = weighted_bases(fstar, gram[0], False, t.T @ h @ t, True, DAMP, 500)
    for r in (1, 2, 3):
        np.testing.assert_allclose(got.weight(r).numpy(), (fstar @ bases["z"][0][:, :r] @ bases["y"][0][:, :r].T),
                                   rtol=1e-8, atol=1e-10)
