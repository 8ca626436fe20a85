"""Whole-model latency and peak memory, dense and factorized, each in a fresh Python process
(``python -m auditor.speed.model``), so that one model's allocations cannot inflate the other's peak. The worker
reloads the model from its source string, applies the plan with ``factorize`` (structure only: factor values do not
change the time), resets the peak RSS (``/proc/self/clear_refs``), runs the forwards and prints one JSON line.
An audited Python object has no source to reload: it is measured in this process, and the report says so.

Memory: on the CPU the peak resident set while the forwards ran (the weights plus the activations); on CUDA
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..speedresults import ModelRun
from .timing import Clock, Timing, block_timer

ATTEMPTS = 3  # a timing that is not repeatable is measured again, at most this many times in all
TIMEOUT_S = 600.0  # one subprocess at most this long (the audit goes on without the whole-model numbers)


def _trim() -> None:
    """Hand the memory the allocator kept after the dense model was freed back to the system (glibc), so that the
    factorized model's peak RSS is its own."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_reset() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux 4.0+); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lead_shape(args: tuple, kwargs: dict, lead: tuple[int, ...] | None) -> tuple[tuple, dict]:
    """The inputs at another batch/sequence: each tensor's leading dims become ``lead`` (integer ids stay within
    the values seen)."""
    if lead is None:
        return args, kwargs

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < len(lead):
            return x
        shape = (*lead, *x.shape[len(lead):])
        if x.is_floating_point():
            return torch.randn(shape, dtype=x.dtype)
        if x.dtype == torch.bool:
            return torch.ones(shape, dtype=x.dtype)
        hi = int(x.max().item()) + 1 if x.numel() else 1
        lo = int(x.min().item()) if x.numel() else 0
        return torch.randint(lo, max(hi, lo + 1), shape, dtype=x.dtype)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def run_model(model: nn.Module, args: tuple, kwargs: dict, device: str = "cpu", clock: Clock | None = None,
              min_time: float = 0.5) -> ModelRun:
    """Time ``model(*args, **kwargs)`` (eval, inference mode) and its peak memory, in this process."""
    from ..structure.layers import ParamTable

    params = ParamTable.of(model).total
    model = model.to(device).eval()
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        memory = "cuda-max-allocated"
    else:
        memory = "rss" if _rss_reset() else "rss-process-peak"
    with torch.inference_mode():
        t = _repeatable(lambda: model(*args, **kwargs), device, clock, min_time)
    peak = torch.cuda.max_memory_allocated(device) if cuda else _rss_peak()
    return ModelRun(t, int(peak), memory, params)


def _repeatable(fn: Any, device: str, clock: Clock | None, min_time: float) -> Timing:
    """``fn`` timed in this process, held to the checks of :func:`~auditor.speed.timing.refusal` (its two halves,
    and with more than one CPU thread a one-thread cross-check), up to :data:`ATTEMPTS` times; a RuntimeError when
    it never passes."""
    import statistics

    from .layer_timing import one_thread
    from .timing import measure_blocks, refusal

    why = ""
    for _ in range(ATTEMPTS):
        (per,), (calls,) = measure_blocks([fn], device=device, clock=clock, min_time=min_time)
        one = None
        if torch.get_num_threads() > 1 and not device.startswith("cuda"):
            with one_thread():
                (per1,), _ = measure_blocks([fn], device=device, clock=clock, min_time=min_time / 2)
            one = statistics.median(per1)
        why = refusal("the model", per, one) or ""
        if not why:
            return Timing.of(per, calls)
    raise RuntimeError(f"the timing is not repeatable: {why}")


