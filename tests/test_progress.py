"""Progress lines only on a terminal or when forced, never on stdout; torch's logging captured while tracing."""

from __future__ import annotations

import io
import re
import logging
import sys
import warnings

import pytest
import torch
from torch import nn

from auditor.progress import CapturedLog, Progress, _ListHandler, quiet_torch_logging


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_phases(p: Progress) -> None:
    with p.phase("load"):
        pass
    with p.phase("spectra", total=40):
        for i in range(1, 41):
            p.update(i, 40)
    with p.phase("render"):
        p.update(1)  # no total: ignored, never an error


def test_not_a_tty_writes_nothing():
    buf = io.StringIO()
    p = Progress(stream=buf)
    assert not p.enabled
    run_phases(p)
    assert buf.getvalue() == ""
    assert set(p.timings) == {"load", "spectra", "render"}  # timed even when silent


def test_forced_phases_appear_on_the_given_stream(capsys):
    buf = io.StringIO()
    p = Progress(enabled=True, stream=buf)
    run_phases(p)
    text = buf.getvalue()
    lines = [l for l in text.replace("\r", "\n").splitlines() if l.strip()]
    assert any(l.startswith("load ") and l.rstrip().endswith("s") for l in lines)
    assert any(l.startswith("spectra") and "40/40" in l for l in lines)
    assert text.index("load") < text.index("spectra") < text.index("render")
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_tty_enables_and_false_disables():
    assert Progress(stream=FakeTTY()).enabled
    tty = FakeTTY()
    p = Progress(enabled=False, stream=tty)
    run_phases(p)
    assert tty.getvalue() == ""


def test_stdout_is_refused_and_phases_do_not_nest():
    with pytest.raises(ValueError, match="never to stdout"):
        Progress(enabled=True, stream=sys.stdout)
    p = Progress(enabled=True, stream=io.StringIO())
    with pytest.raises(RuntimeError, match="inside phase"):
        with p.phase("trace"):
            with p.phase("spectra"):
                pass


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # torch.export cannot guard on this: it logs a warning with the FX graph, then raises
            return y
        return -y


def failing_export() -> str:
    try:
        torch.export.export(DataDependent(), (torch.randn(2, 4),), strict=False)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return "no error"


def test_torch_export_failure_is_captured_not_printed(capfd):
    with quiet_torch_logging() as log:
        assert failing_export() == "GuardOnDataDependentSymNode"
        torch.tensor(torch.ones(2))  # a real torch UserWarning ("To copy construct from a tensor ...")
        print("printed by a pass", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert "torch.fx.experimental.symbolic_shapes" in log.text and "def forward(self" in log.text
    assert "To copy construct from a tensor" in log.text and "printed by a pass" in log.stderr
    assert isinstance(log, CapturedLog) and log
    # the loggers are restored: the same failure outside the block reaches stderr again (the control)
    assert failing_export() == "GuardOnDataDependentSymNode"
    assert "def forward(self" in capfd.readouterr().err
    assert logging.getLogger("torch").handlers and not any(
        isinstance(h, _ListHandler) for h in logging.getLogger("torch._dynamo").handlers)


@pytest.mark.parametrize("how", ["TORCH_LOGS", "enabled=False"])
def test_quiet_respects_torch_logs_and_disabled(how, monkeypatch, capfd):
    if how == "TORCH_LOGS":
        monkeypatch.setenv("TORCH_LOGS", "+dynamo")
    with quiet_torch_logging(enabled=False if how == "enabled=False" else None) as log:
        print("shown", file=sys.stderr)
        handlers = logging.getLogger("torch._dynamo").handlers  # torch's own, bound to the stderr of its import
        logging.getLogger("torch._dynamo").warning("dynamo says")
    assert handlers and not any(isinstance(h, _ListHandler) for h in handlers)
    assert not log and log.text == "" and "shown" in capfd.readouterr().err


def test_a_phase_without_a_total_counts_when_told_and_shows_no_eta():
    buf = io.StringIO()
    p = Progress(enabled=True, stream=buf)
    with p.phase("tier 3 plan search", unit="plan"):
        p.update(1)
    assert re.fullmatch(r"tier 3 plan search: 1 plan \d+\.\ds", _lines(buf.getvalue())[-1])  # singular
    with p.phase("tier 3 plan search", unit="plan"):
        p.update(2)
        p.update(5, note="last held")
    lines = _lines(buf.getvalue())
    assert lines[-1].startswith("tier 3 plan search: 5 plans, last held ") and lines[-1].endswith("s")
    assert not any("%" in l or "<" in l for l in lines)  # no bar, no ETA: the count is not known
    with p.phase("trace"):  # the next phase without a count is a plain timed line again
        pass
    assert buf.getvalue().replace("\r", "\n").splitlines()[-1].startswith("trace ")


# ---- progress through a calibrated audit (issue 21): every calibration phase with its counts -------------------
CAL_ROWS = 800  # 600 fit rows: fc1 (64 wide), fc2 and fc3 (512 wide) span their inputs and are swept; head is narrow


@pytest.fixture(scope="module")
def digits_calibration(tmp_path_factory):
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:CAL_ROWS], dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits_calib.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


