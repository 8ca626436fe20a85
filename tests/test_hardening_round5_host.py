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

ROWS = 400
MODEL = "sample_models/digits.py:mlp"
ROOT_MODEL = Path(__file__).resolve().parents[1] / MODEL


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
    monkeypatch.setattr(env_mod, "_LIBC", fake)
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


def test_the_command_line_called_from_a_host_leaves_its_allocator_alone(libc, calib, cli_inproc, tmp_path):
    """``auditor.cli.main(argv)`` called from Python (a notebook, this test run) is a library call: the process is
    not the tool's own, so no mmap threshold is set (it stayed set for the rest of a host's life, 2.5x this suite's
    time); ``lowrank-audit`` itself (``main()``, no argv) owns its process."""
    import auditor._env as env

    r = cli_inproc("sample_models/digits.py:mlp", "-q", "--no-spectra", "--calibration", calib, "--no-cache")
    assert r.returncode in (0, 1), r.stderr
    assert not env.owns_process() and not [c for c in libc.calls if c[0] == "mallopt"]


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


def test_the_command_line_process_still_maps_large_arrays(libc, calib, tmp_path, monkeypatch, capsys):
    """``lowrank-audit`` (``main()`` as the process's entry point, reading sys.argv) owns its process: the tuning is
    allowed there."""
    import signal

    from auditor.cli import main

    monkeypatch.setattr(sys, "argv", ["lowrank-audit", MODEL, "--calibration", str(calib), "--no-cache", "--format",
                                      "json", "-o", str(tmp_path)])
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert main() in (0, 1), capsys.readouterr().err
    finally:
        signal.signal(signal.SIGINT, handler)
    assert ("mallopt", -3, 1 << 20) in libc.calls


# ---- 2. names that forge output ---------------------------------------------------------------------------------

EVIL_MODEL = '''
import torch
from torch import nn

NAMES = ["fc\\nPASS: all good", "g\\n::error::FORGED", "x\\x07\\r\\x1b[31m\\u202e"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        for name in NAMES:
            self.add_module(name, nn.Linear(64, 64))

    def forward(self, x):
        for m in self.children():
            x = torch.relu(m(x))
        return x


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.h:
            x = b(x)
        return x


def model():
    torch.manual_seed(0)
    return M()
'''
RAW = ("\x07", "\x1b", "\r", "\u202e")


def _forged(text: str) -> list[str]:
    """Lines a name wrote on its own, raw control characters, and workflow commands the tool did not write."""
    bad = [l for l in text.split("\n") if l.startswith(("PASS: all good", "::error::FORGED"))]
    bad += [repr(c) for c in RAW if c in text]
    bad += [l for l in text.split("\n") if l.startswith("::") and not l.startswith(("::warning ", "::notice "))]
    return bad


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("evil")
    (d / "evil.py").write_text(EVIL_MODEL)
    (d / "plan.toml").write_text('[ranks]\n"*" = 8\n')
    return d


def test_names_cannot_forge_lines_in_the_table_the_txt_report_or_github_annotations(evil, cli_inproc):
    """The speed section and the plan's ranks by group printed names raw: "PASS: all good" and a workflow
    command ``::error::FORGED`` on lines of their own in ``--format text,github``, BEL/CR/ESC/U+202E raw."""
    out = evil / "reports"  # one timed run: the table and the annotations on stdout, the reports in files
    r = cli_inproc(evil / "evil.py:model", "--input-shape", "1,64", "--plan", evil / "plan.toml", "--measure-speed",
                   "--format", "text,github,md,json", "-o", out, "--fail-on", "never")
    assert r.returncode == 0, r.stderr
    assert "h.0.fc\\nPASS: all good" in r.stdout and "ranks: h.*.fc\\nPASS: all good ×3: 8" in r.stdout
    assert "::" in r.stdout  # the annotations are there, each on its own line
    assert _forged(r.stdout) == [] and _forged(r.stderr) == []
    txt, md = (next(out.glob(f"*{s}")).read_text() for s in (".txt", ".md"))
    assert _forged(txt) == [] and _forged(md) == []
    assert "`h.*.fc\\nPASS: all good` ×3" in md  # (the speed table names h.0.fc only where timings were accepted)
    data = json.loads(next(out.glob("*.json")).read_text())
    assert "h.0.fc\nPASS: all good" in {l["name"] for l in data["layers"]}  # JSON keeps the name as it is


def test_progress_notes_show_names_as_escapes():
    import io

    from auditor.progress import _Plain

    buf = io.StringIO()
    line = _Plain("statistics", 3, "block", 0.0, buf)
    line.note = "h.0.fc\nPASS: all good\x1b[2J"
    line.close(99.0)
    assert buf.getvalue() == "statistics: 3 blocks in 99.0s (h.0.fc\\nPASS: all good\\x1b[2J)\n"


# ---- 4. a metric that changes the model -------------------------------------------------------------------------