def _build(spec: dict[str, Any]) -> tuple[nn.Module, tuple, dict]:
    """In the fresh process: load the model from its source, factorize it when a plan is given (the dense model
    dropped and the allocator trimmed before anything is measured)."""
    from ..options import LoadOptions
    from ..sources import load_source
    from ..structure.trace import ExampleInputs

    load = dict(spec["load"])
    for k in ("input_shape", "input_ids"):
        if load.get(k) is not None:
            load[k] = tuple(tuple(s) for s in load[k]) if k == "input_shape" else tuple(load[k])
    o = LoadOptions(**load)  # read as pipeline.load_model reads it
    loaded = load_source(spec["source"], input_shape=[tuple(s) for s in o.input_shape] if o.input_shape else None,
                         input_ids=o.input_ids, weights=o.weights, structure_only=o.structure_only,
                         partial=o.partial, auto_inputs=o.auto_inputs)
    model = loaded.model
    ex = ExampleInputs.of(loaded.example_inputs) or ExampleInputs()
    args, kwargs = lead_shape(ex.args, ex.kwargs, tuple(spec["lead"]) if spec.get("lead") else None)
    del loaded  # the dense model lives on only as ``model`` (dropped below when a plan is applied)
    if spec.get("program"):  # an exported program, run on the source's example inputs
        del model
        gc.collect()
        _trim()
        return _program(spec["program"], spec["format"]), args, kwargs
    if spec.get("plan"):
        from ..surgery import apply_plan

        dense = model
        model = apply_plan(dense, spec["plan"])
        del dense
    gc.collect()
    _trim()
    return model, args, kwargs


class _OnnxModel:
    """An ONNX file in onnxruntime (CPU), called like the module it was exported from."""

    def __init__(self, path: str) -> None:
        import onnxruntime as ort

        self.sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.sess.get_inputs()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = [v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
        return self.sess.run(None, {n: v.numpy() for n, v in zip(self.names, values)})

    def to(self, device: str) -> "_OnnxModel":
        return self

    def eval(self) -> "_OnnxModel":
        return self


def _program(path: str, fmt: str) -> Any:
    if fmt == "onnx":
        return _OnnxModel(path)
    return torch.export.load(path).module()


def _serve(spec: dict[str, Any], reply: Any) -> None:
    """The worker: build, reset the peak memory, warm up and size a block (at least MIN_BLOCK_S), say ``ready``;
    then time one block per ``b`` line read (``1``: on one thread from then on, ``n``: on the threads asked for
    again), and on ``q`` report the peak memory."""
    from ..structure.layers import ParamTable
    from .timing import MIN_BLOCK_S

    torch.set_num_threads(int(spec["threads"]))
    device = spec["device"]
    model, args, kwargs = _build(spec)
    params = ParamTable.of(model).total if isinstance(model, nn.Module) else 0
    if isinstance(model, nn.Module) and not spec.get("program"):  # an exported program stays as loaded (CPU)
        model = model.to(device).eval()
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cuda = device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        memory = "cuda-max-allocated"
    else:
        memory = "rss" if _rss_reset() else "rss-process-peak"
    timer = block_timer(device)

    def say(d: dict[str, Any]) -> None:
        reply.write(json.dumps(d) + "\n")
        reply.flush()

    with torch.inference_mode():
        def fn() -> None:
            model(*args, **kwargs)

        for _ in range(2):
            fn()
        calls = 1
        while timer(fn, calls) < MIN_BLOCK_S and calls < 1 << 20:
            calls *= 2
        say({"ready": True, "calls": calls, "params": params})
        for line in sys.stdin:
            if line.strip() == "1":  # the one-thread cross-check: from here on one thread
                torch.set_num_threads(1)
            elif line.strip() == "n":  # back to the threads asked for
                torch.set_num_threads(int(spec["threads"]))
            elif line.strip() != "b":
                break
            say({"t": timer(fn, calls) / calls})
    peak = torch.cuda.max_memory_allocated(device) if cuda else _rss_peak()
    say({"peak_bytes": int(peak), "memory": memory})


TOOL_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds auditor/
NEUTRAL_CWD = os.path.abspath(os.sep)  # the worker's working folder: nothing of the user's folder is on its path


def worker_path() -> list[str]:
    """The worker's module search path: the tool's own location first, then this process's path without the
    working folder (``''`` or its absolute form) nor anything relative, so that a ``json.py`` or an ``auditor/``
    package in the folder the user stands in (or audits with ``.``) is never imported by the worker."""
    cwd = os.path.realpath(os.getcwd())
    out = [TOOL_ROOT]
    for p in sys.path:
        if not p or not os.path.isabs(p) or os.path.realpath(p) == cwd or p in out:
            continue
        out.append(p)
    return out


def worker_command() -> list[str]:
    """``python -I`` (isolated: no working folder, no PYTHON* variables, no user site on the path) running the
    worker with :func:`worker_path` as its search path, set before anything of the tool is imported."""
    boot = (f"import sys; sys.path[:] = {worker_path()!r}; "
            "from auditor.speed.model import main; sys.exit(main())")
    return [sys.executable, "-I", "-c", boot]


def worker_env(threads: int) -> dict[str, str]:
    """The worker's environment: its threads explicit and passive while they wait (OpenMP's default spin-waiting
    on a busy machine stalls single calls 50-150x, and the stall would be timed as the model's)."""
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(max(1, threads)),
            "MKL_NUM_THREADS": str(max(1, threads))}


