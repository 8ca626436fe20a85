"""AuditOptions in typed groups (issue 30): every group field also has its flat name (the keyword the options took
before the groups), as a keyword and, deprecated (issue 36), as an attribute; the audit reads the groups; no field is
typed ``Any``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from auditor.errors import AuditError
from auditor.options import (FLAT, AuditOptions, CalibrationData, ClusterOptions, RecoveryOptions, SpeedOptions,
                             StatisticsOptions, TierOptions)

GROUPS = {"calibration_data": CalibrationData, "tiers": TierOptions, "statistics": StatisticsOptions,
          "recovery": RecoveryOptions, "cluster": ClusterOptions, "speed": SpeedOptions}

# one value per flat name, none of them a default, all of them valid together
GIVEN = {
    "calibration": "c.safetensors", "holdout": 0.5, "calibration_length": 64, "tokenizer": "tok",
    "calibration_max_rows": 10, "calibration_max_bytes": 1000, "document_separator": "\n\n", "metric": "kl",
    "tolerance": 0.02,
    "measure_floor": True, "budget": 0.3, "budget_bytes": 10**6, "bits_per_weight": None, "write_bits": "out",
    "probe_sensitivity": False, "probe": True, "confidence": 0.8,
    "split": False, "device": "cpu", "offload": True, "compute_dtype": "float32", "recover_steps": 7,
    "recover_lr": 1e-3, "recover_trainable": "all", "recover_objective": "mse", "recover_seed": 3,
    "choose_after_recovery": True, "scheduler": "tcp://h:8786", "path_map": (("/a", "/b"),),
    "origin": ("m.py:f", None), "measure_speed": True, "latency_shape": (2, 8), "budget_latency": 0.2,
    "speed_clock": None, "ties": (("q_proj", "k_proj"),),
}


def test_every_flat_name_is_a_group_field_given_and_read_either_way():
    assert set(GIVEN) == set(FLAT) and {g for g, _ in FLAT.values()} == set(GROUPS)
    for name, (group, attr) in FLAT.items():
        assert attr in {f.name for f in dataclasses.fields(GROUPS[group])}, name
    flat = AuditOptions(**GIVEN)
    grouped = AuditOptions(**{group: cls(**{attr: GIVEN[n] for n, (g, attr) in FLAT.items() if g == group})
                              for group, cls in GROUPS.items()})
    assert flat == grouped and flat.recovery == RecoveryOptions(7, 1e-3, "all", "mse", 3, True)
    with pytest.warns(DeprecationWarning) as caught:
        assert [n for n in FLAT if getattr(flat, n) != GIVEN[n]] == []
    assert len(caught) == len(FLAT) and str(caught[0].message) == (
        "AuditOptions.calibration is deprecated; read AuditOptions.calibration_data.source")
    assert all(w.filename == __file__ for w in caught)  # attributed to the reader
    assert flat.tiers.budget == 0.3 and flat.calibration_data.source == "c.safetensors" and flat.speed.measure
    assert pickle.loads(pickle.dumps(flat)) == flat


def test_a_flat_keyword_replaces_that_field_of_the_group_given_with_it():
    o = AuditOptions(calibration_data=CalibrationData(source="c", holdout=0.1, length=32), holdout=0.4)
    assert (o.calibration_data.source, o.calibration_data.holdout, o.calibration_data.length) == ("c", 0.4, 32)
    assert o.with_(budget=0.5).tiers.budget == 0.5 and o.with_(budget=0.5).calibration_data.holdout == 0.4
    assert dataclasses.replace(o, compute_dtype="fp64").statistics.compute_dtype == "float64"
    assert AuditOptions(latency_shape=[4]).speed == SpeedOptions(measure=True, latency_shape=(4,))


def test_the_checks_see_the_groups_and_unknown_names_are_refused():
    with pytest.raises(AuditError, match="budget 1.5 is not a fraction"):
        AuditOptions(tiers=TierOptions(budget=1.5), calibration="c")
    with pytest.raises(AuditError, match="recover_steps needs calibration data and a budget"):
        AuditOptions(recovery=RecoveryOptions(steps=5))
    with pytest.raises(AuditError, match="measure_floor, budget and metric need calibration data"):
        AuditOptions(tiers=TierOptions(measure_floor=True))
    with pytest.raises(TypeError, match="unknown audit option.*holdot.*holdout"):
        AuditOptions(holdot=0.2)
    with pytest.raises(TypeError, match="unknown audit option.*recovery_steps"):
        AuditOptions().with_(recovery_steps=3)


def test_no_option_is_typed_any():
    typed = [(cls.__name__, f.name, str(f.type)) for cls in (AuditOptions, *GROUPS.values())
             for f in dataclasses.fields(cls)]
    assert len(typed) == 19 + len(FLAT)
    assert [t for t in typed if t[2] == "Any" or "| Any" in t[2] or "Any |" in t[2]] == []


# keywords whose TypedDict type is wider than the field's: AuditOptions.__post_init__ converts what it is given
WIDER = {"tracer": "Tracer | str", "spectra_backend": "SpectraBackend | str",
         "ties": "'str | Iterable[str | Iterable[str]]'"}


def test_the_keyword_shortcuts_typed_dict_is_the_options_fields():
    """``OptionFields`` (what type checkers read for ``auditor.audit(model, **shortcuts)``) names every field of
    AuditOptions and every flat name, with the field's type (wider only where the options convert the value)."""
    from auditor.options import OptionFields

    def text(t: object) -> str:
        return getattr(t, "__forward_arg__", None) or str(t)

    want = {f.name: str(f.type) for f in dataclasses.fields(AuditOptions)}
    want.update({name: str({f.name: f.type for f in dataclasses.fields(GROUPS[group])}[attr])
                 for name, (group, attr) in FLAT.items()})
    typed = {name: text(t) for name, t in OptionFields.__annotations__.items()}
    assert sorted(typed) == sorted(want)
    assert {n: t for n, t in typed.items() if t != want[n]} == WIDER
    with pytest.raises(TypeError, match="unknown audit option"):  # the run-time check reads the dataclasses' fields
        AuditOptions(**{"plan_may_relaxx": True})


