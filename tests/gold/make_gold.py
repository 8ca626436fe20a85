"""Write the golden JSON reports of the sample models (run once, from the repository root, before a refactor):

    PYTHONPATH=. python tests/gold/make_gold.py

Each scenario audits a sample model from sample_models/ (digits.py, chargpt.py) and stores ``to_dict(with_sigma=True)`` with the
environment and version fields scrubbed; tests/test_gold.py compares the current code with these files number for
number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# scenario name -> (factory, plan or None)
SCENARIOS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "mlp": ("mlp", None),
    "mlp-plan": ("mlp", {"finetune": "", "ranks": {"fc1": 24, "fc2": "0.5be", "fc3": "energy:0.9", "head": 9}}),
    "cnn": ("cnn", None),
    "cnn-plan": ("cnn", {"finetune": "1 epoch", "ranks": {"fc1": 24, "conv1": 4, "conv2": "energy:0.95"}}),
    # weights only: the MLP's checkpoint without its code (no graph, no MACs)
    "mlp-weights": ("sample_models/digits_mlp.safetensors", {"ranks": {"fc1.weight": 16}}),
    # the char transformer (sample_models/chargpt.py): attention, tied embedding, layer norms
    "chargpt": ("chargpt:chargpt", None),
}


def scrub(data: dict[str, Any]) -> dict[str, Any]:
    """Drop what depends on the installation, not on the code: the tool's and libraries' versions, the platform.
    (The spectrum cache is off, so spectrum methods and spectra_stats are deterministic and kept.)"""
    meta = data["meta"]
    meta.pop("version", None)
    meta.pop("environment", None)
    meta["source"] = meta["source"].replace(str(ROOT) + "/", "")  # a checkout's path
    return data


def run(name: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "sample_models"))
    import digits

    import auditor

    factory, plan = SCENARIOS[name]
    if ":" in factory:
        import importlib

        mod, fn = factory.split(":")
        model, inputs = getattr(importlib.import_module(mod), fn)()
    elif factory.endswith(".safetensors"):
        from auditor.sources import load_source

        model, inputs = load_source(str(ROOT / factory)).model, None
    else:
        model, inputs = getattr(digits, factory)()
    if hasattr(auditor, "AuditOptions"):
        a = auditor.audit(model, inputs, plan=plan, options=auditor.AuditOptions(cache=False, progress=False))
    else:  # the code before the pipeline refactor
        a = auditor.audit(model, inputs, plan=plan, cache=False, progress=False)
    return scrub(a.to_dict(with_sigma=True))


if __name__ == "__main__":
    for scenario in sys.argv[1:] or SCENARIOS:
        (HERE / f"{scenario}.json").write_text(json.dumps(run(scenario), indent=1, sort_keys=True) + "\n")
        print("wrote", scenario)
