"""Errors a user can act on, and the exit codes the command line maps them to."""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path
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


def describe_missing(path: Path) -> str:
    """What is at ``path`` when it is not a readable regular file, in words: "does not exist", "is a folder",
    "is a FIFO (named pipe)", "is a device", "cannot be read (permission denied)"."""
    import os
    import stat

    try:
        st = path.stat()
    except FileNotFoundError:
        return "does not exist" if not path.is_symlink() else "is a symbolic link to nothing"
    except NotADirectoryError:
        return "does not exist (a part of its path is a file)"
    except OSError as exc:
        return f"cannot be read ({(exc.strerror or str(exc)).lower()})"
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a file"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return ""


def size_text(n: float) -> str:
    """Bytes as GiB, MiB or KiB (binary units), for messages.

    >>> size_text(3 << 30), size_text(1536), size_text(80e9)
    ('3.0 GiB', '1.5 KiB', '74.5 GiB')
    """
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} bytes"
