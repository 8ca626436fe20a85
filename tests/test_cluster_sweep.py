"""Tier-2 rank-floor sweeps on a Dask cluster, and fsspec URLs as path-map targets: real worker processes on
127.0.0.1 only (the module-scoped LocalCluster of test_cluster.py), stopped by their own process ids."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("distributed", reason="the Dask tests need `distributed` (pip install 'lowrank-auditor[dask]')")

import auditor  # noqa: E402
from _cluster import kill_worker_mid_task  # noqa: E402
from auditor.calibration import CalibrationSession, load_calibration, measure_floors, tier1  # noqa: E402
from auditor.calibration.tiers.cluster import mapped_source, measure_floors_on_cluster  # noqa: E402
from auditor.calibration.measure.metric import Metric  # noqa: E402
from auditor.calibration.statistics.stats import by_name  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from auditor.sources import load_source  # noqa: E402
from auditor.options import AuditOptions, ClusterOptions, LoadOptions  # noqa: E402
from test_cluster import _write_checkpoint, cluster  # noqa: E402,F401 - the fixture: one 2-worker LocalCluster

MODEL = "sample_models/digits.py:mlp"
ROWS = 1200  # 900 for statistics, 300 held out (the last quarter)


@pytest.fixture(autouse=True)
def _one_thread():
    """torch and NumPy's BLAS on one thread here, as on the workers (Dask's nanny starts them with
    OMP_NUM_THREADS=1): the same reduction order, so the cluster's metric values equal the local ones bit for bit."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    from digits import mlp
    from sklearn.datasets import load_digits

    model = mlp()[0]
    x = torch.tensor(load_digits().data[:ROWS], dtype=torch.float32) / 16.0
    cal = load_calibration({"x": x}, model, holdout=0.25, batch_size=300)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats, spectra = tier1(model, layers, cal, align=8)
    return model, cal, layers, stats, spectra


def _labels() -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().target[ROWS - 300:ROWS])


def _same(remote, local) -> None:
    assert list(remote.floors) == list(local.floors)
    for name, f in local.floors.items():
        g = remote.floors[name]
        assert (g.floor, g.cliff_rank, g.keep_dense, g.start_rank) == (
            f.floor, f.cliff_rank, f.keep_dense, f.start_rank)
        assert g.points == f.points and g.top1 == f.top1  # every measured point, bit for bit
        assert (g.metric_at_floor, g.cliff_metric, g.compression, g.reason) == (
            f.metric_at_floor, f.cliff_metric, f.compression, f.reason)
    assert (remote.reference, remote.evaluations, remote.metric, remote.tolerance, remote.align) == (
        local.reference, local.evaluations, local.metric, local.tolerance, local.align)


def _session(model: torch.nn.Module, cal, metric: Metric, stats) -> CalibrationSession:
    """The session a cluster sweep measures with: the calibration, the metric and the statistics at hand."""
    return CalibrationSession(model, cal, metric, stats=stats)


def test_cluster_sweep_equals_local_output_error_and_user_metric(cluster, setup):
    lc, client = cluster
    model, cal, layers, stats, spectra = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    local = measure_floors(model, layers, cal, 0.01, align=8, stats=stats, spectra=spectra)
    session = _session(model, cal, Metric(tolerance=0.01), stats)
    remote, where = measure_floors_on_cluster(model, list(layers.values()), session, 8, spectra,
                                              ClusterOptions(scheduler=client))
    assert where == f"dask {lc.scheduler_address} (2 workers)"
    _same(remote, local)
    # the known floors at 1% output error (tests/test_calibration_floors.py): the cluster measured the same model
    assert [remote.floors[n].floor for n in ("fc1", "fc2", "fc3", "head")] == [24, 8, 8, None]
    labels = _labels()

    def accuracy(m: torch.nn.Module, batches: list) -> float:  # a closure: it goes to the workers by value
        return float((torch.cat([m(**b).argmax(1) for b in batches]) == labels).float().mean())

    only = [layers["fc2"], layers["fc1"]]
    local = measure_floors(model, only, cal, 0.01, align=2, metric=accuracy, stats=stats, spectra=spectra)
    remote, _ = measure_floors_on_cluster(model, only, _session(model, cal, Metric(accuracy, 0.01), stats),
                                          2, spectra, ClusterOptions(scheduler=lc.scheduler_address))
    _same(remote, local)
    assert remote.higher_is_better and remote.floors["fc2"].cliff_metric < remote.reference - 0.01
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model here is untouched
    assert not any(k.startswith("lowrank-sweep-") for k in client.run(lambda dask_worker: list(dask_worker.plugins))
                   .popitem()[1])  # the plugin is removed once the sweep is done


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    from safetensors.torch import save_file
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data[:ROWS], dtype=torch.float32) / 16.0
    path = tmp_path_factory.mktemp("calib") / "digits_calib.safetensors"
    save_file({"x": x.contiguous()}, str(path))
    return path