def test_the_audit_reads_the_groups_not_the_flat_names(recwarn):
    """A calibrated, budgeted, speed-measured audit reads no option by its flat name, calibration included: each
    stage and tier reads its group."""
    import torch
    from _speedclock import CostClock
    from torch import nn

    import auditor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(48, 16)
    a = auditor.audit(model, x[:2], options=AuditOptions(
        cache=False, calibration={"input": x}, budget=0.3, measure_speed=True, speed_clock=CostClock(1e-6, 1e-3)))
    assert a.calibration is not None and a.speed is not None
    flat = [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "AuditOptions." in str(w.message)]
    assert [f"{w.filename}:{w.lineno} {w.message}" for w in flat] == []


@pytest.mark.parametrize("home, settings, fields", [
    ("auditor.calibration.statistics.stream", "StreamOptions", "StreamFields"),
    ("auditor.calibration.tiers.fisher", "GradientSettings", "GradientFields"),
    ("auditor.calibration.tiers.sweep", "SweepSettings", "SweepFields"),
    ("auditor.calibration.tiers.budget", "SearchSettings", "SearchFields"),
])
def test_each_keywords_typed_dict_is_its_settings_class(home, settings, fields):
    """The ``**fields: Unpack[...]`` keywords of a tier's function name every field of its settings class, with the
    field's type, and nothing else: a field added to one and not the other fails here."""
    import importlib
    import typing

    mod = importlib.import_module(home)
    cls, typed = getattr(mod, settings), getattr(mod, fields)

    def spelled(t: object) -> str:  # a string annotation and the evaluated one compare as the same words
        return (getattr(t, "__forward_arg__", None) or (t if isinstance(t, str) else typing._type_repr(t))).replace(
            "typing.", "").replace("'", "")

    want = {f.name: spelled(f.type) for f in dataclasses.fields(cls)}
    got = {name: spelled(t) for name, t in typed.__annotations__.items()}
    assert got == want