METRICS = '''
import random
import sys

import torch

_REF = {}


def agree(model, batches):
    outs = [model(**b) if isinstance(b, dict) else model(b) for b in batches]
    if not _REF:
        _REF["y"] = [o.argmax(-1) for o in outs]
    return sum(float((o.argmax(-1) == y).float().mean()) for o, y in zip(outs, _REF["y"])) / len(outs)


def _last_linear(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]


def scales(model, batches):
    with torch.no_grad():
        _last_linear(model).weight.mul_(1.01)
    return agree(model, batches)


def data_scales(model, batches):
    _last_linear(model).weight.data.mul_(1.01)
    return agree(model, batches)


def buffer(model, batches):
    model.register_buffer("seen", torch.zeros(1))
    return agree(model, batches)


def hooks(model, batches):
    _last_linear(model).register_forward_hook(lambda m, i, o: o * 2)
    return agree(model, batches)


def replaces(model, batches):
    model.act = torch.nn.Identity()
    return agree(model, batches)


def trains(model, batches):
    model.train()
    return agree(model, batches)


def noisy(model, batches):
    return agree(model, batches) + random.random()


def raises(model, batches):
    raise ValueError("boom")


def exits(model, batches):
    sys.exit(0)
'''


@pytest.fixture(scope="module")
def metric_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("metric") / "metrics.py"
    f.write_text(METRICS)
    return f


@pytest.mark.parametrize(("fn", "says"), [
    ("scales", "metric scales changed the model it measures (head.weight)"),
    ("data_scales", "metric data_scales changed the model it measures (head.weight)"),
    ("buffer", "metric buffer changed the model it measures (seen)"),
    ("hooks", "metric hooks changed the model it measures (module head)"),
    ("replaces", "metric replaces changed the model it measures (module act)"),
    ("trains", "metric trains changed the model it measures (module (root))"),
    ("noisy", "metric noisy is not repeatable: "),
    ("raises", "metric raises raised ValueError: boom (at {file}:57)"),
    ("exits", "metric exits called sys.exit(0) instead of returning"),
])
def test_a_metric_that_changes_the_model_or_is_not_repeatable_is_refused(fn, says, metric_file, calib, cli_inproc,
                                                                       tmp_path):
    out = tmp_path / "out"
    r = cli_inproc(MODEL, "--calibration", calib, "--metric", f"{metric_file}:{fn}", "--no-cache", "--progress",
                   "never", "--format", "text", "-o", out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + says.format(file=metric_file)), r.stderr
    assert not out.exists()


def test_factorize_never_writes_a_metric_mutated_model(metric_file, calib, cli_inproc, tmp_path):
    (tmp_path / "plan.toml").write_text('[ranks]\nfc1 = 24\n')
    r = cli_inproc("factorize", MODEL, "--plan", tmp_path / "plan.toml", "--calibration", calib, "--metric",
                   f"{metric_file}:scales", "-o", tmp_path / "f")
    assert r.returncode == 2 and "changed the model it measures" in r.stderr
    assert not (tmp_path / "f").exists()


