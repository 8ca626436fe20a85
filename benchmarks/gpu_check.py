"""The prepared device check (docs/performance.md), for a machine with a GPU, in one run of a few minutes:

0. the sample Llama's default calibrated audit with ``--device cuda`` end to end (text report): what runs there as
   built, and its wall beside the same audit on this host's CPU;
1. tier 1 of the Llama-2-7B shape on the device (``benchmarks/gpu_llama7b.py``: the statistics and every block's
   whitened decompositions there, as the audit makes them with ``--device cuda``; the first block's spectra made on
   the CPU too and compared), ``--windows`` windows of 2,048 random ids;
2. ``--estimate --device cuda`` of the same shape from its config alone (no weights), with the calibration and flags
   of docs/performance.md's 7B estimate (64 windows of 256 random ids, ``--compute-dtype float32``): the block's
   forward and backward timed on this host, tier 1's and the gradient pass's decompositions timed on the device.

    python benchmarks/gpu_check.py [--windows 32] [--scale 1.0]

Each step runs in its own process under its own limit (100, 100, 200 and 180 seconds, times ``--scale``: 580 s in
all, inside one device call's 600); the outputs' tails are printed, and what timed out says so. Without a GPU it says so in one line and exits 2 (``benchmarks/gpu_llama7b.py --tiny`` checks the first step
on the CPU).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def _run(cmd: list[str], timeout: float) -> tuple[float, str]:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out = done.stdout + done.stderr + ("" if done.returncode == 0 else f"\nexit status {done.returncode}")
    except subprocess.TimeoutExpired as exc:
        out = ((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
        out += f"\ntimed out after {timeout:.0f} s"
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=32, help="tier 1's windows of 2,048 ids (default 32)")
    ap.add_argument("--scale", type=float, default=1.0, help="each step's time limit times this (default 1)")
    a = ap.parse_args()
    import torch
    import transformers

    if not torch.cuda.is_available():
        print("error: this torch sees no CUDA GPU; run it where the task is lent a device "
              "(benchmarks/gpu_llama7b.py --tiny checks tier 1's script on the CPU)", file=sys.stderr)
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama7b"
        transformers.LlamaConfig(**LLAMA_7B, dtype="bfloat16").save_pretrained(config)
        cal = Path(tmp) / "cal.safetensors"
        subprocess.run([sys.executable, str(ROOT / "benchmarks/estimate_shapes.py"), str(cal), "--tinyllama"],
                       check=True, cwd=ROOT)
        llama = [sys.executable, "-m", "auditor", "sample_models/llama", "--calibration", "sample_models/llama/calib.txt",
                 "--holdout", "sample_models/llama/holdout.txt", "--fail-on", "never", "--format", "text", "-o"]
        steps = [
            ("the sample Llama's audit, --device cuda", 100, [*llama, str(Path(tmp) / "cuda"), "--device", "cuda"]),
            ("the sample Llama's audit, --device cpu", 100, [*llama, str(Path(tmp) / "cpu"), "--device", "cpu"]),
            ("tier 1 of the 7B shape on the device", 200, [sys.executable, "benchmarks/gpu_llama7b.py", "--windows",
                                                           str(a.windows)]),
            ("--estimate --device cuda, the 7B shape", 180, [sys.executable, "-m", "auditor", str(config),
                                                             "--calibration", str(cal), "--compute-dtype", "float32",
                                                             "--no-cache", "--estimate", "--device", "cuda"]),
        ]
        for title, limit, cmd in steps:
            took, out = _run(cmd, limit * a.scale)
            print(f"\n== {title} ({took:.1f} s)\n" + "\n".join(out.strip().splitlines()[-30:]), flush=True)


if __name__ == "__main__":
    main()
