"""The loss-aware truncation (tiers/fisher.py ``loss_aware``): the rank-r map minimising the KFAC cost
trace(G (F - F_r) S (F - F_r)^T), checked against its closed form and against brute force, in both of its forms
(out <= in: G on the output side; out > in: H = F^T G F on the input side), kept and spilled by the store, and used by
``factorize(fit="loss-aware")``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from auditor.calibration.statistics.whiten import DAMP, GRADIENT_DAMP, TruncatorStore
from auditor.calibration.tiers.fisher import OutputGradients, loss_aware

from test_sensitivity import _setup


SAMPLES = 400  # position-samples the moment is a mean over: it is shrunk by out / SAMPLES more


def _spd(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n)) * np.logspace(0, -2, n)[None, :]
    return a @ a.T


def _case(name: str, seed: int = 3):
    """(layer, weight, its statistics, F, a random output-gradient moment G, the OutputGradients holding it)."""
    model, _, layers, stats = _setup()
    layer = layers[name]
    w = dict(model.named_parameters())[layer.param]
    f = (w.detach().double().T if name == "emb" else w.detach().double()).numpy()
    out, width = f.shape
    g = _spd(out, seed)
    carried = out > width
    second = f.T @ g @ f if carried else g
    grads = OutputGradients({name: second * SAMPLES}, {name: SAMPLES}, {name: carried}, 0.5, True, 0, 0.0)
    return layer, w, stats.layers[name], f, g, grads


def _damped(f: np.ndarray, g: np.ndarray, inp, carried: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two damped metrics the truncation is exact in: G + delta I (delta from mean diag G, or for a tall map
    the same share of trace(F^T G F) / trace(F^T F) times F^T F, which is what G + delta I gives there) and S."""
    gram = np.diag(inp.gram) if inp.diagonal else inp.gram[0]
    s = gram + DAMP * np.mean(np.diagonal(gram)) * np.eye(len(gram))
    shrink = GRADIENT_DAMP + f.shape[0] / SAMPLES
    if carried:
        delta = shrink * np.trace(f.T @ g @ f) / np.trace(f.T @ f)
    else:
        delta = shrink * np.trace(g) / len(g)
    return g + delta * np.eye(len(g)), s


@pytest.mark.parametrize("name", ["wide", "tall", "emb"])
def test_loss_aware_truncation_is_the_closed_form_optimum_and_its_cost_the_dropped_energy(name):
    layer, w, inp, f, g, grads = _case(name)
    out, width = f.shape
    cost, trunc = loss_aware(layer, w, inp, grads)
    gd, s = _damped(f, g, inp, out > width)
    lg, lx = np.linalg.cholesky(gd), np.linalg.cholesky(s)
    m = lg.T @ f @ lx
    sig = np.linalg.svd(m, compute_uv=False)
    k = min(out, width)
    assert len(cost) == k + 1
    for r in range(1, k + 1):
        a, b = trunc.factors(r)
        fr = a[0] @ b[0]
        u, sv, vt = np.linalg.svd(m)
        best = np.linalg.solve(lg.T, (u[:, :r] * sv[:r]) @ vt[:r]) @ np.linalg.inv(lx)
        assert np.allclose(fr, best, rtol=1e-7, atol=1e-9 * np.abs(f).max()), r
        # its cost: the dropped squared singular values of L^T F S^(1/2), scaled; the weighted error itself
        err = lg.T @ (f - fr) @ lx
        assert cost[r] == pytest.approx(0.5 * float(np.sum(sig[r:] ** 2)), rel=1e-8, abs=1e-10), r
        assert cost[r] == pytest.approx(0.5 * float(np.sum(err ** 2)), rel=1e-6, abs=1e-9), r
    assert np.allclose(trunc.factors(k)[0][0] @ trunc.factors(k)[1][0], f, atol=1e-9 * np.abs(f).max())


@pytest.mark.parametrize("name", ["wide", "tall"])
def test_no_other_rank_r_map_has_a_lower_weighted_error(name):
    """Brute force: the truncation's weighted error is below the input-whitened truncation's and below 200 random
    rank-r perturbations of it."""
    from auditor.calibration.statistics.whiten import Truncator

    layer, w, inp, f, g, grads = _case(name, seed=7)
    gd, s = _damped(f, g, inp, f.shape[0] > f.shape[1])

    def weighted(fr: np.ndarray) -> float:
        d = f - fr
        return float(np.trace(gd @ d @ s @ d.T))

    r = 3
    a, b = loss_aware(layer, w, inp, grads)[1].factors(r)
    best = weighted(a[0] @ b[0])
    plain = Truncator(layer, w, inp).factors(r)
    assert best < weighted(plain[0][0] @ plain[1][0])
    rng = np.random.default_rng(0)
    for _ in range(200):
        pa = a[0] + 1e-3 * rng.standard_normal(a[0].shape)
        pb = b[0] + 1e-3 * rng.standard_normal(b[0].shape)
        assert weighted(pa @ pb) >= best


def test_the_store_spills_and_reads_back_a_loss_aware_truncator_bit_for_bit():
    for name in ("wide", "tall"):
        layer, w, inp, f, g, grads = _case(name)
        trunc = loss_aware(layer, w, inp, grads)[1]
        store = TruncatorStore(budget=0)  # nothing fits in memory: every truncator goes to disk
        store[name] = trunc
        assert store.spilled == 1 and store.holds(name) and name not in dict(store)
        back, cut = store.get(name), trunc.cut()  # kept as its factors at full rank, oblique: both balanced
        assert back is not None and back.oblique and back.full is not None and not back.parts()
        for r in (1, 2, 5):
            for x, y, z in zip(back.factors(r), cut.factors(r), trunc.factors(r)):
                assert np.array_equal(x, y) and np.allclose(x, z, rtol=1e-12, atol=1e-15)
            assert torch.equal(back.weight(r), cut.weight(r))
        store.close()


def test_a_layer_no_gradient_reached_has_no_loss_aware_truncation():
    layer, w, inp, f, g, grads = _case("wide")
    grads.second["wide"] = np.zeros_like(grads.second["wide"])
    assert loss_aware(layer, w, inp, grads) is None


def test_factorize_loss_aware_beats_the_whitened_fit_on_the_metric_it_weighs():
    """The char-level toy of test_sensitivity (embedding, wide, tall): at the same ranks the loss-aware fit's
    relative output error (the metric its gradient weighs here) on the fit rows is below the independent fit's."""
    import auditor
    from auditor.calibration import Evaluator, Metric

    model, cal, layers, stats = _setup(rows=256)
    plan = {"wide": 3, "tall": 3}
    ev = Evaluator(model, cal, Metric())
    la = ev.measure(auditor.factorize(model, plan, calibration=cal, fit="loss-aware")).value
    ind = ev.measure(auditor.factorize(model, plan, calibration=cal, fit="independent")).value
    assert 0 < la < ind


def test_a_moment_that_overflowed_falls_back_to_the_whitened_truncation():
    layer, w, inp, f, g, grads = _case("tall")
    grads.second["tall"] = np.full_like(grads.second["tall"], np.nan)
    assert loss_aware(layer, w, inp, grads) is None
