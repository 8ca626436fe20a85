"""The calibration stage's parts that issue 36 made one of each: the kinds answer the gradient pass's questions, one
loop patches repeated blocks, one recovery settings type validated once, frozen report rows, one protocol for what
tier 3 measures plans with, one truncator store."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from auditor import kinds
from auditor.calibration import load_calibration
from auditor.calibration.measure.metric import Evaluator, Metric
from auditor.calibration.recovery import RecoverySettings
from auditor.calibration.statistics.stream import patched_forwards
from auditor.calibration.statistics.whiten import TruncatorStore
from auditor.calibration.tiers.fisher import GRADIENT_KINDS
from auditor.calresults import LayerCalibration
from auditor.errors import AuditError
from auditor.kinds.base import LayerKind
from auditor.options import AuditOptions, RecoveryOptions
from auditor.results import Kind, Layer


def _layer(kind: str, m: int = 6, n: int = 4) -> Layer:
    return Layer(name="x", param="x.weight", kind=kind, module_type="Linear", shape=(m, n), m=m, n=n)


def test_the_gradient_pass_asks_the_kinds_and_a_new_kind_is_in_it():
    assert sorted(GRADIENT_KINDS) == sorted([Kind.LINEAR, Kind.CONV1D_HF, Kind.EMBEDDING])
    assert Kind.CONV not in GRADIENT_KINDS and Kind.RNN not in GRADIENT_KINDS
    emb, lin = kinds.for_kind(Kind.EMBEDDING), kinds.for_kind(Kind.LINEAR)
    assert emb.function_shape(_layer(Kind.EMBEDDING)) == (4, 6) and lin.function_shape(_layer(Kind.LINEAR)) == (6, 4)
    w = torch.arange(24.0).reshape(6, 4)
    assert lin.function_view(_layer(Kind.LINEAR), w) is w
    assert torch.equal(kinds.for_kind(Kind.CONV1D_HF).function_view(_layer(Kind.CONV1D_HF), w), w.t())
    assert emb.lookup_counts and not lin.lookup_counts and lin.cut_to_rank1 and not emb.cut_to_rank1

    class ScaledKind(LayerKind):
        kind = "scaled-36"
        finds = {}
        gradient_sensitivity = True

    kinds.register(ScaledKind())
    try:
        assert "scaled-36" in GRADIENT_KINDS  # a live view: nobody edits a table
    finally:
        kinds.registry.unregister(kinds.for_kind("scaled-36"))
    assert "scaled-36" not in GRADIENT_KINDS


def test_patched_forwards_restores_each_blocks_own_forward_also_on_error():
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    own = lambda x: x  # noqa: E731 - an instance attribute of its own, kept as it was
    blocks[1].forward = own
    seen = []
    with pytest.raises(RuntimeError, match="stop"):
        with patched_forwards(blocks, lambda i, blk: (lambda *a, **k: seen.append(i) or i)):
            assert [blk(torch.zeros(2)) for blk in blocks] == [0, 1]
            raise RuntimeError("stop")
    assert seen == [0, 1]
    assert "forward" not in blocks[0].__dict__ and blocks[1].__dict__["forward"] is own


def test_one_recovery_settings_type_with_one_check():
    assert issubclass(RecoverySettings, RecoveryOptions)
    bad = dict(lr=-1.0)
    with pytest.raises(AuditError) as via_options:
        AuditOptions(calibration="c.pt", budget=0.5, recover_steps=3, recover_lr=-1.0)
    with pytest.raises(AuditError) as via_settings:
        RecoverySettings(steps=3, **bad).check()
    assert str(via_options.value) == str(via_settings.value) == (
        "recovery learning rate -1.0 is not a positive finite number. Give e.g. --recover-lr 0.0001.")
    with pytest.raises(AuditError, match="recovery gradient clip 0 is not a positive finite number"):
        RecoverySettings(steps=3, clip=0).check()
    with pytest.raises(TypeError):
        RecoverySettings(3, 1e-4, "factors", "auto", 0, False, None)  # the recovery's own fields are keywords only


def test_the_report_rows_are_frozen():
    row = LayerCalibration("fc", 10, 4, {}, 2, "factorize", "", [(0, 1.0)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.floor = None  # type: ignore[misc]


def test_an_evaluator_says_the_rows_it_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval()
    cal = load_calibration({"input": torch.randn(40, 4)}, model, holdout=0.25)
    ev = Evaluator(model, cal, Metric())
    assert ev.rows_read == cal.holdout_rows == 10
    assert ev.measure(model).value == 0.0 and ev.evaluations == 1


def test_one_truncator_store_spills_or_drops_what_does_not_fit():
    from auditor.calibration.statistics.whiten import Truncator

    layer = Layer("x", "x.weight", Kind.LINEAR, "Linear", (4, 4), 4, 4)
    t = Truncator(layer, torch.eye(4), None)  # kept as its cut: A_4 and B_4, 2 x 4 x 4 float64
    dropped = TruncatorStore(300, spill=False)
    dropped["a"], dropped["b"] = t, t
    assert list(dropped) == ["a"] and dropped.bytes == 256 and dropped.refused == 1 and dropped.spilled == 0
    assert dropped.get("b") is None and dropped.get("a").full is not None


# ---- every pass leaves the session and the results before it as they were (torch.fx's ``ensures``) -------------


def _fingerprint(obj: object, depth: int = 0, seen: set[int] | None = None) -> object:
    """What a value holds, deeply: dataclasses, dicts, lists and tuples walked; arrays and tensors by their bytes;
    other objects by identity and their own attributes. Two fingerprints differ when anything reachable changed."""
    import hashlib

    seen = set() if seen is None else seen
    from auditor.calibration.references import References

    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, References):  # its measurers count what they measured and cache: which ones, not their state
        return ("references", id(obj.search), id(obj.verifier), id(obj.whole), obj.search_rows, obj.notes)
    if isinstance(obj, np.ndarray):
        return ("array", obj.shape, str(obj.dtype), hashlib.sha1(np.ascontiguousarray(obj).tobytes()).hexdigest())
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), tuple(obj.shape), str(obj.dtype), obj._version)
    if isinstance(obj, nn.Module) or callable(obj) or depth > 12 or id(obj) in seen:
        return ("object", id(obj))
    seen.add(id(obj))
    if isinstance(obj, dict):
        return ("dict", id(obj), tuple((k, _fingerprint(v, depth + 1, seen)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return (type(obj).__name__, id(obj), tuple(_fingerprint(v, depth + 1, seen) for v in items))
    state = vars(obj) if hasattr(obj, "__dict__") else {}
    return (type(obj).__name__, id(obj), tuple((k, _fingerprint(v, depth + 1, seen)) for k, v in state.items()))


def _ensures(ctx, upstream: tuple, run):
    """``run()`` (one pass) leaves ``ctx.session`` (its attributes, the statistics it shares, its calibration's
    warnings) and every result in ``upstream`` as they were; returns the pass's result."""
    session = ctx.session
    before = (_fingerprint(vars(session)), _fingerprint(vars(session._held)), list(session.calibration.warnings),
              [_fingerprint(u) for u in upstream])
    out = run()
    after = (_fingerprint(vars(session)), _fingerprint(vars(session._held)), list(session.calibration.warnings),
             [_fingerprint(u) for u in upstream])
    for what, b, a in zip(("the session", "the session's shared statistics", "the calibration's warnings",
                           "an earlier pass's result"), before, after):
        assert a == b, f"the pass changed {what}"
    return out


