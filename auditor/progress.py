"""Progress for every phase of an audit, drawn by tqdm on stderr: load, trace, spectra; with calibration data the
calibration data, statistics (per batch), tier 1 (whitened spectra, per layer), tier 2 (per layer swept, with the
evaluations so far), tier 3 (plans measured so far: their count is not known beforehand, so no ETA) and the plan
check; render; and, for ``factorize --recover``, recovery (per step, with the running loss).

Active when the stream is a terminal or when asked (``Progress(enabled=True)``); ``enabled="auto"`` (the command
line's default) writes, off a terminal (CI, a log, a notebook), each phase's name as it starts (once the run is
:data:`PLAIN_START` seconds old: a quick run or a quick failure stays silent), a line at least every 30 s while a
phase runs (a heartbeat thread; with the counts so far), and for a long phase (calibration, the plan check,
recovery; 10 s or more) one closing line with its counts and time. Never on stdout, where JSON and Markdown go. :func:`quiet_torch_logging` keeps torch's own logging (FX graph dumps,
fake-tensor tracebacks, warnings) off the terminal while tracing and keeps the text for ``--verbose``.

>>> import io
>>> buf = io.StringIO()  # not a terminal: nothing is written
>>> p = Progress(stream=buf)
>>> with p.phase("spectra", total=3):
...     p.update(3, 3)
>>> buf.getvalue(), p.enabled
('', False)
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

from .errors import visible

__all__ = ["LONG_PHASES", "PHASES", "CapturedLog", "Progress", "command_run", "plural", "quiet_torch_logging"]

PHASES = ("load", "trace", "spectra", "calibration data", "statistics", "tier 1 spectra", "tier 2 floors",
          "tier 3 plan search", "plan check", "render", "recovery")


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def plural(unit: str, n: int) -> str:
    """``unit`` for ``n`` of them: batch -> batches, layer -> layers.

    >>> plural("batch", 9), plural("layer", 1), plural("pass", 2)
    ('batches', 'layer', 'passes')
    """
    if n == 1:
        return unit
    return unit + ("es" if unit.endswith(("s", "x", "z", "ch", "sh")) else "s")


def _counted(unit: str, n: int) -> str:
    """The head of a counted phase's line: ``{desc}: 5 plans``."""
    return "{desc}: {n_fmt} " + plural(unit, n).replace("{", "{{").replace("}", "}}")


class Progress:
    """One progress line per phase on ``stream`` (default: stderr).

    ``enabled``: None draws only when ``stream`` is a terminal; True draws whatever the stream is (forced, e.g.
    ``--progress``); False never draws. A phase with a ``total`` shows a bar that :meth:`update` moves, with an ETA;
    one without shows its name, then the time it took, or, once :meth:`update` reports a count, the count so far
    (``tier 3: 5 plans``: no ETA, the count is not known). Writing to stdout is refused: reports may be going there.
    """

    def __init__(self, enabled: bool | str | None = None, stream: IO[str] | None = None,
                 clock: Any = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock or time.monotonic  # the plain lines' clock (a test injects one)
        # the run's age counts from its first phase: of this Progress, or of the command (:func:`command_run`)
        self.born: float | None = _COMMAND_START[0] if clock is None else None
        self._log = _Log(self) if enabled == "auto" else None
        if self.stream is sys.stdout or self.stream is sys.__stdout__:
            raise ValueError("progress goes to stderr, never to stdout (reports may be written there)")
        tty = _is_tty(self.stream)
        # "auto" (the command line's default): a bar on a terminal, else plain lines for the long phases
        self.plain = enabled == "auto" and not tty
        self.enabled = tty if enabled is None or enabled == "auto" else bool(enabled)
        self._plain: "_Plain | None" = None
        self._bar: Any = None
        self._counted = False  # the open phase has no total but reports a count
        self.timings: dict[str, float] = {}  # phase -> seconds, recorded whether drawn or not

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "layer") -> Iterator["Progress"]:
        """Draw ``name`` while the block runs; call :meth:`update` inside for a phase with a known total."""
        if self._bar is not None or self._plain is not None:
            inner = self._bar.desc if self._bar is not None else self._plain.name  # type: ignore[union-attr]
            raise RuntimeError(f"phase {name!r} started inside phase {inner!r}")
        start = time.perf_counter()
        if self.plain:
            with self._log.open(name):  # type: ignore[union-attr]  # the start line, a heartbeat every 30 s
                if name not in LONG_PHASES:
                    try:
                        yield self
                    finally:
                        self.timings[name] = time.perf_counter() - start
                    return
                self._plain = _Plain(name, total, unit, self.clock(), self.stream, self.clock)
                ok = False
                try:
                    yield self
                    ok = True
                finally:
                    self.timings[name] = time.perf_counter() - start
                    plain, self._plain = self._plain, None
                    if ok:
                        plain.close(self.timings[name])
            return
        if self.enabled:
            from tqdm import tqdm  # the text bar: it writes to the stream given (tqdm.auto may pick a widget)

            fmt = None if total else "{desc} … {elapsed}"
            self._bar = tqdm(total=total, desc=name, unit=unit, file=self.stream, leave=True, mininterval=0.2,
                             dynamic_ncols=_is_tty(self.stream), ascii=not _is_tty(self.stream),
                             bar_format=fmt, disable=False)
        try:
            yield self
        finally:
            self.timings[name] = time.perf_counter() - start
            bar, self._bar = self._bar, None
            counted, self._counted = self._counted, False
            if bar is not None:
                if bar.total is None:
                    bar.bar_format = (_counted(bar.unit, bar.n) + "{postfix} " if counted else "{desc} ") \
                        + f"{self.timings[name]:.1f}s"
                bar.close()

    def update(self, done: int, total: int | None = None, note: str | None = None) -> None:
        """Progress callback: ``done`` of ``total`` units of the current phase are finished (absolute, not a
        step); ``note`` is shown after the counts (``12 evaluations``, ``loss 0.031``). In a phase without a total,
        ``done`` is a count whose end is not known. Safe to call with no phase open or when disabled (it does
        nothing then)."""
        if self._plain is not None:
            self._plain.update(done, total, note)
            return
        bar = self._bar
        if bar is None:
            return
        if total is not None and total != bar.total:
            bar.total = total
            bar.bar_format = None
        elif bar.total is None:
            self._counted = True
            bar.bar_format = _counted(bar.unit, done) + "{postfix} … {elapsed}"
        if note is not None:
            bar.set_postfix_str(visible(note), refresh=False)
        bar.update(max(0, done - bar.n))

