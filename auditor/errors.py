"""Errors a user can act on, and the exit codes the command line maps them to."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FINDINGS = 1  # findings at or above --fail-on
    BAD_INPUT = 2  # the input could not be audited; nothing was written


class AuditError(Exception):
    """Bad input: one line saying what is wrong, and one saying how to fix it.

    The command line prints ``error: <what>. <fix>`` and exits with code 2, never a traceback.
    """

    def __init__(self, what: str, fix: str = "") -> None:
        self.what = what.rstrip(".")
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        text = self.what + "."
        if self.fix:
            text += " " + self.fix.rstrip(".") + "."
        return " ".join(text.split())  # always one line


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, for embedding in one-line errors."""
    for line in str(exc).splitlines():
        if line.strip():
            return f"{type(exc).__name__}: {line.strip()}"[:300]
    return type(exc).__name__
