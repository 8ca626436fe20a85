"""The command line's report flags: --version, --progress on stderr only, stdout keeps one document, torch's own
logging kept off stderr before the one-line error (and shown with --verbose)."""

from __future__ import annotations

import json
import textwrap

import auditor

BAD_SHAPE = textwrap.dedent("""
    import torch
    from torch import nn

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return y.relu() if y.sum() > 0 else y  # data-dependent: symbolic_trace fails, export tries fake tensors

    def make():
        return Branchy(), torch.zeros(2, 9)  # inputs that do not fit: every tracer fails
""")


def test_version(cli_inproc, capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        cli_inproc("--version")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"lowrank-audit {auditor.__version__}"


def test_text_and_json_to_stdout_is_refused(cli_inproc):
    r = cli_inproc("sample_models/digits.py:mlp", "--no-spectra", "--format", "text,json")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "-o DIR" in r.stderr
    ok = cli_inproc("sample_models/digits.py:mlp", "--no-spectra", "--format", "text,json", "-q")
    assert ok.returncode == 0 and json.loads(ok.stdout)["totals"]["params"] == 429_834


def test_forced_progress_goes_to_stderr_only(cli):
    r = cli("sample_models/digits.py:mlp", "--no-cache", "--format", "json", "-q", "--progress")
    assert r.returncode == 0
    assert json.loads(r.stdout)["totals"]["params"] == 429_834  # stdout is the JSON and nothing else
    for phase in ("load", "trace", "spectra", "render"):
        assert phase in r.stderr
    quiet = cli("sample_models/digits.py:mlp", "--no-cache", "--format", "json", "-q")
    assert quiet.stderr == ""  # not a terminal, not forced: no progress


def test_torch_logging_stays_off_stderr_before_the_error(cli, tmp_path):
    (tmp_path / "bad.py").write_text(BAD_SHAPE)
    r = cli(f"{tmp_path / 'bad.py'}:make", "--no-spectra")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the example inputs (float32[2, 9]) do not fit the model")
    v = cli(f"{tmp_path / 'bad.py'}:make", "--no-spectra", "--verbose")
    assert v.returncode == 2 and v.stderr.splitlines()[-1] == lines[0]
    assert "fake_tensor" in v.stderr and len(v.stderr.splitlines()) > 3  # the captured detail, before the line