def _lines(text: str) -> list[str]:
    return [l.strip() for l in text.replace("\r", "\n").splitlines() if l.strip()]


def _last(lines: list[str], phase: str) -> str:
    """The phase's final line (tqdm redraws it in place; the last drawing stays on the terminal)."""
    found = [l for l in lines if l.startswith(phase + ":") or l.startswith(phase + " ")]
    assert found, f"no {phase!r} line in {lines}"
    return found[-1]


def test_a_calibrated_audit_reports_every_calibration_phase(digits_calibration, digits_mlp, tmp_path, capfd,
                                                             monkeypatch):
    from threadpoolctl import threadpool_limits

    import auditor
    from auditor.calibration import load_calibration

    model, x = digits_mlp
    calls: list[tuple[str, int, int | None, str | None]] = []  # every update, whether tqdm redraws it or not
    update = Progress.update

    def spy(self, done, total=None, note=None):
        calls.append((self._bar.desc if self._bar is not None else "", done, total, note))
        update(self, done, total, note)

    monkeypatch.setattr(Progress, "update", spy)
    with threadpool_limits(limits=1, user_api="blas"):
        a = auditor.audit(model, x, calibration=digits_calibration, measure_floor=True, progress=True,
                          cache_dir=tmp_path / "cache")
    out, err = capfd.readouterr()
    assert out == ""
    lines = _lines(err)
    cr = a.calibration
    fit = len(load_calibration(digits_calibration, model, 0.25).fit)
    assert fit == 19  # 600 fit rows in batches of 32
    swept = [n for n, lc in cr.layers.items() if lc.floor is not None]
    assert sorted(swept) == ["fc1", "fc2", "fc3"]
    sweep_evals = sum(len(cr.layers[n].floor.points) for n in swept)
    plans = cr.budget.evaluations
    u = cr.budget.uniform  # the uniform baseline: one measurement a plan beside it, one more on the verification
    uniform = sum(p.uniform is not None for p in cr.budget.plans) + int(u is not None and u.verification is not None)
    assert uniform >= 2
    verified = cr.evaluations - sweep_evals - plans - uniform  # plans verified on rows the search never read
    assert sweep_evals > 3 and plans >= 2 and 1 <= verified <= 6 and cr.budget.verification is not None

    assert _last(lines, "calibration data").endswith("s")
    assert f"| {fit}/{fit} [" in _last(lines, "statistics")
    assert "| 4/4 [" in _last(lines, "tier 1 spectra")  # every layer with statistics, head included
    t2 = _last(lines, "tier 2 floors")
    assert "| 3/3 [" in t2 and t2.endswith(f", {sweep_evals} evaluations]")
    # the evaluations are counted as they run, one by one within a layer, and once more as each layer ends
    t2 = [(done, total, note) for phase, done, total, note in calls if phase == "tier 2 floors"]
    evals = [int(n.split()[0]) for _, _, n in t2]
    assert len(t2) == 1 + sweep_evals + 3 and evals[0] == 0 and evals == sorted(evals)
    assert set(evals) == set(range(sweep_evals + 1)) and {t for _, t, _ in t2} == {3}
    assert [d for d, _, _ in t2] == sorted(d for d, _, _ in t2) and t2[-1][0] == 3
    assert [d for phase, d, _, _ in calls if phase == "tier 3 plan search"] == list(range(1, plans + 1))
    assert [d for phase, d, _, _ in calls if phase == "statistics"] == list(range(1, fit + 1))
    # the spectra are computed with the statistics (block by block as each block's statistics complete; this MLP
    # has no blocks, so after its one pass): the tier 1 phase reports them done at once
    assert [d for phase, d, _, _ in calls if phase == "tier 1 spectra"] == [4]
    assert re.fullmatch(rf"tier 3 plan search: {plans} plans \d+\.\ds", _last(lines, "tier 3 plan search"))
    assert _last(lines, "plan check").endswith("s")
    # the counted phases have an ETA while they run ("elapsed<remaining"); the plan search has none
    assert re.search(r"statistics: +\d+%\|.*\| \d+/19 \[\d\d:\d\d<\d\d:\d\d", err)
    assert not any("<" in l for l in lines if l.startswith("tier 3"))
    order = ["trace", "spectra", "calibration data", "statistics", "tier 1 spectra", "tier 2 floors",
             "tier 3 plan search", "plan check"]
    assert [err.index(p) for p in order] == sorted(err.index(p) for p in order)

    # the second run reads the statistics from the cache and says so
    with threadpool_limits(limits=1, user_api="blas"):
        b = auditor.audit(model, x, calibration=digits_calibration, progress=True, cache_dir=tmp_path / "cache")
    lines = _lines(capfd.readouterr().err)
    assert b.calibration.statistics_cached
    assert f"| {fit}/{fit} [" in _last(lines, "statistics") and _last(lines, "statistics").endswith(", cached]")
    assert not any(l.startswith("tier 2") for l in lines)  # no --measure-floor: no sweep


