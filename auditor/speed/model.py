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
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from .report import ModelRun
from .timing import Clock, measure

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
        t = measure(lambda: model(*args, **kwargs), device=device, clock=clock, min_time=min_time)
    peak = torch.cuda.max_memory_allocated(device) if cuda else _rss_peak()
    return ModelRun(t, int(peak), memory, params)


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In the fresh process: load, factorize (when a plan is given), measure."""
    from ..options import LoadOptions
    from ..sources import load_source
    from ..structure.trace import ExampleInputs

    torch.set_num_threads(int(spec["threads"]))
    load = spec["load"]
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
    if spec.get("plan"):
        from ..factorize import factorize

        dense = model
        model = factorize(dense, spec["plan"], init=False)
        del dense
        gc.collect()
        _trim()
    run = run_model(model, args, kwargs, spec["device"], min_time=float(spec.get("min_time", 0.5)))
    return run.to_dict()


def measure_subprocess(source: str, load: Any, plan: dict[str, int], device: str, threads: int,
                       lead: tuple[int, ...] | None = None, timeout: float = TIMEOUT_S,
                       min_time: float = 0.5) -> ModelRun:
    """One fresh process measuring the model from ``source`` (dense when ``plan`` is empty). A failure or a
    timeout is a RuntimeError with one line."""
    spec = {"source": source, "load": asdict(load), "plan": plan, "device": device, "threads": threads,
            "lead": list(lead) if lead else None, "min_time": min_time}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run([sys.executable, "-m", "auditor.speed.model"], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the whole-model timing did not finish in {timeout:.0f} s") from None
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        err = [l for l in done.stderr.strip().splitlines() if l.strip()]
        raise RuntimeError(f"the whole-model timing failed: {err[-1] if err else f'exit {done.returncode}'}")
    return ModelRun.from_dict(json.loads(lines[-1]))


def main() -> int:
    spec = json.loads(sys.stdin.read())
    out = _worker(spec)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
