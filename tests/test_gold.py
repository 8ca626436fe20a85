"""The JSON report of the sample models, number for number, against golden files written before the pipeline
refactor (tests/gold/make_gold.py). Only installation fields (versions, platform, the checkout's path) are scrubbed.

The golden files were written on one machine; the suite must pass on any x86-64 machine, whose BLAS and LAPACK
kernels (OpenBLAS picks them per CPU) and thread count change the last bits of every sum. So every float is
compared at the accuracy the tool promises for its kind, never to the bit, and ints and strings exactly:

- **Singular values.** The default engine takes sigma_i = sqrt(lambda_i) of the float64 Gram matrix; its error
  model (``auditor.spectra.backend.gram_error``, docs/design.md) bounds every eigenvalue's error by
  10 sqrt(k) eps64 sigma_max^2 for a short side k. Two machines may each be that far from the exact value, so
  sigma^2 is compared to ``eig_tol(k) * sigma_max^2`` = 20 sqrt(k) eps64 sigma_max^2 (1.0e-13 sigma_max^2 at
  k = 512). For the large values that is sigma to 5e-14 sigma_max; a value far below sigma_max moves more
  (d(sigma) = d(lambda) / 2 sigma): OpenBLAS's Prescott kernels move fc2's smallest value (1.4e-5 sigma_max) by
  1.4e-13 sigma_max, 1e-8 relative to itself, while its eigenvalue stays within 5e-16 sigma_max^2. A spectrum from
  the float64 SVD (method ``svd-f64``) is compared on sigma itself, to ``eig_tol(k) * sigma_max``.
- **Energies** (cumulative sigma^2 / sum sigma^2: ``energy``, ``energy_kept``, ``energy_at_*``): each of the k
  squared values moves by at most eig_tol(k) sigma_max^2, so a partial sum and the total by at most
  k eig_tol(k) sigma_max^2 and the ratio by 2 k eig_tol(k) / stable_rank (stable_rank = sum sigma^2 / sigma_max^2).
  The absolute tolerance is the largest of these over the report's spectra (2.6e-11 for the MLP, 6.4e-12 for the
  CNN). ``error_bound`` = sqrt(1 - energy) is compared as 1 - error_bound^2 at the same tolerance.
- **Numbers derived from a spectrum**: ``frob2`` and ``stable_rank`` (sums of sigma^2) relative to the energy
  tolerance plus one eig_tol for sigma_max^2; ``effective_rank`` = exp(-sum p log p), p = sigma / sum sigma,
  relative to its first-order error sum |log p_i + H| d(sigma_i) / sum sigma under the per-value bound above.
- **Every other float** (shares, break-even ranks, compressions, settings) comes from integers in a few float64
  operations, which no BLAS touches: relative 1e-13 (hundreds of ulps: a different summation order or libm).

Ints and strings are exact: ranks, counts, verdicts and the rounded numbers in messages. That is only sound while no
golden energy sits within the tolerance of an energy target and no singular value sits within its tolerance of the
numerical-rank threshold (either could flip a rank on another machine); ``test_golden_files_have_no_knife_edge``
checks it. To check a change for machine independence, run this file under other BLAS kernels and thread counts
(README, "Development")."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

GOLD = Path(__file__).resolve().parent / "gold"
EPS64 = sys.float_info.epsilon
DTYPE_EPS = {"float32": 2.0**-23, "f32": 2.0**-23, "float64": EPS64, "f64": EPS64, "float16": 2.0**-10,
             "f16": 2.0**-10, "bfloat16": 2.0**-7, "bf16": 2.0**-7}  # the numerical rank counts sigma above max(m, n) eps
REL = 1e-13  # floats computed from integers without BLAS
ENERGY_KEYS = frozenset({"energy", "energy_kept", "energy_at_rank", "energy_at_break_even"})


def eig_tol(k: int) -> float:
    """How far two machines' sigma_i^2 may differ, relative to sigma_max^2: twice the engine's eigenvalue error model
    (10 sqrt(k) eps64 each)."""
    return 20.0 * math.sqrt(k) * EPS64


def _values(spectrum: dict[str, Any]) -> list[float]:
    return [s for row in spectrum["sigma"] for s in row]


def _sigma_moves(spectrum: dict[str, Any]) -> list[list[float]]:
    """Per value, how far sigma_i itself may move: from d(sigma^2) <= e = eig_tol(k) sigma_max^2, at most
    min(sqrt(e), e / sigma_i) (for the SVD, eig_tol(k) sigma_max)."""
    out = []
    for row in spectrum["sigma"]:
        k, smax = len(row), max(row)
        if spectrum.get("method") == "svd-f64":
            out.append([eig_tol(k) * smax] * k)
            continue
        e = eig_tol(k) * smax * smax
        out.append([min(math.sqrt(e), e / s) if s > 0 else math.sqrt(e) for s in row])
    return out


def _energy_tol(spectrum: dict[str, Any]) -> float:
    k = len(spectrum["sigma"][0]) * len(spectrum["sigma"])
    return 2.0 * k * eig_tol(len(spectrum["sigma"][0])) / spectrum["stable_rank"]


def _effective_rank_tol(spectrum: dict[str, Any]) -> float:
    """First-order relative error of exp(H): |dH| <= sum |log p_i + H| d(sigma_i) / sum sigma."""
    flat = _values(spectrum)
    moves = [m for row in _sigma_moves(spectrum) for m in row]
    total = sum(flat)
    p = [s / total for s in flat]
    h = -sum(q * math.log(q) for q in p if q > 0)
    return sum(abs(math.log(q) + h) * m for q, m in zip(p, moves) if q > 0) / total + REL


def _spectra(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: s for k, s in (report.get("spectra") or {}).items() if isinstance(s, dict) and s.get("sigma")}


@dataclass
class Tolerances:
    energy: float  # absolute, for every energy in the report (the largest over its spectra)
    spectrum: dict[str, Any] = field(default_factory=dict)  # the golden spectrum being compared, if any

    @classmethod
    def of(cls, report: dict[str, Any]) -> "Tolerances":
        return cls(max([_energy_tol(s) for s in _spectra(report).values()], default=REL))


def _float_diff(key: str, got: float, want: float, tol: Tolerances) -> bool:
    """True when two floats under ``key`` differ by more than the tool promises."""
    if not (math.isfinite(got) and math.isfinite(want)):
        return not (got == want or (math.isnan(got) and math.isnan(want)))
    if key in ENERGY_KEYS:
        return abs(got - want) > tol.energy
    if key == "error_bound":  # sqrt(1 - energy): compare the energy it comes from
        return abs(got * got - want * want) > tol.energy
    if key in ("frob2", "stable_rank") and tol.spectrum:
        allowed = tol.energy + eig_tol(len(tol.spectrum["sigma"][0]))
        return abs(got - want) > allowed * abs(want)
    if key == "effective_rank" and tol.spectrum:
        return abs(got - want) > _effective_rank_tol(tol.spectrum) * abs(want)
    return not math.isclose(got, want, rel_tol=REL, abs_tol=0.0)


def _sigma_diff(got: Any, want: dict[str, Any], where: str) -> list[str]:
    rows = want["sigma"]
    if not (isinstance(got, list) and len(got) == len(rows)
            and all(isinstance(g, list) and len(g) == len(w) for g, w in zip(got, rows))):
        return [f"{where}: shape differs from the golden one"]
    out = []
    svd = want.get("method") == "svd-f64"
    for gi, (g_row, w_row) in enumerate(zip(got, rows)):
        k, smax = len(w_row), max(w_row)
        for i, (g, w) in enumerate(zip(g_row, w_row)):
            if type(g) is not float:
                out.append(f"{where}[{gi}][{i}]: {g!r} is not a float")
            elif (abs(g - w) > eig_tol(k) * smax) if svd else (abs(g * g - w * w) > eig_tol(k) * smax * smax):
                out.append(f"{where}[{gi}][{i}]: {g!r} != {w!r} (beyond {eig_tol(k):.1e} of sigma_max"
                           f"{'' if svd else '^2 in sigma^2'})")
    return out


def _diff(got: Any, want: Any, where: str = "$", key: str = "", tol: Tolerances | None = None) -> list[str]:
    """Every difference between two JSON reports beyond the accuracy promised for its kind (module docstring);
    ints, strings, bools and None exactly, and a value's type must not change."""
    if tol is None:
        tol = Tolerances.of(want) if isinstance(want, dict) else Tolerances(REL)
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}: keys {sorted(set(got) ^ set(want))} differ"] if set(got) != set(want) else []
        if want.get("sigma") and isinstance(want["sigma"], list) and "energy" in want:  # one spectrum
            tol = Tolerances(tol.energy, want)
        for k in sorted(set(got) & set(want)):
            if k == "sigma" and tol.spectrum is want:
                out += _sigma_diff(got[k], want, f"{where}.{k}")
            else:
                out += _diff(got[k], want[k], f"{where}.{k}", k, tol)
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diff(g, w, f"{where}[{i}]", key, tol)]
    if type(got) is float and type(want) is float:
        return [f"{where}: {got!r} != {want!r}"] if _float_diff(key, got, want, tol) else []
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r} != {want!r}"]
    return []


