"""All-or-nothing output for the command line: every report and the emitted plan are rendered first, written into a
temporary folder beside each destination, then renamed into place; on any failure what was moved is rolled back
(a replaced file gets its old content back), so a run leaves either every output or none. No torch here.

Destinations are checked before the audit runs (:func:`check_destination`): an existing path that is not a regular
file (a folder, a symbolic link, a device such as /dev/null, a FIFO) is never replaced, and a folder that cannot be
written is refused while it is still cheap to say so.

A whole folder (``lowrank-audit factorize -o DIR``) is one output too: :func:`check_folder_output` says before any
work whether DIR may receive it (never a symbolic link, the working folder or one above it, a folder holding an
input, or a non-empty folder the caller does not recognise as its own), and :func:`write_folder` writes it beside
DIR and renames it into place.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from ..errors import AuditError

TMP_PREFIX = ".lowrank-audit-"  # the staging folders' names start with this (a killed run may leave one)


def _open_new(path: Path) -> BinaryIO:
    """Create ``path`` for writing (never an existing file); tests substitute one that fails like a full disk."""
    return open(path, "xb")


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


kind_of = _kind  # "a file", "a folder", "a symbolic link", ... for a mode from os.lstat


def _existing_ancestor(path: Path) -> Path:
    for folder in [path, *path.parents]:
        if os.path.lexists(folder):
            return folder
    return Path(".")


def _probe(folder: Path, what: str) -> None:
    """Create and remove an empty folder in ``folder``: the cheap proof that writing there can work at all
    (a pseudo filesystem such as /proc, a read-only mount, missing permission)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=TMP_PREFIX, suffix=".probe", dir=folder))
    except OSError as exc:
        raise AuditError(f"{what}: cannot write in {folder} ({exc.strerror or exc})",
                         "Choose a folder you can write to") from None


def check_folder(folder: str | Path, what: str) -> None:
    """``folder`` is, or can become, a writable folder (``what`` names the flag in the error)."""
    path = Path(folder)
    if os.path.lexists(path) and not path.is_dir():
        raise AuditError(f"{what} {path} is {_kind(os.lstat(path).st_mode)}, not a folder",
                         "Pass a folder (it is created when missing)")
    anc = _existing_ancestor(path)
    if not anc.is_dir():
        raise AuditError(f"{what} {path}: {anc} is {_kind(os.lstat(anc).st_mode)}, not a folder",
                         "Pass a folder path whose parents are folders")
    _probe(anc, f"{what} {path}")


def check_destination(path: str | Path, what: str) -> None:
    """``path`` may be written: it is missing or a regular file (replaced atomically), and its folder is writable."""
    p = Path(path)
    if os.path.lexists(p):
        mode = os.lstat(p).st_mode
        if stat.S_ISDIR(mode):
            raise AuditError(f"{what} {p} is a folder", f"Pass a file path, such as {p / 'plan.toml'}")
        if not stat.S_ISREG(mode):
            raise AuditError(f"{what} {p} is {_kind(mode)}; refusing to replace it",
                             "Pass the path of a regular file (an existing one is replaced atomically)")
    check_folder(p.parent, f"{what} {p}: folder")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same file (existing: by inode; otherwise by resolved path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


NON_FINITE = "non_finite"  # the top-level key naming the numbers strict_json wrote as null


def strict_json(data: object, **dumps: object) -> str:
    """``json.dumps`` that every JSON reader (the tool's own strict ones included) reads back: a float that is not
    finite (a perplexity that overflowed, an infinite measured error) is written as ``null``, and a top-level object
    gains ``"non_finite": {JSON pointer: "inf" | "-inf" | "nan"}`` saying which number it was; never the
    ``Infinity`` or ``NaN`` that plain ``json.dumps`` writes and strict parsers refuse.

    >>> strict_json({"a": [1.0, float("inf")], "b": {"c": float("nan")}})
    '{"a": [1.0, null], "b": {"c": null}, "non_finite": {"/a/1": "inf", "/b/c": "nan"}}'
    """
    import json
    import math

    found: dict[str, str] = {}

    def clean(value: object, pointer: str) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            found[pointer] = "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{pointer}/{str(k).replace('~', '~0').replace('/', '~1')}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{pointer}/{i}") for i, v in enumerate(value)]
        return value

    out = clean(data, "")
    if found and isinstance(out, dict):
        out = {**out, NON_FINITE: {**(out.get(NON_FINITE) or {}), **found}}  # type: ignore[dict-item]
    return json.dumps(out, allow_nan=False, **dumps)  # type: ignore[arg-type]


