"""recover(): a short distillation on the fit rows that lowers the held-out loss, deterministic, touching only what
it trains and never the held-out rows; bad settings are one line (exit 2 on the command line)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from auditor.calibration import load_calibration
from auditor.errors import AuditError
from auditor.factorize import factorize
from auditor.calibration.recovery import factor_modules, recover
from auditor.cli.recovery_flags import cli_recover

PLAN = {"fc1": 8, "fc2": 8, "fc3": 8}


def _x(lo: int, hi: int) -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().data[lo:hi], dtype=torch.float32) / 16.0


@pytest.fixture(scope="module")
def setup():
    from digits import mlp

    model = mlp()[0]
    cal = load_calibration({"x": _x(0, 800)}, model, holdout=0.25, batch_size=32)  # 600 fit rows, 200 held out
    return model, cal


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_recovery_lowers_the_heldout_loss_and_is_deterministic(setup):
    model, cal = setup
    runs = []
    for seed in (0, 0, 1):
        new = factorize(model, PLAN)  # plain SVD init: room to recover
        r = recover(new, model, cal, steps=20, lr=1e-3, seed=seed, eval_every=10)
        runs.append((r, _state(new)))
    (a, sa), (b, sb), (c, sc) = runs
    assert a.done == 20 and a.stopped is None and a.objective == "kl" and a.fit_batches == 19
    assert [p.step for p in a.points] == [0, 10, 20] and a.fit_rows == 600 and a.holdout_rows == 200
    # the factorized initialisation, measured on the 200 held-out rows, is deterministic
    assert a.before.metric == pytest.approx(0.2010, abs=5e-4)
    # distillation lowers the held-out KL to the dense model and the held-out relative output error
    assert a.after.loss < 0.8 * a.before.loss
    assert a.after.metric < 0.95 * a.before.metric
    assert a.after.step == a.kept_step and a.kept_step > 0
    # the same seed: the same bits; another seed: another batch order, other weights
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [(p.metric, p.loss, p.fit_loss) for p in a.points] == [(p.metric, p.loss, p.fit_loss) for p in b.points]
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_factors_only_leaves_every_other_parameter_bit_identical(setup):
    model, cal = setup
    dense_before = _state(model)
    new = factorize(model, PLAN)
    before = _state(new)
    r = recover(new, model, cal, steps=5, lr=1e-3)
    after = _state(new)
    factors = {f"{k}.{i}.weight" for k in PLAN for i in (0, 1)}
    assert set(factor_modules(new, model)) == set(PLAN)
    assert r.trainable_params == sum(before[k].numel() for k in factors)
    assert all(not torch.equal(before[k], after[k]) for k in factors)
    others = [k for k in before if k not in factors]
    assert "fc1.1.bias" in others and "head.weight" in others
    assert all(torch.equal(before[k], after[k]) for k in others)
    assert all(torch.equal(dense_before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in new.parameters())  # flags restored
    new2 = factorize(model, PLAN)
    recover(new2, model, cal, steps=5, lr=1e-3, trainable="all")
    assert not torch.equal(new2.head.weight, before["head.weight"]) and not torch.equal(new2.fc1[1].bias,
                                                                                          before["fc1.1.bias"])


def test_heldout_rows_never_reach_the_optimiser(setup):
    model, cal = setup
    new = factorize(model, PLAN)
    fit_ids = {id(b.kwargs["x"]) for b in cal.fit}
    held_ids = {id(b.kwargs["x"]) for b in cal.holdout}
    calls = []
    new.register_forward_pre_hook(lambda m, args, kwargs: calls.append((torch.is_grad_enabled(), id(kwargs["x"]))),
                                  with_kwargs=True)
    recover(new, model, cal, steps=25, lr=1e-3, eval_every=10)
    grad_calls = [i for g, i in calls if g]
    assert len(grad_calls) == 25 and set(grad_calls) <= fit_ids  # every training forward: a fit batch
    assert held_ids & {i for g, i in calls if not g} == held_ids  # the held-out rows are measured (no grad)
    assert not held_ids & set(grad_calls)
    # and what is trained does not depend on them: other held-out rows give the same bits
    other = load_calibration({"x": _x(0, 600)}, model, holdout={"x": _x(1000, 1200)}, batch_size=32)
    assert [torch.equal(a.kwargs["x"], b.kwargs["x"]) for a, b in zip(cal.fit, other.fit)] == [True] * 19
    one, two = factorize(model, PLAN), factorize(model, PLAN)
    r1 = recover(one, model, cal, steps=12, lr=1e-3, eval_every=4)
    r2 = recover(two, model, other, steps=12, lr=1e-3, eval_every=4)
    assert r1.kept_step == r2.kept_step and r1.before.metric != r2.before.metric
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))


def test_ctrl_c_keeps_the_best_state_so_far(setup):
    model, cal = setup
    new = factorize(model, PLAN)
    snaps = {}

    def progress(done, total, loss):
        snaps[done] = _state(new)
        if done == 5:
            raise KeyboardInterrupt

    r = recover(new, model, cal, steps=50, lr=1e-3, eval_every=2, progress=progress)
    assert r.done == 5 and r.stopped.startswith("interrupted after step 5; the best state so far (step ")
    assert [p.step for p in r.points] == [0, 2, 4] and r.kept_step in (2, 4)
    assert min(r.points, key=lambda p: p.fit_loss).step == r.kept_step
    assert all(torch.equal(v, snaps[r.kept_step][k]) for k, v in _state(new).items())


def test_a_loss_that_becomes_nan_stops_and_says_at_which_step(setup):
    model, cal = setup
    new = factorize(model, PLAN)
    init = _state(new)
    r = recover(new, model, cal, steps=10, lr=1e12, trainable="all")  # Adam moves every weight by ~lr
    assert r.stopped == "the loss became nan at step 2 (lr 1e+12); the best state so far (step 0) is kept"
    assert r.done == 1 and r.kept_step == 0 and r.after == r.before
    assert all(torch.equal(v, init[k]) for k, v in _state(new).items())
    settings = {"steps": 10, "lr": 1e12, "trainable": "all", "objective": "auto"}
    with pytest.raises(AuditError) as e:
        cli_recover(settings, factorize(model, PLAN), model, cal, None)
    assert e.value.line() == ("recovery stopped: the loss became nan at step 2 (lr 1e+12); the best state so far "
                              "(step 0) is kept. Lower --recover-lr (or check the inputs); nothing was written.")


def test_bf16_trains_through_fp32_masters(setup):
    model, cal = setup
    dense = copy.deepcopy(model).to(torch.bfloat16)
    bf = load_calibration({"x": _x(0, 400).to(torch.bfloat16)}, dense, holdout=0.25, batch_size=32)
    new = factorize(dense, PLAN)
    before = _state(new)
    r = recover(new, dense, bf, steps=8, lr=1e-3)
    assert r.master_fp32 and r.stopped is None and r.kept_step == 8
    assert all(p.dtype == torch.bfloat16 for p in new.parameters())
    assert r.after.fit_loss < 0.9 * r.before.fit_loss  # what it trains on, in float32 masters
    assert not torch.equal(new.fc2[0].weight, before["fc2.0.weight"])
    assert torch.equal(new.head.weight, before["head.weight"])


@pytest.mark.parametrize("kw, message", [
    ({"steps": 0}, "recovery steps 0 is not a positive integer"),
    ({"steps": -3}, "recovery steps -3 is not a positive integer"),
    ({"steps": True}, "recovery steps True is not a positive integer"),
    ({"steps": 2.5}, "recovery steps 2.5 is not a positive integer"),
    ({"steps": 5, "lr": float("nan")}, "recovery learning rate nan is not a positive finite number"),
    ({"steps": 5, "lr": -1e-3}, "recovery learning rate -0.001 is not a positive finite number"),
    ({"steps": 5, "lr": float("inf")}, "recovery learning rate inf is not a positive finite number"),
    ({"steps": 5, "trainable": "bias"}, "recovery trainable 'bias' is neither 'factors' nor 'all'"),
    ({"steps": 5, "objective": "ce"}, "recovery objective 'ce' is not one of auto, kl, mse"),
    ({"steps": 5, "eval_every": 0}, "recovery eval_every 0 is not a positive integer"),
])
def test_bad_settings_are_one_line(setup, kw, message):
    model, cal = setup
    new = copy.deepcopy(model)  # the settings are checked before the model is looked at
    with pytest.raises(AuditError) as e:
        recover(new, model, cal, **kw)
    assert e.value.what == message and "\n" not in e.value.line()


def test_nothing_to_recover_is_one_line(setup):
    model, cal = setup
    with pytest.raises(AuditError, match="the model has no factorized layer to recover"):
        recover(copy.deepcopy(model), model, cal, steps=5)
    with pytest.raises(AuditError, match="the dense model as the factorized one"):
        recover(model, model, cal, steps=5)
    no_held = load_calibration({"x": _x(0, 100)}, model, holdout=0)
    with pytest.raises(AuditError, match="holds nothing out"):
        recover(factorize(model, PLAN), model, no_held, steps=5)


@pytest.mark.parametrize("extra, message", [
    (["--recover", "0"], "recovery steps 0 is not a positive integer"),
    (["--recover", "-5"], "recovery steps -5 is not a positive integer"),
    (["--recover", "ten"], "--recover 'ten' is not a whole number of steps"),
    (["--recover", "10", "--recover-lr", "nan"], "recovery learning rate nan is not a positive finite number"),
    (["--recover", "10", "--recover-lr", "fast"], "--recover-lr 'fast' is not a number"),
    (["--recover", "10", "--recover-trainable", "bias"], "recovery trainable 'bias' is neither"),
    (["--recover-lr", "1e-3"], "--recover-lr needs --recover STEPS"),
])
def test_cli_bad_recovery_settings_exit_2(cli_inproc, tmp_path, extra, message):
    cal = tmp_path / "cal.safetensors"
    from safetensors.torch import save_file

    save_file({"x": _x(0, 64)}, str(cal))
    plan = tmp_path / "plan.toml"
    plan.write_text("[ranks]\nfc1 = 8\n")
    r = cli_inproc("factorize", "sample_models/digits.py:mlp", "--plan", plan, "--calibration", cal,
                   "-o", tmp_path / "out", *extra)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    r = cli_inproc("factorize", "sample_models/digits.py:mlp", "--plan", plan, "-o", tmp_path / "out",
                   "--recover", "10")
    assert r.returncode == 2 and "--recover needs --calibration" in r.stderr


def test_settings_passed_whole_are_the_keywords(setup):
    """recover(f, d, cal, RecoverySettings(...)) runs exactly as the same fields given as keywords; a keyword beside
    the object overrides its field; without steps it is one line."""
    from auditor.calibration.recovery import RecoverySettings

    model, cal = setup
    one, two, three = (factorize(model, PLAN) for _ in range(3))
    a = recover(one, model, cal, steps=6, lr=1e-3, seed=2, eval_at=(3,))
    b = recover(two, model, cal, RecoverySettings(steps=6, lr=1e-3, seed=2, eval_at=(3,)))
    c = recover(three, model, cal, RecoverySettings(steps=99, lr=1e-3, seed=2, eval_at=(3,)), steps=6)
    strip = [{k: v for k, v in r.to_dict().items() if not k.startswith("seconds")} for r in (a, b, c)]
    assert strip[0] == strip[1] == strip[2] and [p.step for p in a.points] == [0, 3, 6]
    assert all(torch.equal(x, y) for x, y in zip(one.state_dict().values(), two.state_dict().values()))
    with pytest.raises(AuditError, match="recover\\(\\) needs the number of steps"):
        recover(factorize(model, PLAN), model, cal, lr=1e-3)
    with pytest.raises(AuditError, match="eval_at \\[0\\] holds a step that is not a positive integer"):
        recover(factorize(model, PLAN), model, cal, steps=3, eval_at=(0,))