LONG_PHASES = frozenset({"statistics", "tier 1 spectra", "tier 2 floors", "sensitivity probes", "tier 3 plan search",
                         "tier 3 recovery", "plan check", "recovery", "sweep"})  # the phases "auto" reports off a terminal
PLAIN_EVERY = 30.0  # seconds between a long phase's interim lines
PLAIN_MIN = 10.0  # a phase quicker than this writes no line (a quick run, or one that fails, stays one line long)
PLAIN_START = PLAIN_EVERY  # phases start silently for this long into a run (a quick run, or a quick failure, stays one
# line, as the house rule asks; a long run is never silent for more than PLAIN_EVERY)
BEAT_EVERY = 1.0  # seconds between the heartbeat thread's looks at the clock


class _Log:
    """Off a terminal, the run's log: each phase's name as it starts (``lowrank-audit: statistics ...``; a run
    younger than :data:`PLAIN_START` holds the line back until it is that old, so a quick run or a quick failure
    writes nothing), and while a phase runs, a line at least every :data:`PLAIN_EVERY` seconds (a heartbeat
    thread, so a phase that reports no counts is not silent either). :meth:`beat` is the thread's one step, called
    by tests with an injected clock."""

    def __init__(self, progress: "Progress") -> None:
        self.progress = progress
        self.lock = threading.RLock()  # the thread's beat and the main thread's phases write one at a time
        self.name: str | None = None
        self.started = 0.0
        self.said_start = False
        self.last = 0.0

    def write(self, text: str) -> None:
        with self.lock:
            self.progress.stream.write(text + "\n")
            self.progress.stream.flush()

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[None]:
        now = self.progress.clock()
        if self.progress.born is None:
            self.progress.born = now
        self.name, self.started, self.last, self.said_start = name, now, now, False
        self.beat()
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop,), name="lowrank-audit heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.name = None

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(BEAT_EVERY):
            try:
                self.beat()
            except (OSError, ValueError):  # a closed stream: the run goes on without its log
                return

    def beat(self) -> None:
        """Write what is due now: the open phase's start line once the run is :data:`PLAIN_START` old, and a
        heartbeat when the phase has written nothing for :data:`PLAIN_EVERY` seconds."""
        with self.lock:
            self._due(self.progress.clock())

    def _due(self, now: float) -> None:
        name = self.name
        if name is None:
            return
        if not self.said_start:
            if now - (self.progress.born or now) >= PLAIN_START:
                self.said_start, self.last = True, now
                self.write(f"lowrank-audit: {name} ...")
            return
        plain = self.progress._plain
        last = max(self.last, plain.last if plain is not None and plain.said else self.last)
        if now - last >= PLAIN_EVERY:
            self.last = now
            counts = f" ({plain.so_far()})" if plain is not None and plain.done else ""
            self.write(f"lowrank-audit: {name} still running, {now - self.started:.0f}s{counts}")