@pytest.fixture(scope="module")
def digits_audit(tmp_path_factory):
    """The digits MLP, its digits calibration (every image; a quarter held out) and the audit's options at a 30%
    budget, for the passes to run on."""
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    from auditor import pipeline
    from auditor.sources import load_source

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    loaded = load_source("sample_models/digits.py:mlp")
    model = loaded.model.eval()
    options = AuditOptions(calibration=str(path), budget=0.3, progress=False, cache=False)
    plain = pipeline.audit(model, options=AuditOptions(progress=False, cache=False))  # the layers, their shares
    return model, plain.layers, options, plain.settings


def test_every_pass_leaves_the_session_and_the_results_before_it_as_they_were(digits_audit):
    from auditor.calibration.stage import _open_session
    from auditor.calibration.tiers import passes
    from auditor.progress import Progress

    model, layers, options, settings = digits_audit
    progress = Progress(enabled=False)
    ctx = passes.PassContext(model, _open_session(model, layers, options, progress), progress)
    tiers = options.tiers
    t1 = passes.tier1(ctx, settings.align)  # fills the statistics: the session's cache of its inputs
    refs = _ensures(ctx, (t1,), lambda: passes.references(ctx))
    scope = _ensures(ctx, (t1, refs), lambda: passes.scope_of(layers, t1, settings))
    assert sorted(l.name for l in scope.planned) == ["fc1", "fc2", "fc3"]
    floored = _ensures(ctx, (t1, refs, scope),
                       lambda: passes.floors(ctx, refs, t1, scope, tiers, options.cluster, False))
    sens = _ensures(ctx, (t1, refs, scope), lambda: passes.sensitivity(ctx, refs, t1, scope, floored, tiers))
    assert type(sens).__name__ == "Gradients" and sens.loss_metric is not None, (type(sens), scope.planned)
    searched = _ensures(ctx, (t1, refs, scope, sens),
                        lambda: passes.search(ctx, refs, t1, scope, sens, tiers, settings))
    assert searched.budget.plan and refs.verifier is not None
    recovered = _ensures(ctx, (t1, refs, scope, sens, searched),
                         lambda: passes.recovered(ctx, refs, searched, sens, options.recovery))
    verified = _ensures(ctx, (t1, refs, scope, sens, searched, recovered),
                        lambda: passes.verified(ctx, refs, recovered.budget, searched.reuse))
    assert verified.budget.verification is not None and verified.evaluations >= 1
    assert all(p.verification is None for p in searched.budget.tries)  # the search's tries as they were
    based = _ensures(ctx, (t1, refs, scope, sens, searched, recovered, verified),
                     lambda: passes.baselined(ctx, refs, verified.budget, scope, searched.baseline_reuse))
    assert based.budget.uniform is not None and verified.budget.uniform is None
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    byte_tiers = dataclasses.replace(tiers, bits_per_weight=4.5)
    byte_plan = _ensures(ctx, (t1, refs, scope, sens, searched, recovered, verified, based),
                         lambda: passes.bits(ctx, refs, scope, sens.loss_metric, byte_tiers))
    assert byte_plan.report is not None and byte_plan.evaluations == len(byte_plan.report.plans) + 3
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # swapped back, never written
    assert passes.bits(ctx, refs, scope, sens.loss_metric, tiers).report is None  # none asked for

    def writes_the_session():  # what the passes once did (the loss metric, the verifier's warnings)
        ctx.session.calibration.warnings.append("a pass's finding")
        return None

    with pytest.raises(AssertionError, match="the pass changed the session"):
        _ensures(ctx, (t1,), writes_the_session)
    ctx.session.calibration.warnings.pop()
    with pytest.raises(AttributeError, match="holds inputs only; 'loss_metric' is the sensitivity pass's"):
        ctx.session.loss_metric = sens.loss_metric
    with pytest.raises(AttributeError, match="'verifier' is the references pass's"):
        ctx.session.verifier  # noqa: B018

    def edits_a_result():
        searched.budget.tries[0].verification = verified.budget.verification

    with pytest.raises(AssertionError, match="an earlier pass's result"):
        _ensures(ctx, (searched,), edits_a_result)