def _golden(name: str) -> dict[str, Any]:
    return json.loads((GOLD / f"{name}.json").read_text())


def test_diff_finds_a_changed_number():
    want = _golden("mlp")
    assert _diff(want, json.loads(json.dumps(want))) == []

    def changed(edit) -> list[str]:
        got = json.loads(json.dumps(want))
        edit(got)
        return _diff(got, want)

    fc1, fc2 = want["spectra"]["fc1"], want["spectra"]["fc2"]
    smax2 = max(fc2["sigma"][0])
    small = min(range(len(fc2["sigma"][0])), key=lambda i: fc2["sigma"][0][i])  # fc2's smallest value
    mid = next(i for i, s in enumerate(fc2["sigma"][0]) if s < 0.01 * smax2)  # about 1% of sigma_max

    def sig(layer: str, i: int, by: float):
        return lambda g: g["spectra"][layer]["sigma"][0].__setitem__(i, g["spectra"][layer]["sigma"][0][i] + by)

    def at(path: list, f):
        def edit(g):
            *head, last = path
            for p in head:
                g = g[p]
            g[last] = f(g[last])
        return edit

    # a real change is found, one line each
    assert len(changed(at(["layers", 1, "params"], lambda v: v + 1))) == 1
    assert len(changed(at(["verdict"], lambda v: "PASS" if v != "PASS" else "FAIL"))) == 1
    assert len(changed(at(["layers", 1, "params"], float))) == 1  # an int turned float
    assert len(changed(sig("fc1", 3, 1e-9 * fc1["sigma"][0][3]))) == 1  # 1e-9 of a large value
    assert len(changed(sig("fc2", 0, 1e-12 * smax2))) == 1  # sigma_max itself, 1e-12
    assert len(changed(sig("fc2", mid, 1e-9 * smax2))) == 1  # 1e-9 sigma_max on a value at 1% of it
    assert len(changed(at(["spectra", "fc2", "energy", 40], lambda v: v - 1e-9))) == 1
    assert len(changed(at(["suggestions", "fc1", "energy_at_rank"], lambda v: v + 1e-9))) == 1
    assert len(changed(at(["suggestions", "fc1", "error_bound"], lambda v: v + 1e-9))) == 1
    assert len(changed(at(["spectra", "fc2", "stable_rank"], lambda v: v * (1 + 1e-9)))) == 1
    assert len(changed(at(["spectra", "fc2", "frob2"], lambda v: v * (1 + 1e-9)))) == 1
    assert len(changed(at(["spectra", "fc1", "effective_rank"], lambda v: v * (1 + 1e-9)))) == 1
    assert len(changed(at(["spectra", "fc2", "effective_rank"], lambda v: v * (1 + 1e-7)))) == 1
    assert len(changed(at(["layers", 1, "share"], lambda v: v * (1 + 1e-11)))) == 1
    # what another machine's BLAS does is not
    assert changed(sig("fc2", small, 1e-15 * smax2)) == []
    assert changed(sig("fc2", small, 1.4e-13 * smax2)) == []  # OpenBLAS Prescott kernels, measured
    assert changed(sig("fc2", 0, 4e-14 * smax2)) == []
    assert changed(at(["spectra", "fc2", "energy", 40], lambda v: v + 1e-12)) == []
    assert changed(at(["suggestions", "fc1", "error_bound"], lambda v: v * (1 + 1e-14))) == []
    assert changed(at(["layers", 1, "share"], lambda v: v * (1 + 1e-15))) == []


