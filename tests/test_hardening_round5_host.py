"""Hardening round 5 (issue 39), the host's share: a library call leaves its host process as it found it (torch's
random state, glibc's allocator), names cannot forge lines or workflow commands in any text format, no status says
PASS over nothing, a user metric cannot change the model it measures, and every exit code is the one promised.
Each case failed on main at 225cdcf."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import auditor
import auditor._env as env_mod
import auditor.calibration.session as session_mod

ROWS = 400
MODEL = "sample_models/digits.py:mlp"


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:ROWS], dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits_calib.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


class _Libc:
    """A stand-in for glibc that records every call made through it (timing-free)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, *args):
        self.calls.append(("mallopt", *args))
        return 1

    def malloc_trim(self, *args):
        self.calls.append(("malloc_trim", *args))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = _Libc()
    monkeypatch.setattr(session_mod, "_LIBC", fake)
    monkeypatch.setattr(env_mod, "_OWNS_PROCESS", False, raising=False)  # a library host, whatever an in-process CLI test did
    return fake


# ---- 1. a library that changes its host -------------------------------------------------------------------------

def _host_state():
    return torch.get_rng_state().clone(), torch.initial_seed(), torch.get_num_threads()


def test_audit_with_calibration_leaves_torch_random_state_and_allocator_as_found(libc, calib, digits_mlp):
    torch.manual_seed(1234)
    torch.rand(3)  # a stream part-way through
    before = _host_state()
    auditor.audit(digits_mlp[0], torch.zeros(1, 64), plan={"ranks": {"fc1": 24}}, calibration=calib,
                  cache=False, progress=False)
    after = _host_state()
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:] == (1234, before[2])
    assert not [c for c in libc.calls if c[0] == "mallopt"]  # the host's mmap threshold untouched


def test_audit_source_of_a_factory_leaves_the_seed(libc):
    torch.manual_seed(77)
    state = torch.get_rng_state().clone()
    auditor.audit_source(MODEL, options=auditor.AuditOptions(spectra=False, progress=False))  # the factory seeds 0
    assert torch.initial_seed() == 77 and torch.equal(torch.get_rng_state(), state)


def test_recover_and_factorize_leave_torch_random_state(libc, calib, digits_mlp):
    from auditor.calibration import load_calibration
    from auditor.calibration.recovery import recover

    model = digits_mlp[0]
    torch.manual_seed(4321)
    state = torch.get_rng_state().clone()
    f = auditor.factorize(model, {"fc1": 8}, calibration=calib)
    recover(f, model, load_calibration(calib, model, 0.25), steps=2, seed=9)
    assert torch.initial_seed() == 4321 and torch.equal(torch.get_rng_state(), state)
    assert not [c for c in libc.calls if c[0] == "mallopt"]


def test_the_command_line_process_still_maps_large_arrays(libc, calib, cli_inproc, tmp_path):
    r = cli_inproc(MODEL, "--calibration", calib, "--no-cache", "--format", "json", "-o", tmp_path / "r.json")
    assert r.returncode in (0, 1), r.stderr
    assert ("mallopt", -3, 1 << 20) in libc.calls  # the tool's own process: the tuning is allowed there
