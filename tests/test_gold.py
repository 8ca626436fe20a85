"""The JSON report of the sample models, number for number, against golden files written before the pipeline
refactor (tests/gold/make_gold.py). Only installation fields (versions, platform, the checkout's path) are scrubbed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

GOLD = Path(__file__).resolve().parent / "gold"


def _diff(got: Any, want: Any, where: str = "$") -> list[str]:
    """Every difference between two JSON values. Floats agree to 1e-12 relative (the last bits of a BLAS sum may
    follow the thread count); everything else, ints and strings included, exactly."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}: keys {sorted(set(got) ^ set(want))} differ"] if set(got) != set(want) else []
        for k in sorted(set(got) & set(want)):
            out += _diff(got[k], want[k], f"{where}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diff(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, float) and not isinstance(got, bool):
        return [] if math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300) else [f"{where}: {got!r} != {want!r}"]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r} != {want!r}"]
    return []


def test_diff_finds_a_changed_number():
    want = json.loads((GOLD / "mlp.json").read_text())
    got = json.loads(json.dumps(want))
    got["layers"][1]["params"] += 1
    got["spectra"]["fc1"]["sigma"][0][3] *= 1 + 1e-9
    got["verdict"] = "PASS"
    assert len(_diff(got, want)) == 3
    assert _diff(want, want) == []


@pytest.mark.parametrize("scenario", sorted(p.stem for p in GOLD.glob("*.json")))
def test_json_matches_the_golden_file(scenario):
    from gold.make_gold import run

    want = json.loads((GOLD / f"{scenario}.json").read_text())
    got = json.loads(json.dumps(run(scenario)))
    assert _diff(got, want) == []