class _Plain:
    """One phase as plain lines (a CI log, a pipe, a notebook): "tier 2 floors: 3/12 layers, 31s, about 93s left"
    at most every :data:`PLAIN_EVERY` seconds while it runs, then "tier 2 floors: 12 layers in 124.0s"."""

    def __init__(self, name: str, total: int | None, unit: str, start: float, stream: IO[str],
                 clock: Any = time.monotonic) -> None:
        self.name, self.total, self.unit, self.start, self.stream = name, total, unit, start, stream
        self.clock = clock
        self.done = 0
        self.note: str | None = None
        self.last = start
        self.said = False  # an interim line was written: the closing line follows whatever the time

    def _count(self, n: int) -> str:
        return f"{n:,} {plural(self.unit, n)}"

    def so_far(self) -> str:
        return f"{self.done:,}/{self._count(self.total)}" if self.total else f"{self._count(self.done)} so far"

    def _say(self, text: str) -> None:
        self.said = True
        self.stream.write(visible(text) + "\n")  # a note may carry a layer name: one line, nothing run
        self.stream.flush()

    def update(self, done: int, total: int | None, note: str | None) -> None:
        self.done, self.total = done, total if total is not None else self.total
        self.note = note if note is not None else self.note
        now = self.clock()
        if now - self.last < PLAIN_EVERY:
            return
        self.last = now
        spent = now - self.start
        if self.total:
            left = spent * (self.total - done) / done if done else None
            eta = f", about {left:.0f}s left" if left is not None else ""
            self._say(f"{self.name}: {done:,}/{self._count(self.total)}, {spent:.0f}s{eta}"
                      + (f" ({self.note})" if self.note else ""))
        else:
            self._say(f"{self.name}: {self._count(done)} so far, {spent:.0f}s" + (f" ({self.note})" if self.note else ""))

    def close(self, seconds: float) -> None:
        if seconds < PLAIN_MIN and not self.said:
            return
        n = self.total if self.total else self.done
        what = f"{self._count(n)} in " if n else ""
        self._say(f"{self.name}: {what}{seconds:.1f}s" + (f" ({self.note})" if self.note else ""))


_COMMAND_START: list[float | None] = [None]  # set by command_run: a command's phases share one age


@contextlib.contextmanager
def command_run() -> Iterator[None]:
    """One command's run: its Progress objects (loading, the audit, rendering) count the run's age from its
    start, so a phase after a long load is named at once. Reset afterwards (tests run many commands in one process)."""
    _COMMAND_START[0] = time.monotonic()
    try:
        yield
    finally:
        _COMMAND_START[0] = None


@dataclass
class CapturedLog:
    """What torch logged or warned while quieted: one line per record (multi-line messages kept whole)."""

    records: list[str] = field(default_factory=list)
    stderr: str = ""  # text written to sys.stderr inside the block (tracebacks printed by passes)

    @property
    def text(self) -> str:
        """Everything captured, for ``--verbose``."""
        parts = list(self.records)
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        return "\n".join(parts)

    def __bool__(self) -> bool:
        return bool(self.records) or bool(self.stderr.strip())


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.append(self.format(record))
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is dropped, never raised
            self.handleError(record)


def _torch_loggers() -> list[logging.Logger]:
    names = [n for n in list(logging.root.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    found = [logging.getLogger(n) for n in names]
    # torch.__trace is the structured-trace logger (TORCH_TRACE): DEBUG records with empty messages, not for people
    return [lg for lg in found if (lg.handlers or not lg.propagate or lg.name == "torch")
            and not lg.name.startswith("torch.__trace")]


@contextlib.contextmanager
def quiet_torch_logging(capture_stderr: bool = True, enabled: bool | None = None) -> Iterator[CapturedLog]:
    """Send torch's log records (``torch``, ``torch._dynamo``, ``torch.export``, ``torch.fx``... loggers) and
    Python warnings raised inside the block to a :class:`CapturedLog` instead of stderr; with ``capture_stderr``
    also what is printed to ``sys.stderr``. Log levels are left as they are: nothing more is logged than before.

    ``enabled=None`` quiets unless the user set ``TORCH_LOGS`` (then they asked to see torch's logs); False
    passes everything through and yields an empty log.
    """
    log = CapturedLog()
    if enabled is None:
        enabled = not os.environ.get("TORCH_LOGS")
    if not enabled:
        yield log
        return
    handler = _ListHandler(log.records)
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    for lg in _torch_loggers():
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers = [handler]
        lg.propagate = False
    err = io.StringIO()

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        log.records.append(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            with (contextlib.redirect_stderr(err) if capture_stderr else contextlib.nullcontext()):
                yield log
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate
        log.stderr = err.getvalue()
