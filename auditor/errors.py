"""Errors a user can act on, and the exit codes the command line maps them to."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    OK = 0
    FINDINGS = 1  # findings at or above --fail-on
    BAD_INPUT = 2  # the input could not be audited; nothing was written
    INTERNAL = 3  # an unexpected error inside the tool (a bug): one line, the traceback with --verbose


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


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.loads`` ``object_pairs_hook`` that refuses a key given twice (plain JSON keeps the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out