def spec_paths(value: str | Path | None) -> list[str]:
    """The paths an input given on the command line may name: itself, and for ``file.py:fn`` (a factory, a
    calibration or metric function) its file. Names that are not paths (a share, a metric's name) name nothing."""
    if value is None or str(value) == "":
        return []
    text = str(value)
    return list(dict.fromkeys(c for c in (text, text.rpartition(":")[0]) if c and os.path.lexists(c)))


def check_not_input(path: str | Path, what: str, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """Refuse an output ``path`` that is an input of the run (``inputs``: (label, value) as given, ``file.py:fn``
    counting by its file): the same file by path, through a symbolic link or as a hard link (device and inode), or an
    existing file inside an input folder (a Hugging Face directory, a sharded checkpoint) that the output would
    replace. Every output of every command goes through here before any work is done."""
    p = Path(path)
    exists = os.path.lexists(p)
    for label, value in inputs:
        for given in spec_paths(value):
            q = Path(given)
            if q.is_dir():
                hit = exists and _within(p.parent.resolve() / p.name, q.resolve())
            else:
                hit = same_file(p, q)
            if hit:
                where = f"{label} {given}" if not q.is_dir() else f"a file of {label} {given}"
                raise AuditError(f"{what} {p} is {where}, an input of this run; writing it would replace the input",
                                 "Write the output to another path")


@dataclass
class _Entry:
    path: Path
    data: bytes
    staged: Path | None = None
    backup: Path | None = None  # the replaced file's old content, kept until the run succeeds
    moved: bool = False


@contextmanager
def _sigint_deferred() -> Iterator[list[int]]:
    """Hold Ctrl-C while files are renamed into place (a few renames), so an interrupt cannot split them; the
    caller sees the held signal afterwards."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, old)


@dataclass
class OutputSet:
    """The files one run writes. ``add`` them, then ``commit``: all are written, or none (and the error says what
    exists). ``written`` lists what is in place, for the interrupt message."""

    entries: list[_Entry] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    _staging: dict[Path, Path] = field(default_factory=dict)  # destination folder -> its staging folder
    _created: list[Path] = field(default_factory=list)  # folders made for the outputs, outermost first

    def add(self, path: str | Path, data: str | bytes) -> None:
        p = Path(path)
        if any(same_file(e.path, p) for e in self.entries):
            raise AuditError(f"two outputs would be written to {p}", "Give --emit-plan a path outside the reports")
        self.entries.append(_Entry(p, data.encode("utf-8") if isinstance(data, str) else data))

    # -- staging -------------------------------------------------------------------------------------------------
    def _mkdirs(self, folder: Path) -> None:
        missing = [f for f in [folder, *folder.parents] if not os.path.lexists(f)]
        for f in reversed(missing):
            os.mkdir(f)
            self._created.append(f)

    def _stage(self) -> None:
        umask = os.umask(0)
        os.umask(umask)
        for e in self.entries:
            folder = e.path.parent
            try:
                self._mkdirs(folder)
                key = folder.resolve()
                if key not in self._staging:
                    self._staging[key] = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, suffix=".tmp", dir=folder))
                e.staged = self._staging[key] / e.path.name
                with _open_new(e.staged) as fh:
                    fh.write(e.data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.chmod(e.staged, 0o666 & ~umask)  # an ordinary file, as the user's umask makes them
            except OSError as exc:
                raise AuditError(f"cannot write {e.path}: {exc.strerror or exc}") from None

    def _move(self, e: _Entry) -> None:
        if os.path.lexists(e.path):
            mode = os.lstat(e.path).st_mode
            if not stat.S_ISREG(mode):
                raise AuditError(f"{e.path} is {_kind(mode)}; refusing to replace it",
                                 "Remove it or choose another path")
            e.backup = e.staged.with_name(".old-" + e.path.name)  # type: ignore[union-attr]
            try:
                os.link(e.path, e.backup)  # the old content stays reachable; the rename below stays atomic
            except OSError:
                try:
                    shutil.copy2(e.path, e.backup)  # a filesystem without hard links
                except OSError as exc:
                    raise AuditError(f"cannot keep a copy of {e.path} before replacing it: "
                                     f"{exc.strerror or exc}") from None
        try:
            os.replace(e.staged, e.path)  # type: ignore[arg-type]
        except OSError as exc:
            raise AuditError(f"cannot move {e.path} into place: {exc.strerror or exc}") from None
        e.moved = True

    # -- the whole run -------------------------------------------------------------------------------------------
    def commit(self, after: Callable[[], None] | None = None) -> list[Path]:
        """Stage every file, rename each into place, run ``after`` (writing stdout), then drop the backups. Any
        failure (or Ctrl-C) before the end restores what was there and raises; AuditError says what exists."""
        interrupted = False
        try:
            self._stage()
            with _sigint_deferred() as held:
                for e in self.entries:
                    self._move(e)
            interrupted = bool(held)
            if interrupted:
                raise KeyboardInterrupt
            if after is not None:
                after()
        except BaseException as exc:
            with _sigint_deferred():  # a second Ctrl-C cannot cut the rollback short
                left = self.rollback()
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            what = exc.what if isinstance(exc, AuditError) else _describe(exc)
            fix = exc.fix if isinstance(exc, AuditError) and exc.fix else \
                "Free space, or choose another -o / --emit-plan path"
            state = ("no file was written and existing files were left as they were" if not left else
                     f"these could not be restored and are in place: {', '.join(map(str, left))}")
            raise AuditError(f"{what}; {state}", fix) from None
        self.written.extend(e.path for e in self.entries)  # in place: an interrupt from here on says so
        self._cleanup()
        return [e.path for e in self.entries]

    def rollback(self) -> list[Path]:
        """Undo what was moved (restore replaced files, remove new ones) and remove the staging folders and the
        folders made for the outputs. Returns the paths that could not be undone."""
        left: list[Path] = []
        for e in reversed(self.entries):
            if not e.moved:
                continue
            try:
                if e.backup is not None:
                    os.replace(e.backup, e.path)
                else:
                    os.unlink(e.path)
                e.moved = False
            except OSError:
                left.append(e.path)
        self._cleanup()
        for f in reversed(self._created):
            try:
                os.rmdir(f)
            except OSError:
                pass
        return left

    def _cleanup(self) -> None:
        for tmp in self._staging.values():
            shutil.rmtree(tmp, ignore_errors=True)
        self._staging.clear()


# -- a whole folder as one output (lowrank-audit factorize -o DIR) ------------------------------------------------

def check_folder_output(out: str | Path, what: str, *, force: bool, replaceable: Callable[[Path], str | None],
                        inputs: Iterable[tuple[str, str | Path]] = (), tool: str = "this command") -> None:
    """``out`` may receive a folder written as a whole (:func:`write_folder`): it is missing or an empty folder, or
    with ``force`` a folder that ``replaceable(out)`` accepts (it returns None, or why not) - never a symbolic link,
    the working folder or a folder above it, a folder holding one of ``inputs`` (label, path), or a folder whose
    parent cannot be written (/proc, read-only, under a regular file)."""
    p = Path(out)
    if os.path.islink(p):
        raise AuditError(f"{what} {p} is a symbolic link; refusing to write through it",
                         "Pass the folder itself, or a new folder path")
    if os.path.lexists(p) and not p.is_dir():
        raise AuditError(f"{what} {p} is {_kind(os.lstat(p).st_mode)}, not a folder",
                         "Pass a folder path (it is created when missing)")
    target = p.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise AuditError(f"{what} {p} is the working folder" + ("" if target == cwd else " or holds it"),
                         "Pass a new folder for the output, such as ./factorized")
    for label, given in inputs:
        q = Path(given)
        if os.path.lexists(q) and (_within(q.resolve(), target) or _within(q.parent.resolve() / q.name, target)):
            raise AuditError(f"{what} {p} holds {label} {q}, an input of this run; it would be replaced",
                             "Write the output to another folder")
    try:
        entries = os.listdir(p) if p.is_dir() else []
    except OSError as exc:
        raise AuditError(f"{what} {p}: cannot read it ({exc.strerror or exc})", "Choose a folder you can write to") \
            from None
    if entries:
        if not force:
            raise AuditError(f"{what} {p} is not empty",
                             f"Choose an empty or new folder, or pass --force to replace a previous output of {tool}")
        why = replaceable(p)
        if why is not None:
            raise AuditError(f"{what} {p} {why}; --force replaces only a previous output of {tool}",
                             "Choose another folder, or empty this one yourself")
    check_folder(p.parent if p.parent != p else p, f"{what} {p}: folder")


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def write_folder(out: str | Path, fill: Callable[[Path], None], recheck: Callable[[], None] | None = None) -> None:
    """Write the folder ``out`` as a whole: ``fill(staging)`` writes every file into a new folder beside ``out``,
    which is then renamed into place (an existing ``out``, re-checked by ``recheck`` just before, is moved aside and
    removed only after the new one is in place). On any failure nothing of the new output remains and an existing
    ``out`` is left as it was; the error is one line."""
    p = Path(out)
    existed = os.path.lexists(p)
    made: list[Path] = []
    stage: Path | None = None
    aside: Path | None = None
    try:
        for f in reversed([f for f in p.parents if not os.path.lexists(f)]):
            os.mkdir(f)
            made.append(f)
        stage = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, suffix=".tmp", dir=p.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(stage, 0o777 & ~umask)  # an ordinary folder once in place (mkdtemp makes it private)
        fill(stage)
        if recheck is not None:
            recheck()
        with _sigint_deferred():  # the two renames are not split by Ctrl-C
            if os.path.lexists(p):
                aside = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, suffix=".old", dir=p.parent))
                os.rename(p, aside / "old")
            try:
                os.rename(stage, p)
            except OSError:
                if aside is not None:
                    os.rename(aside / "old", p)
                    shutil.rmtree(aside, ignore_errors=True)
                    aside = None
                raise
            stage = None
    except BaseException as exc:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        for f in reversed(made):
            try:
                os.rmdir(f)
            except OSError:
                pass
        if isinstance(exc, (AuditError, KeyboardInterrupt, SystemExit)):
            raise
        left = f" and {p} was left as it was" if existed else ""
        from ..errors import first_line

        if isinstance(exc, OSError):
            raise AuditError(f"cannot write {p}: {exc.strerror or exc}; nothing was written{left}",
                             "Free space, or choose another -o folder") from None
        if any(w in str(exc) for w in ("I/O error", "os error", "No space left")):  # safetensors' own I/O error
            raise AuditError(f"cannot write {p}: {first_line(exc)}; nothing was written{left}",
                             "Free space, or choose another -o folder") from None
        # a step of filling the folder failed (an exporter, a runtime), not the disk: say which error

        raise AuditError(f"{p} could not be completed: {first_line(exc)}; nothing was written{left}",
                         "The error above is the cause (not the disk)") from None
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot write{where}: {exc.strerror or exc}"
    return f"cannot write the outputs: {type(exc).__name__}: {exc}"


def silence(stream: "object | None") -> None:
    """Point a standard stream's descriptor at /dev/null after it failed (a closed pipe, a full disk), so neither a
    later write nor the interpreter's final flush of what is still buffered can fail again with a message."""
    stream = getattr(stream, "_stream", stream)  # QuietStderr
    if stream is None or stream not in (sys.__stdout__, sys.__stderr__):
        return  # captured (tests, notebooks): nothing buffered at the process level
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())  # type: ignore[attr-defined]
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