@pytest.mark.parametrize("scenario", sorted(p.stem for p in GOLD.glob("*.json")))
def test_golden_files_have_no_knife_edge(scenario):
    """Ranks are compared exactly, so no golden value may sit where the promised accuracy could flip one: an
    energy within the tolerance of an energy target (ranks_for, suggested and planned ranks), or sigma / sigma_max
    within a value's own tolerance of the numerical-rank threshold max(m, n) eps of the weight's dtype."""
    from gold.make_gold import SCENARIOS

    want = _golden(scenario)
    tol = Tolerances.of(want)
    st = want["meta"]["settings"]
    _, plan = SCENARIOS[scenario]
    targets = {*st["energy_targets"], st["target_energy"], st["energy_floor"]} | {
        float(v.split(":")[1]) for v in (plan or {}).get("ranks", {}).values() if str(v).startswith("energy:")}
    layers = {l["name"]: l for l in want["layers"]}
    assert tol.energy < 1e-10
    for name, sp in _spectra(want).items():
        near = [(t, e) for e in sp["energy"][:-1] for t in targets if abs(e - t) <= 10 * tol.energy]
        assert near == [], f"{scenario} {name}: energy on a target {near}"
        layer = layers.get(name) or next(l for l in want["layers"] if l["param"] == name)
        cut = max(layer["m"], layer["n"]) * DTYPE_EPS[layer["dtype"]]
        for row, moves in zip(sp["sigma"], _sigma_moves(sp)):
            smax = max(row)
            assert all(abs(s - cut * smax) > 10 * m for s, m in zip(row, moves)), f"{scenario} {name}: rank cut"


@pytest.mark.parametrize("scenario", sorted(p.stem for p in GOLD.glob("*.json")))
def test_json_matches_the_golden_file(scenario):
    from gold.make_gold import run

    want = _golden(scenario)
    got = json.loads(json.dumps(run(scenario)))
    assert _diff(got, want) == []