def _cli_json(cli_inproc, out: Path, *args: str) -> dict:
    out.mkdir()
    r = cli_inproc(MODEL, "--format", "json", "-o", out, "-q", "--no-cache", *args)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "lowrank-audit.json").read_text())


def test_cli_sweep_on_the_cluster_gives_the_local_json(cluster, calib_file, tmp_path, cli_inproc):
    lc, client = cluster
    metric = tmp_path / "acc.py"
    metric.write_text("import torch\nfrom sklearn.datasets import load_digits\n\n"
                      f"LABELS = torch.tensor(load_digits().target[{ROWS - 300}:{ROWS}])\n\n\n"
                      "def accuracy(model, batches):\n"
                      "    preds = torch.cat([model(**b).argmax(1) for b in batches])\n"
                      "    return float((preds == LABELS).float().mean())\n")
    args = ("--calibration", calib_file, "--measure-floor", "--metric", f"{metric}:accuracy", "--tolerance", "0.01")
    local = _cli_json(cli_inproc, tmp_path / "local", *args)
    remote = _cli_json(cli_inproc, tmp_path / "remote", *args, "--scheduler", lc.scheduler_address)
    env_l, env_r = local["meta"].pop("environment"), remote["meta"].pop("environment")
    assert env_l["sweep"] == "local" and env_r["sweep"] == f"dask {lc.scheduler_address} (2 workers)"
    assert env_r["spectra"] == "local (in-memory weights)"  # a factory's weights are in this process: computed here
    for d in (local, remote):
        d["calibration"].pop("seconds")
    assert remote["calibration"]["measured_floors"] and remote["calibration"]["metric"] == "accuracy"
    floors = {k: v["floor"]["floor"] for k, v in remote["calibration"]["layers"].items() if v["floor"]}
    assert floors and len(floors) == len([v for v in local["calibration"]["layers"].values() if v["floor"]])
    assert remote == local  # every JSON number

    def loaded_digits_by_source() -> bool:
        import sys

        return any(k.startswith("_lowrank_user_") and str(getattr(m, "__file__", "")).endswith("digits.py")
                   for k, m in list(sys.modules.items()))

    # a command-line run sends the source spec, not the model: the workers imported digits.py themselves
    assert any(client.run(loaded_digits_by_source).values())


def test_sweep_progress_counts_tasks(cluster, setup, capsys):
    lc, _ = cluster
    model, cal, layers, stats, spectra = setup
    measure_floors_on_cluster(model, list(layers.values()), _session(model, cal, Metric(tolerance=0.01), stats),
                              8, spectra, ClusterOptions(scheduler=lc.scheduler_address), True)
    err = capsys.readouterr().err
    assert "sweep" in err and "4/4" in err


def test_model_goes_by_source_with_mapped_paths():
    root = Path(__file__).resolve().parents[1]
    spec, load = mapped_source(MODEL, LoadOptions(weights=None), ((str(root), "/mnt/worker/repo"),))
    assert spec == "/mnt/worker/repo/sample_models/digits.py:mlp" and load.weights is None
    spec, load = mapped_source(f"{root}/sample_models/digits.py:mlp",
                               LoadOptions(weights=str(root / "sample_models" / "digits_mlp.safetensors")),
                               ((str(root / "sample_models"), "/w"),))
    assert (spec, load.weights) == ("/w/digits.py:mlp", "/w/digits_mlp.safetensors")
    assert mapped_source("package.module:build", LoadOptions(), ((str(root), "/w"),))[0] == "package.module:build"
    # load_source reads local files only: a source mapped to a URL is sent by value instead
    assert mapped_source(MODEL, LoadOptions(), ((str(root), "s3://bucket/repo"),)) is None


def test_worker_killed_mid_sweep_is_replaced_and_the_floors_are_the_same(cluster, setup):
    lc, client = cluster
    model, cal, layers, stats, spectra = setup
    labels = _labels()

    def slow_accuracy(m: torch.nn.Module, batches: list) -> float:  # ~0.15 s per evaluation: tasks of a second
        time.sleep(0.15)
        return float((torch.cat([m(**b).argmax(1) for b in batches]) == labels).float().mean())

    only = [layers["fc1"], layers["fc2"], layers["fc3"]]
    local = measure_floors(model, only, cal, 0.01, align=4, metric=slow_accuracy, stats=stats, spectra=spectra)
    # inside the task: its worker is loading the model or measuring
    floors, victim = kill_worker_mid_task(
        client, lambda: measure_floors_on_cluster(model, only, _session(model, cal, Metric(slow_accuracy, 0.01), stats),
                                                  4, spectra, ClusterOptions(scheduler=client))[0],
        "sweep_task", settle=0.5, timeout=90)
    _same(floors, local)
    client.wait_for_workers(2, timeout=30)  # the nanny started a new worker in its place
    assert victim not in client.scheduler_info()["workers"]


