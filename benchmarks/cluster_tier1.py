"""Tier 1 of the audit (input statistics block by block, each block's whitened decompositions with them) here on
threads against a Dask cluster of 2 single-threaded workers on this machine (docs/cluster.md, issue 37 item 4).

A random Llama shape (width 512 by default, GQA 8/2 heads, intermediate 1376, vocabulary 8,000) and random token
windows; each run is a fresh process (its peak RSS is its own): the session the audit opens
(``CalibrationSession.from_options``), ``statistics(spectra=...)`` as the calibrate stage calls it, cache off. The
cluster is ``dask scheduler`` and ``dask worker --nworkers 2 --nthreads 1`` started here on 127.0.0.1 and stopped by
their process ids. Prints, per mode and round: tier 1's wall, the client's RSS before tier 1 and its peak, the
workers' peaks, and for the cluster the tasks and the bytes they carried; checks the spectra are equal bit for bit.

    python benchmarks/cluster_tier1.py [--width 512] [--depth 8] [--rows 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_and_calibration(width: int, depth: int, rows: int, folder: Path):
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=width, intermediate_size=int(width * 2.6875), num_hidden_layers=depth,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=8000, max_position_embeddings=256,
                      tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(cfg).eval()
    path = folder / "calib.safetensors"
    if not path.exists():
        save_file({"input_ids": torch.randint(0, 8000, (rows, 128), dtype=torch.int64)}, str(path))
    return model, path


def timed(owner: object, name: str, counts: dict[str, float]) -> None:
    """``owner.name`` replaced by a wrapper adding its seconds to ``counts["decompose_s"]``: the decompositions'
    share of tier 1 (the rest is the statistics' forward pass, the same in both modes)."""
    fn = getattr(owner, name)

    def wrapper(*a: object, **kw: object) -> object:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            counts["decompose_s"] = round(counts.get("decompose_s", 0) + time.perf_counter() - t, 2)

    setattr(owner, name, wrapper)


def child(args: argparse.Namespace) -> None:
    """One run of tier 1 in this process; prints one JSON line and pickles the spectra to ``args.out``."""
    from auditor.calibration.session import CalibrationSession
    from auditor.calibration.statistics import remote, whiten
    from auditor.options import AuditOptions
    from auditor.structure.layers import ParamTable, collect_layers
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _util import rss_mb

    counts: dict[str, float] = {}
    close = remote.ClusterDecompositions.close

    def counted(self: remote.ClusterDecompositions) -> None:
        for k in ("tasks", "bytes_sent"):
            counts[k] = counts.get(k, 0) + getattr(self, k)
        counts["largest"] = max(counts.get("largest", 0), self.largest)
        close(self)

    remote.ClusterDecompositions.close = counted  # type: ignore[method-assign]
    timed(whiten, "whitened_spectra", counts)
    timed(remote.ClusterDecompositions, "spectra", counts)
    model, path = model_and_calibration(args.width, args.depth, args.rows, Path(args.folder))
    layers = collect_layers(model, ParamTable.of(model))
    options = AuditOptions(calibration=str(path), cache=False, scheduler=args.scheduler)
    session = CalibrationSession.from_options(model, layers, options)
    before = rss_mb()
    t = time.perf_counter()
    session.statistics(spectra=(8, 0.01))
    spectra = session.spectra(8, 0.01)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.out, "wb") as fh:
        pickle.dump(spectra, fh)
    print(json.dumps({"wall_s": round(wall, 2), "rss_before_mib": round(before), "peak_rss_mib": round(peak),
                      "layers": len(spectra), "where": session.decompositions.where or "local", **counts}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(env: dict[str, str]) -> tuple[str, list[subprocess.Popen]]:
    dask = str(Path(sys.executable).with_name("dask"))
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", addr.rsplit(":", 1)[1],
                               "--dashboard-address", ":0"], env=env, stderr=subprocess.DEVNULL)]
    time.sleep(3)
    procs.append(subprocess.Popen([dask, "worker", addr, "--nworkers", "2", "--nthreads", "1", "--host", "127.0.0.1",
                                   "--no-dashboard"], env=env, stderr=subprocess.DEVNULL))
    from distributed import Client

    with Client(addr, timeout=30) as c:
        c.wait_for_workers(2, timeout=60)
    return addr, procs


def worker_peaks(addr: str) -> list[int]:
    from distributed import Client

    def peak() -> float:
        import resource as r

        return r.getrusage(r.RUSAGE_SELF).ru_maxrss / 1024

    with Client(addr, timeout=30) as c:
        return [round(v) for v in c.run(peak).values()]


def run(args: argparse.Namespace, folder: Path, env: dict[str, str], scheduler: str | None, i: int) -> dict:
    out = folder / f"spectra-{'cluster' if scheduler else 'local'}-{i}.pkl"
    cmd = [sys.executable, __file__, "--child", "--folder", str(folder), "--out", str(out), "--width",
           str(args.width), "--depth", str(args.depth), "--rows", str(args.rows)]
    line = subprocess.run(cmd + (["--scheduler", scheduler] if scheduler else []), env=env, check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {**json.loads(line), "file": str(out)}


def main() -> None:
    p = argparse.ArgumentParser()
    for flag, default in (("--width", 512), ("--depth", 8), ("--rows", 32), ("--rounds", 2)):
        p.add_argument(flag, type=int, default=default)
    for flag in ("--folder", "--out", "--scheduler"):
        p.add_argument(flag)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        addr, procs = start_cluster(env)
        try:
            for i in range(args.rounds):
                local = run(args, folder, env, None, i)
                cluster = run(args, folder, env, addr, i)
                print("local  ", json.dumps({k: v for k, v in local.items() if k != "file"}))
                print("cluster", json.dumps({k: v for k, v in cluster.items() if k != "file"}))
                a, b = (pickle.loads(Path(r["file"]).read_bytes()) for r in (local, cluster))
                print("  spectra equal bit for bit:", list(a) == list(b) and all(a[k] == b[k] for k in a))
            print("workers' peak RSS (MiB, over all rounds):", worker_peaks(addr))
        finally:
            for proc in reversed(procs):
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