def test_a_clean_metric_still_passes(metric_file, calib, cli_inproc, tmp_path):
    r = cli_inproc(MODEL, "--calibration", calib, "--metric", f"{metric_file}:agree", "--no-cache", "--progress",
                   "never", "--format", "json", "-o", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(next(tmp_path.glob("*.json")).read_text())["calibration"]["metric"] == "agree"


# ---- 5. exit codes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [(MODEL,), ("factorize", MODEL, "--plan", "PLAN", "-o", "OUT")])
def test_no_split_with_a_confidence_level_is_refused(command, calib, cli_inproc, tmp_path):
    (tmp_path / "plan.toml").write_text("[ranks]\nfc1 = 24\n")
    args = [str(tmp_path / "plan.toml") if a == "PLAN" else str(tmp_path / "out") if a == "OUT" else a
            for a in command]
    r = cli_inproc(*args, "--calibration", calib, "--no-split", "--confidence", "0.5")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --confidence 0.5 means nothing with --no-split (no rows are kept apart to verify on, so no interval "
        "is drawn). Drop one of --confidence and --no-split."]
    assert not (tmp_path / "out").exists()


LOOSE = "[ranks]\nfc1 = 8\n\n[thresholds]\nenergy_floor = 1e-9\n"
UNMEASURED = '[ranks]\nfc1 = 8\n\n[thresholds]\nenergy_floor = 0.95\nfail_on = "unmeasured"\n'


@pytest.mark.parametrize("command", [(MODEL, "--plan", "PLAN"), ("check-plan", "PLAN"),
                                     ("check-plan", "PLAN", "--model", MODEL)])
def test_a_plan_cannot_loosen_energy_floor_to_silence_lr004(command, cli_inproc, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(LOOSE)
    r = cli_inproc(*[str(plan) if a == "PLAN" else str(ROOT_MODEL) if a == MODEL else a for a in command], cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: plan {plan}: its [thresholds] loosens energy_floor from 0.9 to 1e-09, which "
                               "would silence the review of this very plan.")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_plan_may_loosen_energy_floor_where_pyproject_allows_it(cli_inproc, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.lowrank-auditor]\nplan_may_relax_review = true\n")
    (tmp_path / "plan.toml").write_text(LOOSE)
    r = cli_inproc("check-plan", tmp_path / "plan.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(("command", "code"), [((MODEL, "--plan", "PLAN"), 1), (("check-plan", "PLAN"), 0),
                                               (("check-plan", "PLAN", "--model", MODEL), 0),
                                               (("factorize", MODEL, "--plan", "PLAN", "-o", "OUT"), 0)])
def test_fail_on_unmeasured_in_a_plan_with_thresholds_is_no_internal_error(command, code, cli_inproc, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text(UNMEASURED)
    r = cli_inproc(*[str(plan) if a == "PLAN" else str(tmp_path / "out") if a == "OUT" else str(ROOT_MODEL) if a == MODEL
                     else a for a in command], cwd=tmp_path)
    assert r.returncode == code, r.stderr
    assert "internal error" not in r.stderr


def test_fail_on_unmeasured_in_pyproject_with_plan_thresholds(cli_inproc, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.lowrank-auditor]\nfail_on = "unmeasured"\n')
    plan = tmp_path / "plan.toml"
    plan.write_text("[ranks]\nfc1 = 8\n\n[thresholds]\nenergy_floor = 0.95\n")
    r = cli_inproc(str(ROOT_MODEL), "--plan", plan, cwd=tmp_path)
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    r = cli_inproc("check-plan", plan, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_the_emitted_recovery_command_carries_the_objective_the_audit_used(calib):
    """"auto" resolved to "mse" for a regression head: the command said auto, and factorize's auto may resolve to
    another objective (KL) for the model it is given."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1))
    a = auditor.audit(m, torch.zeros(1, 64), calibration=calib, budget=0.3, recover_steps=2, cache=False,
                      progress=False)
    rc = a.calibration.budget.recovery
    assert rc.objective == "mse"
    assert rc.command().endswith("--recover-objective mse")


# ---- 3. words that say PASS over nothing --------------------------------------------------------------------------

def test_a_plan_that_misses_is_never_pass_when_select_hides_the_rule(calib, cli_inproc, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.lowrank-auditor]\nselect = ["LR001"]\nfail_on = "unmeasured"\n')
    (tmp_path / "plan.toml").write_text("[ranks]\nfc1 = 2\nfc2 = 2\nfc3 = 2\n")
    r = cli_inproc(ROOT_MODEL, "--plan", tmp_path / "plan.toml", "--calibration", calib, "--progress", "never",
                   cwd=tmp_path)
    assert r.returncode == 1, r.stdout
    verdict = [l for l in r.stdout.splitlines() if l.startswith(("PASS", "REVIEW", "FAIL", "UNMEASURED"))]
    assert verdict and verdict[0].startswith("REVIEW: no errors or warnings shown, but the plan measured all at once")
    assert "REVIEW: no errors or warnings shown, but the plan measured all at once misses the tolerance" in \
        " ".join(r.stdout.split())  # the line as written, wrapped at whatever width the terminal has
    assert "PASS" not in r.stdout


def test_one_held_out_row_is_no_verification(tmp_path, digits_mlp):
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    from auditor.verdict.policy import Status, status

    x = torch.tensor(load_digits().data[:4], dtype=torch.float32) / 16.0
    save_file({"x": x.contiguous()}, str(tmp_path / "four.safetensors"))
    a = auditor.audit(digits_mlp[0], torch.zeros(1, 64), plan={"ranks": {"fc1": 24}},
                      calibration=tmp_path / "four.safetensors", cache=False, progress=False,
                      settings=auditor.Settings(select=("LR001",)))
    v = a.calibration.plan_check.verification
    assert v is None or v.rows <= 1
    assert status(a) is Status.UNMEASURED if v is not None else status(a) is not Status.PASS


class _WordTokenizer:
    """One id per whitespace-separated word; records the length of every text it is given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, text, **_):
        self.seen.append(len(text))
        return {"input_ids": [len(w) for w in text.split()]}


def test_a_long_single_line_text_is_tokenized_in_bounded_pieces_and_stops_at_the_cap():
    from auditor.calibration.data.text import PIECE, token_ids

    text = "abc " * (5 * PIECE // 4)  # 5 MiB on one line
    tok = _WordTokenizer()
    assert token_ids(tok, text, need=1000)[:3] == [3, 3, 3]
    assert len(tok.seen) == 1 and tok.seen[0] <= PIECE  # one piece, then stop
    tok = _WordTokenizer()
    ids = token_ids(tok, text)
    assert len(ids) == 5 * PIECE // 4 and max(tok.seen) <= PIECE and len(tok.seen) >= 5  # every word, no word split