@pytest.mark.parametrize("progress", [False, None])  # off, and the default when stderr is not a terminal
def test_a_calibrated_audit_without_progress_writes_nothing(progress, digits_calibration, digits_mlp, capfd):
    import auditor

    model, x = digits_mlp
    a = auditor.audit(model, x, calibration=digits_calibration, measure_floor=True, progress=progress, cache=False)
    assert a.calibration.measured_floors and a.calibration.budget.evaluations >= 2  # the phases ran
    assert capfd.readouterr() == ("", "")


def test_recovery_steps_are_a_phase_with_the_running_loss(digits_calibration, digits_mlp, capsys):
    from auditor.calibration import load_calibration
    from auditor.factorize import factorize
    from auditor.cli.recovery_flags import cli_recover

    model = digits_mlp[0]
    cal = load_calibration(digits_calibration, model, 0.25)
    settings = {"steps": 10, "lr": 1e-3, "trainable": "factors", "objective": "auto"}
    buf = io.StringIO()
    entry = cli_recover(settings, factorize(model, {"fc1": 8}), model, cal, None, bar=Progress(enabled=True, stream=buf))
    lines = _lines(buf.getvalue())
    assert entry["done"] == 10
    assert re.search(r"^recovery: 100%\|.*\| 10/10 \[.*, loss \d", _last(lines, "recovery"))
    silent = io.StringIO()
    cli_recover(settings, factorize(model, {"fc1": 8}), model, cal, None, bar=Progress(stream=silent))
    assert silent.getvalue() == ""
    assert capsys.readouterr().out == ""  # the summary line goes to stderr


def test_auto_off_a_terminal_writes_plain_lines_for_long_phases(monkeypatch):
    """--progress auto (the command line's default) off a terminal: nothing for the quick phases, one plain line per
    long phase with its count and time, and interim lines with the count so far and an estimate."""
    import auditor.progress as progress_mod

    monkeypatch.setattr(progress_mod, "PLAIN_EVERY", 0.0)  # every update is due: the interim lines show
    monkeypatch.setattr(progress_mod, "PLAIN_MIN", 0.0)  # and every long phase's closing line
    buf = io.StringIO()
    p = Progress(enabled="auto", stream=buf)
    assert p.plain and not p.enabled
    with p.phase("load"):
        pass
    with p.phase("tier 2 floors", total=4):
        for i in range(1, 5):
            p.update(i, 4, note=f"{2 * i} evaluations")
    with p.phase("tier 3 plan search", unit="plan"):
        p.update(5)
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue() and not any(l.startswith("load") for l in lines)
    assert re.fullmatch(r"tier 2 floors: 1/4 layers, \d+s, about \d+s left \(2 evaluations\)", lines[0]), lines
    assert re.fullmatch(r"tier 2 floors: 4 layers in \d+\.\ds \(8 evaluations\)", lines[4]), lines
    assert re.fullmatch(r"tier 3 plan search: 5 plans in \d+\.\ds", lines[-1]), lines
    assert len(lines) == 7 and lines[5].startswith("tier 3 plan search: 5 plans so far")
    tty = FakeTTY()  # on a terminal, auto is the bar
    assert Progress(enabled="auto", stream=tty).enabled and not Progress(enabled="auto", stream=tty).plain


