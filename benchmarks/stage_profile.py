"""Each phase's wall time and peak RSS of one `lowrank-audit` run, measured from outside the process.

    python benchmarks/stage_profile.py [--log FILE] -- MODEL [the audit's flags]

runs the audit in a child process with its plain progress log on from the first second (``PLAIN_START = 0``, every
phase's start written), reads each ``lowrank-audit: PHASE ...`` line as it comes, samples the child's resident
memory (/proc, every 0.2 s) and prints one row per phase: when it started, how long it ran (until the next phase
started or the process ended) and the largest RSS seen while it ran; then the total wall and peak, which
``/usr/bin/time -v`` would give too. This is how docs/performance.md sets the 1.1B audit's stages beside
``--estimate``'s. The child's stderr is copied to ``--log`` (or to this process's stderr).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

CHILD = ("import sys, auditor.progress as p; p.PLAIN_START = 0.0; p.PLAIN_MIN = 0.0\n"
         "from auditor.cli import main\nsys.exit(main())")
START = re.compile(r"^lowrank-audit: (.+?) \.\.\.$")


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class Timeline:
    """Phases in the order they started, each with its start time and the peak RSS sampled while it ran."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.rows: list[list] = [["(start)", 0.0, 0]]  # name, start offset, peak bytes
        self.lock = threading.Lock()
        self.peak = 0

    def phase(self, name: str, now: float) -> None:
        with self.lock:
            self.rows.append([name, now - self.t0, 0])

    def sample(self, value: int) -> None:
        with self.lock:
            self.rows[-1][2] = max(self.rows[-1][2], value)
            self.peak = max(self.peak, value)


def _sample(pid: int, line: Timeline, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        line.sample(rss_bytes(pid))


def profile(argv: list[str], log) -> tuple[Timeline, float, int]:
    t0 = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stderr=subprocess.PIPE, text=True, bufsize=1)
    line = Timeline(t0)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(child.pid, line, stop), daemon=True)
    sampler.start()
    assert child.stderr is not None
    for text in child.stderr:
        log.write(f"[{time.monotonic() - t0:8.1f}s] {text}")
        log.flush()
        found = START.match(text.rstrip("\n"))
        if found:
            line.phase(found.group(1), time.monotonic())
    rc = child.wait()
    wall = time.monotonic() - t0
    stop.set()
    sampler.join()
    return line, wall, rc


def table(line: Timeline, wall: float) -> str:
    out = [f"{'phase':<28}{'start':>10}{'wall':>10}{'peak RSS':>12}"]
    ends = [row[1] for row in line.rows[1:]] + [wall]
    for (name, start, peak), end in zip(line.rows, ends):
        out.append(f"{name:<28}{start:>9.1f}s{end - start:>9.1f}s{peak / 2**20:>8,.0f} MiB")
    out.append(f"{'total':<28}{'':>10}{wall:>9.1f}s{line.peak / 2**20:>8,.0f} MiB")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", help="where the audit's stderr goes, each line timed (default: stderr)")
    parser.add_argument("audit", nargs=argparse.REMAINDER, help="-- MODEL [the audit's flags]")
    args = parser.parse_args()
    argv = args.audit[1:] if args.audit[:1] == ["--"] else args.audit
    if not argv:
        parser.error("give the audit's command line after --")
    log = open(args.log, "w") if args.log else sys.stderr  # noqa: SIM115 - closed below, stderr is not
    try:
        line, wall, rc = profile(argv, log)
    finally:
        if log is not sys.stderr:
            log.close()
    print(table(line, wall))
    print(f"exit status {rc}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