_reader_gone: set[int] = set()  # id() of the stdout objects whose reader closed the pipe


def stdout_reader_gone() -> bool:
    """Whether the reader of stdout stopped reading (``lowrank-audit rules | head``): what follows is dropped."""
    return id(sys.stdout) in _reader_gone


def write_stdout(text: str | bytes) -> None:
    """Write to stdout and flush, so a full disk is seen here and not at interpreter exit (an AuditError, exit 2).

    A reader that stopped early (``| head``: a closed pipe, EPIPE) is normal, as for ``git log | head``: the rest is
    dropped without a message and the run ends with its own exit code; every later write is a no-op."""
    import errno

    if stdout_reader_gone() or sys.stdout is None:
        return
    try:
        sys.stdout.write(text if isinstance(text, str) else text.decode())
        sys.stdout.flush()
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) or exc.errno in (errno.EPIPE, errno.ECONNRESET):
            _reader_gone.add(id(sys.stdout))
            silence(sys.stdout)
            return
        raise AuditError(f"cannot write to standard output: {exc.strerror or exc}",
                         "Redirect stdout to a writable file, or pass -o DIR") from None


def print_stdout(*parts: object) -> None:
    """``print`` through :func:`write_stdout` (a closed pipe ends the output quietly)."""
    write_stdout(" ".join(map(str, parts)) + "\n")


class QuietStderr:
    """The process's stderr, dropping what a closed pipe refuses (``2>&1 | head``) instead of raising
    BrokenPipeError: the run's messages are a log, and losing the log's reader must not change the exit code."""

    def __init__(self, stream: "object") -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)  # type: ignore[attr-defined]
            except BrokenPipeError:
                self._gone = True
                silence(self._stream)
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()  # type: ignore[attr-defined]
            except BrokenPipeError:
                self._gone = True
                silence(self._stream)

    def __getattr__(self, name: str) -> "object":
        return getattr(self._stream, name)

