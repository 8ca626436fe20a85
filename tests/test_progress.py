"""Progress lines only on a terminal or when forced, never on stdout; torch's logging captured while tracing."""

from __future__ import annotations

import io
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