def test_auto_says_nothing_for_a_quick_long_phase():
    """A calibration phase under PLAIN_MIN seconds writes nothing: a quick run, or one that fails with its one-line
    error, keeps stderr as it was."""
    buf = io.StringIO()
    p = Progress(enabled="auto", stream=buf)
    with p.phase("tier 1 spectra", total=3):
        p.update(3, 3)
    assert buf.getvalue() == ""


def test_auto_off_a_terminal_names_each_phase_and_beats_every_30_seconds():
    """Issue 40: off a terminal the first line came 66 s into a 75 s audit. Now each phase is named as it starts
    (once the run is PLAIN_START old: a quick run, or a quick failure, stays silent) and a phase that runs on writes
    a line at least every 30 s, whether or not it reports counts. The clock is injected; nothing sleeps."""
    import auditor.progress as progress_mod

    now = [100.0]
    buf = io.StringIO()
    p = Progress(enabled="auto", stream=buf, clock=lambda: now[0])
    with p.phase("load"):
        p._log.beat()
        assert buf.getvalue() == ""  # 0 s into the run: held back
        now[0] += progress_mod.PLAIN_START
        p._log.beat()
        p._log.beat()  # said once
        now[0] += 29.0
        p._log.beat()  # 29 s since the last line: nothing yet
        now[0] += 1.0
        p._log.beat()
    with p.phase("statistics", total=9, unit="batch"):  # the run is old enough: named at once
        now[0] += 5.0
        p.update(3, 9)
        now[0] += 30.0
        p._log.beat()
    lines = buf.getvalue().splitlines()
    assert lines == ["lowrank-audit: load ...", f"lowrank-audit: load still running, {progress_mod.PLAIN_START + 30:.0f}s",
                     "lowrank-audit: statistics ...",
                     "lowrank-audit: statistics still running, 35s (3/9 batches)"], lines


def test_a_heartbeat_without_counts_and_the_plural_of_batch():
    import auditor.progress as progress_mod
    from auditor.progress import plural

    assert [plural("batch", n) for n in (1, 9)] == ["batch", "batches"] and plural("plan", 2) == "plans"
    now = [0.0]
    buf = io.StringIO()
    p = Progress(enabled="auto", stream=buf, clock=lambda: now[0])
    now[0] = 10.0
    with p.phase("trace"):  # the first phase: the run's age counts from here
        now[0] = 10.0 + progress_mod.PLAIN_START
        p._log.beat()
        now[0] = 75.0
        p._log.beat()
    with p.phase("tier 3 plan search", unit="plan"):
        now[0] = 80.0
        p.update(2)
        now[0] = 110.0
        p._log.beat()
    assert buf.getvalue().splitlines() == [
        "lowrank-audit: trace ...", "lowrank-audit: trace still running, 65s",  # 30 s or more after the start line
        "lowrank-audit: tier 3 plan search ...", "lowrank-audit: tier 3 plan search still running, 35s (2 plans so far)"]


def test_a_commands_phases_share_the_runs_age():
    """The command's load, audit and render each have a Progress: a phase after a long load is named at once, and
    the run's start is forgotten when the command ends."""
    import auditor.progress as progress_mod

    buf = io.StringIO()
    with progress_mod.command_run():
        progress_mod._COMMAND_START[0] -= progress_mod.PLAIN_START + 1  # the run began a while ago
        p = Progress(enabled="auto", stream=buf)
        with p.phase("trace"):
            pass
    assert buf.getvalue() == "lowrank-audit: trace ...\n"
    assert progress_mod._COMMAND_START[0] is None and Progress(enabled="auto", stream=buf).born is None