def test_file_url_path_map_reads_through_fsspec(cluster, tmp_path, monkeypatch):
    from auditor.spectra import dask_executor as cl

    _, client = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    w = load_source(str(ck)).model
    remote = auditor.audit(w, scheduler=client, cache=False, path_map=((str(tmp_path), f"file://{tmp_path}"),))
    local = auditor.audit(load_source(str(ck)).model, cache=False)
    assert remote.environment["spectra"].startswith("dask ")
    for name, sp in local.spectra.items():
        assert np.array_equal(np.asarray(remote.spectra[name].sigma), np.asarray(sp.sigma))
    # the memory refusal is decided here from the header's sizes, URL or not (numbers: test_cluster.py)
    monkeypatch.setattr(cl.DaskExecutor, "_worker_limits", lambda self: {"tcp://a": 50_000, "tcp://b": 60_000})
    a = auditor.audit(w, scheduler=client, cache=False, path_map=((str(tmp_path), f"file://{tmp_path}"),))
    assert [n for n, sp in a.spectra.items() if sp.sigma is None] == ["model.layers.0.mlp.up_proj"]
    assert "more than any Dask worker's memory limit (0.06 MiB)" in a.spectra["model.layers.0.mlp.up_proj"].skipped


@pytest.mark.parametrize("target,says", [
    ("foo://bucket/ckpts", "fsspec has no filesystem for foo://"),
    ("s3://bucket/ckpts", "pip install s3fs"),
])
def test_url_fsspec_cannot_read_exits_2_with_one_line(cluster, tmp_path, cli_inproc, target, says):
    if target.startswith("s3") and __import__("importlib").util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here: s3:// is readable")
    lc, _ = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    res = cli_inproc(str(ck), "--no-cache", "-q", "--scheduler", lc.scheduler_address,
                     "--path-map", f"{tmp_path}={target}")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot read {target}/ckpt/model-0000")
    assert says in lines[0] and "(on Dask worker tcp://127.0.0.1:" in lines[0]


def test_url_to_a_missing_file_names_the_url_and_the_worker(cluster, tmp_path, cli_inproc):
    lc, _ = cluster
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _write_checkpoint(ck)
    res = cli_inproc(str(ck), "--no-cache", "-q", "--scheduler", lc.scheduler_address,
                     "--path-map", f"{tmp_path}=file:///nonexistent/lowrank-14")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot open file:///nonexistent/lowrank-14/ckpt/model-0000")
    assert "(on Dask worker tcp://127.0.0.1:" in line and "--path-map" in line


def test_ctrl_c_cancels_the_sweep_tasks_and_removes_the_plugin(cluster, setup):
    _, client = cluster
    model, cal, layers, stats, spectra = setup

    def slow(m: torch.nn.Module, batches: list) -> float:  # 0.3 s per evaluation: several seconds of queued work
        time.sleep(0.3)
        return 1.0

    main = threading.get_ident()

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 30
        while not any("sweep_task" in str(k) for ks in client.processing().values() for k in ks) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        measure_floors_on_cluster(model, list(layers.values()), _session(model, cal, Metric(slow, 0.01), stats),
                                  4, spectra, ClusterOptions(scheduler=client))
    t0 = time.monotonic()
    while any(client.processing().values()) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    # cancelled at once (uncancelled, 4 layers of 0.3 s evaluations would keep both workers busy for seconds)
    assert not any(client.processing().values()) and time.monotonic() - t0 < 1.5
    plugins = client.run(lambda dask_worker: [k for k in dask_worker.plugins if k.startswith("lowrank-sweep-")])
    assert not any(plugins.values())


def test_a_factory_that_builds_another_model_on_the_workers_exits_2(cluster, calib_file, tmp_path, cli_inproc):
    """Workers load the model from its source and check its weights: random initialisation gives other weights there,
    and sweeping them would measure another model."""
    lc, _ = cluster
    factory = tmp_path / "unseeded.py"
    factory.write_text("from torch import nn\n\n\ndef build():\n"
                       "    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(),"
                       " nn.Linear(96, 10))\n")
    res = cli_inproc(f"{factory}:build", "-q", "--no-cache", "--no-spectra", "--calibration", calib_file,
                     "--measure-floor", "--scheduler", lc.scheduler_address)
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the model built from {factory}:build on this worker differs from the client's")
    assert "(on Dask worker tcp://127.0.0.1:" in line and "--weights" in line