def test_a_chosen_plan_whose_written_model_fails_gives_way_to_a_smaller_one(digits_audit, monkeypatch):
    """The verification's number is the model ``factorize`` writes (the default fit's). Where that model misses the
    tolerance although the search's truncation held, the next smaller plan that held is fitted and measured, and the
    suggestion is the first whose written model holds; when none does, the empty plan."""
    from dataclasses import replace

    from auditor.calibration.tiers import passes

    model, layers, options, settings = digits_audit
    ctx, t1, refs, scope = _to_the_scope(digits_audit)
    sens = passes.sensitivity(ctx, refs, t1, scope, None, options.tiers)
    searched = passes.search(ctx, refs, t1, scope, sens, options.tiers, settings)
    first = passes.verified(ctx, refs, searched.budget, searched.reuse, sens.loss_metric).budget
    assert first.plan and first.verification.ok and first.verification.fit == "sequential"
    real, fitted = passes.fitted_measurement, []

    def failing_above(limit):
        def measure(model, session, refs, plan, loss_metric):
            v, label, removed = real(model, session, refs, plan, loss_metric)
            fitted.append(removed)
            return (replace(v, ok=False) if removed > limit else v), label, removed
        return measure

    monkeypatch.setattr(passes, "fitted_measurement", failing_above(first.removed - 1))
    smaller = passes.verified(ctx, refs, searched.budget, searched.reuse, sens.loss_metric).budget
    held = sorted({p.removed for p in searched.budget.tries if p.ok and p.plan and p.removed < first.removed})
    assert fitted[0] == first.removed and smaller.removed == held[-1] == fitted[1], (fitted, held)
    assert smaller.verification.ok and smaller.smallest_failing <= first.removed and smaller.plan != first.plan
    fitted.clear()
    monkeypatch.setattr(passes, "fitted_measurement", failing_above(-1))
    none = passes.verified(ctx, refs, searched.budget, searched.reuse, sens.loss_metric).budget
    assert none.plan == {} and none.removed == 0 and none.verification is None
    assert fitted == sorted(fitted, reverse=True) and 1 <= len(fitted) <= passes.VERIFY_TRIES


