"""``lowrank-audit --help`` answers at once: the parser's path imports neither torch nor the heavy modules (issue
40); what it prints is still read from the one table of formats and the recovery defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from auditor.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "scipy", "matplotlib", "weasyprint") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_imports_no_torch(argv):
    res = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "HEAVY", res.stdout[-300:]


def test_help_names_every_format_and_the_recovery_default():
    from auditor.calibration.recovery import DEFAULT_LR
    from auditor.cli.audit_command import _parser
    from auditor.cli.recovery_flags import HELP_LR
    from auditor.render import REPORTERS

    assert HELP_LR == DEFAULT_LR
    text = " ".join(_parser().format_help().split())
    assert f"from {', '.join(REPORTERS)} (default: text)" in text
    assert f"(AdamW; default {DEFAULT_LR:g})" in text
