"""Spectra on a Dask cluster: real worker processes on 127.0.0.1 only, stopped by their own process ids."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("distributed", reason="the Dask tests need `distributed` (pip install 'lowrank-auditor[dask]')")

import auditor  # noqa: E402
from _cluster import kill_worker_mid_task  # noqa: E402
from auditor.sources import load_source  # noqa: E402

HOST = "127.0.0.1"


def _write_checkpoint(folder, big: int = 0, n_big: int = 1) -> None:
    """Two shards, a few weights of different shapes, a tied pair saved in both shards."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(14)
    emb = torch.randn(96, 40, generator=g)
    s1 = {"model.embed_tokens.weight": emb, "model.layers.0.mlp.up_proj.weight": torch.randn(112, 40, generator=g),
          "model.layers.0.mlp.down_proj.weight": torch.randn(40, 112, generator=g).to(torch.bfloat16)}
    s2 = {"model.layers.0.self_attn.q_proj.weight": torch.randn(40, 40, generator=g),
          "model.layers.0.self_attn.o_proj.weight": (torch.randn(40, 8, generator=g) @ torch.randn(8, 40, generator=g)),
          "lm_head.weight": emb.clone()}
    for i in range(n_big if big else 0):
        s2[f"model.layers.{i + 1}.mlp.up_proj.weight"] = torch.randn(big, big, generator=g)
    save_file(s1, str(folder / "model-00001-of-00002.safetensors"))
    save_file(s2, str(folder / "model-00002-of-00002.safetensors"))
    wm = {**{k: "model-00001-of-00002.safetensors" for k in s1}, **{k: "model-00002-of-00002.safetensors" for k in s2}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster

    lc = LocalCluster(processes=True, n_workers=2, threads_per_worker=1, host=HOST, dashboard_address=None,
                      silence_logs=40)
    client = Client(lc, set_as_default=False)
    try:
        yield lc, client
    finally:
        client.close()
        lc.close(timeout=20)


def _numbers(a) -> dict:
    d = json.loads(a.to_json(with_sigma=True))
    d["meta"].pop("environment")  # the one part that differs: where the spectra were computed
    return d


def _audit(path, **kw):
    return auditor.audit(load_source(str(path)).model, **kw)


def _audit_as_a_worker(path, **kw):
    """The local reference for a bit-for-bit comparison: each spectrum on one BLAS thread, as a Dask worker computes
    it (the nanny starts workers with one thread). A plain local audit gives each layer cores / layers side by side
    BLAS threads, and OpenBLAS splits dsyrk by thread: on 8 cores the 1536-wide Gram below gets 2 threads and
    differs from the worker's in the last bits (7e-14 of sigma_max, measured), so the bits are only promised here."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _audit(path, jobs=1, **kw)  # one layer at a time leaves the limit as it is


def test_cluster_audit_equals_local_bit_for_bit_and_fills_the_local_cache(cluster, tmp_path):
    lc, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    cache = tmp_path / "cache"
    remote = _audit(ck, scheduler=client, cache_dir=cache, jobs=2)
    local = _audit_as_a_worker(ck, cache=False)
    assert remote.environment["spectra"] == f"dask {lc.scheduler_address} (2 workers)"
    assert local.environment["spectra"] == "local"
    assert remote.spectra_stats["computed"] == 5 and remote.spectra_stats["cached"] == 0
    assert [l.name for l in remote.layers] == [l.name for l in local.layers]
    for name, sp in local.spectra.items():
        assert remote.spectra[name].method == sp.method
        assert np.array_equal(np.asarray(remote.spectra[name].sigma), np.asarray(sp.sigma))  # bit for bit
    assert _numbers(remote) == _numbers(local)
    # a re-audit on this machine reads every spectrum the cluster computed from the local cache
    again = _audit(ck, cache_dir=cache)
    assert again.spectra_stats["cached"] == 5 and again.spectra_stats["computed"] == 0
    for name, sp in local.spectra.items():
        assert np.array_equal(np.asarray(again.spectra[name].sigma), np.asarray(sp.sigma))
    assert again.suggestions == local.suggestions


def test_scheduler_address_string_and_progress(cluster, tmp_path, capsys):
    lc, _ = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    a = _audit(ck, scheduler=lc.scheduler_address, cache=False, progress=True)
    assert a.environment["spectra"] == f"dask {lc.scheduler_address} (2 workers)"
    assert "5/5" in capsys.readouterr().err


def test_task_larger_than_every_worker_limit_is_refused_before_it_runs(cluster, tmp_path, monkeypatch):
    from auditor.spectra import dask_executor as cl

    lc, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    monkeypatch.setattr(cl.DaskExecutor, "_worker_limits", lambda self: {"tcp://a": 50_000, "tcp://b": 60_000})
    a = _audit(ck, scheduler=client, cache=False)
    up = a.spectra["model.layers.0.mlp.up_proj"]  # 112x40 f32: 17,920 B + 8*(1600+4480+40) B = 66,880 B > 60,000
    assert up.sigma is None
    assert up.skipped == ("model.layers.0.mlp.up_proj.weight needs 0.06 MiB (tensor + float64 Gram), more than any "
                          "Dask worker's memory limit (0.06 MiB)")
    # the rest fit under 60,000 B: q_proj 6,400 + 25,920 B; the embedding (tied to lm_head) 15,360 + 43,840 B;
    # down_proj (bfloat16) 8,960 + 48,960 B
    assert [n for n, sp in a.spectra.items() if sp.sigma is None] == ["model.layers.0.mlp.up_proj"]
    assert a.spectra_stats["skipped"] == 1 and a.spectra_stats["computed"] == 4


def test_in_memory_weights_are_computed_here_not_shipped(cluster):
    """A module's parameters stay in this process (a cluster sweep needs the module, tests/test_cluster_sweep.py):
    their spectra run on the local engine, and the report says so."""
    _, client = cluster
    m = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))
    remote = auditor.audit(m, torch.zeros(1, 8), scheduler=client, cache=False)
    local = auditor.audit(m, torch.zeros(1, 8), cache=False)
    assert remote.environment["spectra"] == "local (in-memory weights)"
    assert remote.spectra_stats["computed"] == 2 and not any(client.processing().values())
    assert _numbers(remote) == _numbers(local)


def test_path_map_to_nowhere_exits_2_naming_path_and_worker(cluster, tmp_path, cli_inproc):
    lc, _ = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    t0 = time.monotonic()
    res = cli_inproc(str(ck), "--no-cache", "-q", "--scheduler", lc.scheduler_address,
                     "--path-map", f"{tmp_path}=/nonexistent/lowrank-14")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot open /nonexistent/lowrank-14/ckpt/model-0000")
    assert "(on Dask worker tcp://127.0.0.1:" in line and "--path-map" in line
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("via", ["flag", "env"])
def test_unreachable_scheduler_exits_2_in_seconds(cli_inproc, tmp_path, monkeypatch, via):
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    t0 = time.monotonic()
    if via == "env":
        monkeypatch.setenv("LOWRANK_AUDITOR_SCHEDULER", f"tcp://{HOST}:{port}")
        res = cli_inproc(str(ck), "--no-cache", "-q")
    else:
        res = cli_inproc(str(ck), "--no-cache", "-q", "--scheduler", f"tcp://{HOST}:{port}")
    took = time.monotonic() - t0
    assert res.returncode == 2
    assert f"cannot reach the Dask scheduler at tcp://{HOST}:{port} within 5 s" in res.stderr
    assert took < 15


def test_bad_path_map_flag_exits_2(cli_inproc, tmp_path):
    res = cli_inproc(str(tmp_path), "--path-map", "no-equals-sign")
    assert res.returncode == 2 and "is not CLIENT_PREFIX=WORKER_PREFIX" in res.stderr


def test_worker_killed_mid_task_is_replaced_and_the_audit_completes_identically(cluster, tmp_path):
    lc, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck, big=1536)
    local = _audit_as_a_worker(ck, cache=False)
    # inside the task: the 1536^2 Gram and eigh take about a second on one thread
    remote, victim = kill_worker_mid_task(client, lambda: _audit(ck, scheduler=client, cache=False),
                                          "model.layers.1.mlp.up_proj", settle=0.2)
    assert _numbers(remote) == _numbers(local)
    client.wait_for_workers(2, timeout=30)  # the nanny started a new worker in its place
    assert victim not in client.scheduler_info()["workers"]


def test_cancel_leaves_no_task_on_the_cluster(cluster, tmp_path):
    from auditor.spectra.dask_executor import DaskExecutor
    from auditor.spectra.work import SpectrumTask, compute_task

    _, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck, big=1024)
    w = load_source(str(ck)).model
    tasks = [SpectrumTask(l.name, w.ref(l), (0.9,)) for l in sorted(w.layers().values(), key=lambda l: -l.params)]
    ex = DaskExecutor(client)
    gen = ex.run(compute_task, tasks, [1] * len(tasks))
    next(gen)
    gen.close()  # what Ctrl-C does to the generator: its finally cancels the rest
    deadline = time.monotonic() + 10
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(client.processing().values())


def test_ctrl_c_cancels_the_clusters_tasks(cluster, tmp_path):
    _, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck, big=1536, n_big=8)  # about a second each: 4 s or more of queued work on 2 workers
    main = threading.get_ident()

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 30
        while not any(client.processing().values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        _audit(ck, scheduler=client, cache=False)
    t0 = time.monotonic()
    while any(client.processing().values()) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    # cancelled: the scheduler drops every task at once (uncancelled, the queue would take seconds to drain)
    assert not any(client.processing().values()) and time.monotonic() - t0 < 1.5
