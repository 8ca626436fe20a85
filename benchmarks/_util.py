"""Helpers shared by the benchmark scripts: best-of-n timing and peak resident memory."""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from typing import Callable


def best(fn: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def best_interleaved(fns: list[Callable[[], object]], rounds: int = 3) -> list[float]:
    """Best time of each function over ``rounds`` rounds that run them in turn: a slow spell on a shared machine
    then slows every contender alike instead of the one that happened to run during it."""
    times = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - t)
    return times


def rss_mb() -> float:
    """Resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


class PeakSampler:
    """Samples resident memory every few milliseconds in a thread: the peak above the level at the start."""

    def __enter__(self) -> "PeakSampler":
        self.base = rss_mb()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb())

    @property
    def increase(self) -> float:
        return self.peak - self.base


def proc_status(key: str) -> int:
    """A byte count of this process's /proc/self/status (``VmRSS``, ``VmHWM``); 0 where there is none."""
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def timed_fit(model: object, plan: dict, cal: object, refine: int, products: str | None = None) -> dict:
    """statistics/sequential.py's fit of ``plan`` on ``cal``, timed in this process: its wall, its peak RSS above the
    RSS before it (the high-water mark reset then, Linux's /proc/self/clear_refs) and a SHA-256 of every planned
    layer's factors (two runs' factors compared bit for bit through it); ``products``: each layer's A B written
    there too (an ``.npz``; two runs equal to rounding compared through them)."""
    import hashlib
    import time
    from pathlib import Path

    from auditor.calibration.statistics import sequential as seq

    Path("/proc/self/clear_refs").write_text("5")
    base = proc_status("VmRSS")
    t0 = time.perf_counter()
    done = seq.sequential_fit(model, plan, cal, refine=refine)
    wall = time.perf_counter() - t0
    peak = proc_status("VmHWM")
    h = hashlib.sha256()
    for name in sorted(done.truncators):
        for a in done.truncators[name].factors(plan[name][1]):
            h.update(a.tobytes())
    if products is not None:
        import numpy as np

        np.savez(products, **{name: np.matmul(*done.truncators[name].factors(plan[name][1])).astype(np.float32)
                              for name in done.truncators})
    return {"peak": peak - base, "wall": wall, "digest": h.hexdigest()}


def peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 1024 / 1024


def run_capped(module: str, call: str, cap_gb: float, timeout: float, root: str, label: dict) -> dict:
    """``module.call`` (a Python expression returning a JSON-able dict, e.g. ``child(2, 'stream')``) in a fresh
    interpreter under an address-space cap of ``cap_gb`` GiB, with ``root`` first on the path (the package under
    test) and this folder after it. The dict it returns, or ``label`` with an ``error`` saying why there is none (a
    timeout, or the child's last line of stderr)."""
    import json
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import resource,sys,json; cap=int({cap_gb}*2**30); resource.setrlimit(resource.RLIMIT_AS,(cap,cap)); "
            f"sys.path.insert(0,{root!r}); sys.path.insert(0,{here!r}); "
            f"import {module} as b; print('RESULT', json.dumps(b.{call}))")
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**label, "error": f"did not finish within {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {**label, "error": f"exit {p.returncode}: {tail}"}
