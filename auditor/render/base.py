"""The reporter contract: a :class:`Reporter` renders an Audit with a :class:`RenderContext` to text or bytes; the
registry in :mod:`auditor.render` maps format names to reporters. None of this touches torch."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..verdict.baseline import BaselineDiff
    from ..results import AuditResult


@dataclass(frozen=True)
class RenderContext:
    """What a report shows besides the audit itself; every reporter receives the same context."""

    baseline: "BaselineDiff | None" = None  # the comparison with an earlier JSON report; each format shows it
    width: int = 120  # the terminal table's line length (at least 60; 0: wide, every column kept)
    with_sigma: bool = False  # JSON: every singular value
    charts: bool = True  # HTML/PDF: the matplotlib charts (off for the notebook's compact view)
    baseline_report: "dict[str, Any] | None" = None  # the baseline's JSON as read: per-layer rank changes
    measured: "dict[str, list[tuple[int, float]]] | None" = None  # calibration: layer or group label -> points


class Stdout(str, Enum):
    """Where a format may go besides its file, the one fact the command line needs of it (``Reporter.stdout``)."""

    NEVER = "never"  # a file only (html, pdf): ./lowrank-audit.SUFFIX without -o
    DOCUMENT = "document"  # stdout without -o, else a file; never beside another document (json, md, sarif)
    TABLE = "table"  # the terminal table: on stdout unless -q (coloured on a terminal), and a file with -o
    LOG = "log"  # log lines (workflow annotations): always stdout, never a file (github)

    @property
    def shares(self) -> bool:
        """Log lines (the table, annotations) may share stdout with a document; two documents may not."""
        return self in (Stdout.TABLE, Stdout.LOG)


@runtime_checkable
class Reporter(Protocol):
    """One output format. ``render`` returns ``str`` (text formats) or ``bytes`` (``binary`` formats); it writes
    nothing itself: the caller writes the whole result atomically, so a failure leaves no half-written file."""

    name: str  # the --format word: "json"
    suffix: str  # the file suffix: ".json"
    binary: bool
    stdout: Stdout  # whether it may go to stdout, and when (:class:`Stdout`)

    def render(self, audit: "AuditResult", context: RenderContext) -> str | bytes: ...


@contextmanager
def atomic_write(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """Write to a temporary file beside ``path`` and rename it into place: an interrupted run leaves no
    half-written report, and an existing report is replaced only by a complete one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