def absolute_source(source: str) -> str:
    """A source naming a path (``file.py:fn``, a folder, a file) made absolute, as the worker runs elsewhere;
    anything else (``torchvision:NAME``, ``package.module:fn``) as it is."""
    if os.path.exists(source):
        return os.path.abspath(source)
    target, sep, attr = source.rpartition(":")
    if sep and target.endswith(".py") and os.path.isfile(target):
        return f"{os.path.abspath(target)}:{attr}"
    return source


class _Worker:
    """One fresh process serving blocks (``_serve``) over its stdin/stdout; any failure or the deadline is a
    RuntimeError with one line."""

    def __init__(self, spec: dict[str, Any], deadline: float) -> None:
        self.deadline = deadline
        import tempfile

        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill(); a pipe could fill up
        self.p = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, env=worker_env(int(spec["threads"])), cwd=NEUTRAL_CWD, bufsize=1)
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(spec) + "\n")
        self.p.stdin.flush()

    def read(self) -> dict[str, Any]:
        import select
        import time

        assert self.p.stdout is not None
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RuntimeError("the whole-model timing did not finish in time")
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if not ready:
                continue
            line = self.p.stdout.readline()
            if not line:
                self.p.wait(timeout=5)
                self.err.seek(0)
                err = [l for l in self.err.read().splitlines() if l.strip()]
                raise RuntimeError(f"the whole-model timing failed: {err[-1] if err else f'exit {self.p.returncode}'}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, what: str) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        return self.read()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.err.close()


@dataclass(frozen=True)
class Blocks:
    """How long :func:`measure_subprocesses` times: each process at least ``min_blocks`` blocks and ``min_time``
    seconds of calls, at most ``max_blocks`` blocks, all of it within ``timeout`` seconds."""

    timeout: float = TIMEOUT_S
    min_time: float = 0.5
    min_blocks: int = 5
    max_blocks: int = 200


def measure_subprocesses(source: str, load: Any, plans: list[dict[str, int]], device: str, threads: int, *,
                         lead: tuple[int, ...] | None = None, programs: Sequence[tuple[str, str]] = (),
                         blocks: Blocks = Blocks()) -> list[ModelRun]:
    """The model from ``source`` under each plan (``{}``: dense), each in its own fresh process, built one after
    the other (so that their peak memories are their own), then timed in interleaved blocks (a, b, a, b, ...) so
    that a change of the machine's load falls on all alike; ``programs``: exported (path, format) pairs timed
    alike, on the CPU. With more than one thread on the CPU each is then timed on one thread too (the cross-check
    of :func:`check_runs`). A failure, the timeout or a timing that is not repeatable is a RuntimeError."""
    import time

    deadline = time.monotonic() + blocks.timeout
    workers: list[_Worker] = []
    try:
        ready = []
        base = {"source": absolute_source(source), "load": _absolute_load(asdict(load)), "device": device,
                "threads": threads, "lead": list(lead) if lead else None}
        specs = [{**base, "plan": plan} for plan in plans]
        specs += [{**base, "program": os.path.abspath(path), "format": fmt, "device": "cpu"}
                  for path, fmt in programs]
        for spec in specs:
            w = _Worker(spec, deadline)
            workers.append(w)
            ready.append(w.read())
        names = ["the dense model", *(f"plan {i}" for i in range(1, len(plans))),
                 *(os.path.basename(p) for p, _ in programs)]
        for attempt in range(ATTEMPTS):  # a passing load spike gets another chance
            per = _blocks(workers, [int(r["calls"]) for r in ready], blocks, "n" if attempt else "b")
            one = _one_thread(workers, blocks.min_blocks) if threads > 1 and not device.startswith("cuda") else None
            try:
                check_runs(per, one, names, len(plans))
                break
            except RuntimeError:
                if attempt == ATTEMPTS - 1:
                    raise
        out = []
        for i, w in enumerate(workers):
            end = w.ask("q")
            out.append(ModelRun(Timing.of(per[i], int(ready[i]["calls"])), end.get("peak_bytes"),
                                str(end.get("memory", "")), int(ready[i]["params"])))
        return out
    finally:
        for w in workers:
            w.kill()


def _absolute_load(load: dict[str, Any]) -> dict[str, Any]:
    w = load.get("weights")
    return {**load, "weights": os.path.abspath(w)} if isinstance(w, str) and os.path.exists(w) else load


def _blocks(workers: list[_Worker], calls: list[int], blocks: Blocks, first: str = "b") -> list[list[float]]:
    """Per worker, the per-call times of its blocks, timed in rounds (one block of each per round) until each
    has ``min_blocks`` blocks and ``min_time`` seconds (at most ``max_blocks``); ``first``: the command of the
    first block (``n`` after a one-thread cross-check)."""
    per: list[list[float]] = [[] for _ in workers]
    while any(len(p) < blocks.max_blocks and (len(p) < blocks.min_blocks or sum(p) * c < blocks.min_time)
              for p, c in zip(per, calls)):
        for i, w in enumerate(workers):
            if len(per[i]) < blocks.max_blocks:
                per[i].append(float(w.ask(first if not per[i] else "b")["t"]))
    return per


def _one_thread(workers: list[_Worker], n: int) -> list[float]:
    """Each worker's median per-call time over ``n`` blocks on one thread (interleaved as the others)."""
    import statistics

    per: list[list[float]] = [[] for _ in workers]
    for k in range(max(1, n)):
        for i, w in enumerate(workers):
            per[i].append(float(w.ask("1" if k == 0 else "b")["t"]))
    return [statistics.median(p) for p in per]


def check_runs(per: list[list[float]], one: list[float] | None, names: list[str], plans: int) -> None:
    """Refuse (RuntimeError, one line) whole-model timings that cannot be trusted: a time that is not sane, two
    interleaved repeats more than 25% apart, threads slower than one thread by more than 25%, or a plan (of the
    first ``plans``, the first being dense) faster than dense with its threads and slower on one thread (or the
    reverse)."""
    import statistics

    from .timing import refusal, same_verdict

    for i, (p, name) in enumerate(zip(per, names)):
        why = refusal(name, p, one[i] if one is not None else None)
        if why:
            raise RuntimeError(f"the timing is not repeatable: {why}")
    if one is None:
        return
    dense = statistics.median(per[0])
    for i in range(1, plans):
        if not same_verdict(dense, statistics.median(per[i]), one[0], one[i]):
            raise RuntimeError(f"the timing is not repeatable: {names[i]} is faster than the dense model with "
                               "threads and slower on one thread, or the reverse")


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the model's code writes to descriptor 1 (C code, os.write) goes to stderr, not the replies
    sys.stdout = sys.stderr  # and so does what it prints
    _serve(spec, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
