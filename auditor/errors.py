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
        return visible(" ".join(text.split()))  # always one line; a name's escape sequences shown, not run


_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A)) | {0x200E, 0x200F, 0x061C}
_SEPARATORS = frozenset({0x2028, 0x2029, 0x85})
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _hidden(o: int) -> bool:
    return o < 0x20 or 0x7F <= o <= 0x9F or o in _BIDI or o in _SEPARATORS or 0xD800 <= o <= 0xDFFF


def visible(text: str) -> str:
    r"""``text`` with control (C0, DEL, C1), line-separator, bidirectional-override and lone-surrogate characters
    written as visible escapes (``\\x1b``, ``\\n``, ``\\u202e``): one line, read in the order it is stored.

    >>> visible("a\x1b[31mred\u202e\n")
    'a\\x1b[31mred\\u202e\\n'
    """
    out = []
    for c in text:
        o = ord(c)
        if not _hidden(o):
            out.append(c)
        elif c in _NAMED:
            out.append(_NAMED[c])
        elif o <= 0xFF:
            out.append(f"\\x{o:02x}")
        else:
            out.append(f"\\u{o:04x}")
    return "".join(out)


ESCAPES = ("term", "github", "github-property", "sarif")


def escape(text: object, to: str = "term") -> str:
    r"""Every field the tool prints or writes for another program to read, made inert for ``to``: the one escaping
    function of the terminal (error lines, tables, check-plan's lines), GitHub workflow commands and SARIF.

    * ``term``: control characters, line breaks and direction overrides shown as visible escapes (one line).
    * ``github``: a workflow command's message: ``%``, CR and LF as ``%25``, ``%0D``, ``%0A`` (the runner's own
      rule, so no line can start a second command), every other control character shown as on the terminal.
    * ``github-property``: a property value (``file``, ``title``): also ``:`` and ``,`` (``%3A``, ``%2C``).
    * ``sarif``: a SARIF text field or name: as on the terminal (JSON escapes the rest).

    >>> escape("plan\n::error::x\x1b", "github-property")
    'plan%0A%3A%3Aerror%3A%3Ax\\x1b'
    >>> escape("50% of\r\nit", "github")
    '50%25 of%0D%0Ait'
    """
    t = str(text)
    if to in ("term", "sarif"):
        return visible(t)
    if to not in ("github", "github-property"):
        raise ValueError(f"escape to {to!r}: one of {', '.join(ESCAPES)}")
    t = visible(t.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A"))
    return t.replace(":", "%3A").replace(",", "%2C") if to == "github-property" else t


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, for embedding in one-line errors."""
    for line in str(exc).splitlines():
        if line.strip():
            return visible(f"{type(exc).__name__}: {line.strip()}"[:300])
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