def test_tier_1s_decompositions_are_the_ones_the_baseline_cuts(digits_audit, monkeypatch):
    """Tier 1 keeps the whitened truncators of the layers a plan may cut (on disk, none in memory) as it makes their
    spectra; with the gradient pass's loss-aware truncations in tier 3, the uniform baseline cuts tier 1's and
    decomposes nothing itself, to the same numbers as a baseline that decomposes its own (both on one BLAS thread, as
    the calibration runs)."""
    from auditor.calibration.stage import one_blas_thread
    from auditor.calibration.tiers import passes

    model, layers, options, settings = digits_audit
    runs = {}
    for keep in (passes.plannable(layers, settings), frozenset()):
        runs[bool(keep)] = one_blas_thread(_to_the_baseline)(model, layers, options, settings, keep, monkeypatch)
    (t1, searched, based, made), (t0, _, own_based, own_made) = runs[True], runs[False]
    assert sorted(passes.plannable(layers, settings)) == ["fc1", "fc2", "fc3"]
    assert t0.kept is None and t1.kept is not None and t1.kept.bytes == 0 and t1.kept.spilled == 3
    assert searched.loss_aware and searched.baseline_reuse is t1.kept
    assert made == [] and sorted(own_made) == ["fc1", "fc2", "fc3"]
    assert {k: s.error for k, s in t1.spectra.items()} == {k: s.error for k, s in t0.spectra.items()}
    u, v = based.budget.uniform, own_based.budget.uniform
    assert u is not None and v is not None and u.ranks == v.ranks
    assert (u.metric, u.ok, u.removed) == (v.metric, v.ok, v.removed)


def test_a_kept_truncator_is_the_one_the_layer_makes_bit_for_bit():
    """``whitened_spectra(keep=...)``: the same spectra, and each kept truncator's factors those of a
    :class:`Truncator` made from the same statistics, as a store keeps it, to the bit (one BLAS thread each, as the
    calibration runs),
    for a wide map and a tall one (whose U tier 1 forms from F); a layer outside ``keep.names`` is not kept."""
    from threadpoolctl import threadpool_limits

    from auditor.calibration.statistics.stats import InputStatistics, LayerInput
    from auditor.calibration.statistics.whiten import Keep, Truncator, whitened_spectra

    g = torch.Generator().manual_seed(0)
    shapes = {"wide": (6, 10), "tall": (12, 5), "other": (4, 4)}
    layers = [Layer(k, k + ".weight", Kind.LINEAR, "Linear", s, *s) for k, s in shapes.items()]
    weights = {l.param: torch.randn(*l.shape, generator=g, dtype=torch.float64) for l in layers}
    inputs = {}
    for l in layers:
        x = torch.randn(40, l.n, generator=g, dtype=torch.float64).numpy()
        inputs[l.name] = LayerInput(l.name, Kind.LINEAR, (x.T @ x)[None], rows=40, width=l.n)
    stats = InputStatistics(layers=inputs)
    store = TruncatorStore(0)
    kept = whitened_spectra(layers, weights, stats, keep=Keep(store, frozenset({"wide", "tall"})))
    plain = whitened_spectra(layers, weights, stats)
    assert {k: (s.error, s.sigma) for k, s in kept.items()} == {k: (s.error, s.sigma) for k, s in plain.items()}
    assert store.holds("wide") and store.holds("tall") and not store.holds("other") and store.spilled == 2
    with threadpool_limits(limits=1, user_api="blas"):
        for l in layers[:2]:
            made = Truncator(l, weights[l.param], inputs[l.name])
            for r in (1, 3, 5):  # as the store keeps it (its cut) to the bit, and the direct U_r^T F to rounding
                a, b = store.get(l.name).factors(r)
                want_a, want_b = made.cut().factors(r)
                assert np.array_equal(a, want_a) and np.array_equal(b, want_b), (l.name, r)
                assert all(np.allclose(x, y, rtol=1e-12, atol=1e-15) for x, y in zip((a, b), made.factors(r)))


