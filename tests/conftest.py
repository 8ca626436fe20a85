from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sample_models"))  # the sample models' module, `digits`, for every test
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`'s workers share the cores: one torch thread each, and
    os.environ["OMP_NUM_THREADS"] = "1"  # the command lines they start inherit it (before torch is imported)
    os.environ["MKL_NUM_THREADS"] = "1"


# `make test` hands out whole files (--dist loadfile) in collection order (--no-loadscope-reorder): these files, the
# longest serially (their module fixtures are whole calibrated audits; measured with --durations), go first, so the
# two workers share them and finish together instead of one starting a long file while the other has none left.
LONGEST_FIRST = ("tests/test_report_consistency.py", "tests/corpus/test_corpus.py", "tests/test_ties.py",
                 "tests/test_plan_holds.py", "tests/test_md_render.py", "tests/test_report_pdf_bounds.py",
                 "tests/test_checkpoints.py", "tests/test_speed.py", "tests/test_hardening_round5_edges2.py",
                 "tests/test_hardening_round5_exec.py", "tests/test_integrations.py",
                 "tests/test_sequential_fit.py")  # the char transformer's factorize, command and library


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))  # stable: the rest as found


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LOWRANK_AUDITOR_CACHE", str(tmp_path_factory.getbasetemp() / "spectra-cache"))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "auditor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=e, timeout=600)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_inproc(capsys, monkeypatch):
    """The command line's main() in this process: the same exit codes and output, without a new interpreter
    starting torch each time. Subprocess tests (``cli``) still cover the real process boundary."""
    from auditor.cli import main

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.chdir(cwd or ROOT)
            code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), int(code), out, err)

    return run


@pytest.fixture(scope="session")
def digits_mlp():
    from digits import mlp

    return mlp()


@pytest.fixture(scope="session")
def digits_images(tmp_path_factory) -> Path:
    """Every digits image (1,797 rows of 64 pixels in [0, 1]) as a calibration file, written once per session."""
    import torch
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


@pytest.fixture(scope="session")
def digits_cnn():
    from digits import cnn

    return cnn()


@pytest.fixture(autouse=True)
def _sigint_as_python_sets_it():
    """Every test starts with Python's own Ctrl-C handler (KeyboardInterrupt), whatever an earlier test or library
    installed: the Ctrl-C tests send a real SIGINT, and a handler left behind would swallow it."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test, as ``OMP_NUM_THREADS=1`` would run it: a timing test of the timer's
    own logic (fake clocks, refusals, retries) counts its measurements without the one-thread cross-check that a
    multi-threaded process adds (CI runs torch with every core)."""
    from auditor.speed.layer_timing import one_thread as pinned

    with pinned():
        yield