def _to_the_scope(digits_audit, keep: frozenset[str] = frozenset()):
    """The passes up to the scope on the digits MLP (tier 1 keeping ``keep``'s decompositions): the pass context,
    tier 1, the references and the scope."""
    from auditor.calibration.stage import _open_session
    from auditor.calibration.tiers import passes
    from auditor.progress import Progress

    model, layers, options, settings = digits_audit
    progress = Progress(enabled=False)
    ctx = passes.PassContext(model, _open_session(model, layers, options, progress), progress)
    t1 = passes.tier1(ctx, settings.align, keep=keep)
    refs = passes.references(ctx)
    return ctx, t1, refs, passes.scope_of(layers, t1, settings)


def _to_the_baseline(model, layers, options, settings, keep, monkeypatch):
    """The passes up to the uniform baseline with tier 1 keeping ``keep``'s decompositions: tier 1, the search and
    the baseline, and the layers the baseline decomposed itself."""
    from auditor.calibration.statistics import whiten
    from auditor.calibration.tiers import passes

    ctx, t1, refs, scope = _to_the_scope((model, layers, options, settings), keep)
    sens = passes.sensitivity(ctx, refs, t1, scope, None, options.tiers)
    searched = passes.search(ctx, refs, t1, scope, sens, options.tiers, settings)
    made = []
    own = whiten.Truncator.__init__
    monkeypatch.setattr(whiten.Truncator, "__init__", lambda self, layer, *a, **k: made.append(layer.name)
                        or own(self, layer, *a, **k))
    based = passes.baselined(ctx, refs, searched.budget, scope, searched.baseline_reuse)
    monkeypatch.setattr(whiten.Truncator, "__init__", own)
    return t1, searched, based, made


def test_the_gradient_passs_decompositions_on_several_threads_are_those_made_one_after_another(digits_audit,
                                                                                                monkeypatch):
    """The loss-aware truncations run one layer per core (fisher._layer_costs), each put into the store by its
    thread: the costs, their order and every kept cut are those of one thread making them in turn, to the bit."""
    import os

    from auditor.calibration.stage import one_blas_thread
    from auditor.calibration.tiers import passes

    options = digits_audit[2]
    ctx, t1, refs, scope = _to_the_scope(digits_audit)
    runs = []
    for cores in (1, 3):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        sens = one_blas_thread(passes.sensitivity)(ctx, refs, t1, scope, None, options.tiers)
        runs.append(sens)
    one, many = runs
    assert list(one.gradients.costs.items()) == list(many.gradients.costs.items())
    assert all(one.reuse.holds(n) and many.reuse.holds(n) for n in ("fc1", "fc2", "fc3"))
    for name in ("fc1", "fc2", "fc3"):
        a, b = one.reuse.get(name), many.reuse.get(name)
        assert all(np.array_equal(x, y) for p, q in zip(a.full, b.full) for x, y in zip(p, q)), name


def test_tier_1_on_a_cluster_keeps_no_store_and_tier_3_keeps_its_own_part_in_memory(digits_audit, monkeypatch):
    """On a Dask cluster tier 1's decompositions stay on the workers (``keep`` is ignored there): tier 1 then keeps
    no store at all, so tier 3 makes its own with one part's decompositions in memory, not an empty store of tier 1's
    that would send every truncation to disk."""
    import contextlib

    from auditor.calibration.statistics import placement
    from auditor.calibration.statistics.whiten import whitened_spectra
    from auditor.calibration.tiers import passes

    @contextlib.contextmanager
    def here(self):  # the cluster's spectra, made here: what matters is that keep is not honoured there
        yield lambda *a, keep=None, **k: whitened_spectra(*a, **k)

    monkeypatch.setattr(placement.Decompositions, "on_cluster", property(lambda self: True))
    monkeypatch.setattr(placement.Decompositions, "spectra", here)
    model, layers, options, settings = digits_audit
    ctx, t1, refs, scope = _to_the_scope(digits_audit, passes.plannable(layers, settings))
    assert t1.kept is None and t1.spectra
    monkeypatch.undo()  # here again: the same passes keep tier 1's three
    _, local, _, _ = _to_the_scope(digits_audit, passes.plannable(layers, settings))
    assert local.kept is not None and local.kept.spilled == 3
