"""Tier 1's whitened decompositions on a Dask cluster (issue 37, item 4): real worker processes on 127.0.0.1 only
(the module-scoped 2-worker LocalCluster of test_cluster.py), stopped by their own process ids. The spectra equal a
local run's bit for bit, also with a worker killed by its pid mid-task; one task per distinct layer input."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("distributed", reason="the Dask tests need `distributed` (pip install 'lowrank-auditor[dask]')")

from _cluster import kill_worker_mid_task  # noqa: E402
from auditor.calibration import load_calibration, tier1  # noqa: E402
from auditor.calibration.statistics.remote import ClusterDecompositions, input_tasks, parts  # noqa: E402
from auditor.calibration.statistics.stats import by_name  # noqa: E402
from auditor.structure.layers import ParamTable, collect_layers  # noqa: E402
from test_cluster import cluster  # noqa: E402,F401 - the fixture: one 2-worker LocalCluster
from test_cluster_sweep import MODEL, calib_file  # noqa: E402,F401 - the digits calibration file

D, LAYERS, CONTEXT, VOCAB = 48, 2, 16, 40


@pytest.fixture(scope="module")
def gpt():
    """A random 2-block char transformer (q, k and v read one input; two embeddings with lookup counts) and its
    tier 1 computed here, one BLAS thread per layer."""
    from chargpt import CharGPT, Config

    torch.manual_seed(0)
    model = CharGPT(Config(vocab=VOCAB, context=CONTEXT, d_model=D, layers=LAYERS, heads=4)).eval()
    ids = torch.randint(0, VOCAB, (96, CONTEXT), dtype=torch.int64)
    cal = load_calibration({"idx": ids}, model, holdout=0.25, batch_size=24)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats, local = tier1(model, layers, cal, align=8)
    return model, layers, stats, local


def _same(remote: dict, local: dict) -> None:
    assert list(remote) == list(local)
    for name, spec in local.items():
        assert asdict(remote[name]) == asdict(spec), name  # every float, bit for bit


def test_tier1_on_the_cluster_equals_local_bit_for_bit_one_task_per_input(cluster, gpt):
    lc, client = cluster
    model, layers, stats, local = gpt
    _, remote = tier1(model, layers, None, align=8, stats=stats, scheduler=client)
    _same(remote, local)
    assert len(local) == 6 * LAYERS + 3  # q k v proj fc out per block, the two embeddings, the head
    table = ParamTable.of(model)
    weights = {l.param: table.tensor(l.param) for l in layers.values()}
    tasks = input_tasks(list(layers.values()), weights, stats, 8, 0.01)
    # q, k and v share one task (their Gram sent once): 4 per block, each embedding and the head alone
    assert len(tasks) == 4 * LAYERS + 3
    assert [t.layer for t in tasks[2:6]] == ["blocks.0.q", "blocks.0.proj", "blocks.0.fc", "blocks.0.out"]
    assert [l.name for l in tasks[2].layers] == ["blocks.0.q", "blocks.0.k", "blocks.0.v"]
    # bytes per task: the float64 Gram once and the float32 weights (a block's q/k/v task: 48^2 * 8 + 3 * 48^2 * 4)
    assert tasks[2].nbytes == D * D * 8 + 3 * D * D * 4
    assert tasks[4].nbytes == D * D * 8 + 4 * D * D * 4  # fc reads d, writes 4d
    assert tasks[0].nbytes == VOCAB * 8 + VOCAB * D * 4  # an embedding: its lookup counts, not a Gram
    with ClusterDecompositions(lc.scheduler_address) as cs:
        again = cs.spectra(list(layers.values()), weights, stats, 8, 0.01)
        assert (cs.tasks, cs.bytes_sent) == (len(tasks), sum(t.nbytes for t in tasks))
        assert cs.where == f"dask {lc.scheduler_address} (2 workers)"
    _same(again, local)


def test_rounds_of_blocks_bound_what_is_in_flight_and_give_the_same_spectra(cluster, gpt, monkeypatch):
    lc, client = cluster
    model, layers, stats, local = gpt
    table = ParamTable.of(model)
    weights = {l.param: table.tensor(l.param) for l in layers.values()}
    cut = parts(model, list(layers.values()))
    assert [[l.name for l in p] for p in cut] == [
        ["tok"], ["pos"], *([f"blocks.{b}.{n}" for n in ("q", "k", "v", "proj", "fc", "out")] for b in range(LAYERS)),
        ["head"]]
    assert parts(None, list(layers.values())) == [list(layers.values())]  # no model: all at once
    seen: list[int] = []
    orig = ClusterDecompositions._run

    def run(self: ClusterDecompositions, fn, part: list) -> list:
        seen.append(len(part))
        return orig(self, fn, part)

    monkeypatch.setattr(ClusterDecompositions, "_run", run)
    done: list[tuple[int, int]] = []
    with ClusterDecompositions(client, model=model) as cs:
        got = cs.spectra(list(layers.values()), weights, stats, 8, 0.01, progress=lambda d, t: done.append((d, t)))
    # tasks in flight at once, a round giving each of the 2 workers one: the two embeddings', then a block's four
    # (q/k/v share one), then the head's (the last)
    assert seen == [2, *[4] * LAYERS, 1]
    assert done == [(i, len(local)) for i in range(1, len(local) + 1)]  # layers counted as their tasks finish
    _same(got, local)


def test_tier3_decompositions_on_the_cluster_equal_local_and_go_to_the_store(cluster, gpt):
    from threadpoolctl import threadpool_limits

    from auditor.calibration.statistics.whiten import Truncator, TruncatorStore

    lc, client = cluster
    model, layers, stats, _ = gpt
    table = ParamTable.of(model)
    weights = {l.param: table.tensor(l.param) for l in layers.values()}
    one = Truncator(layers["blocks.0.out"], weights[layers["blocks.0.out"].param], None)
    store = TruncatorStore(budget=2 * one.cut_bytes)  # one or two in memory, the rest on disk
    done: list[int] = []
    with ClusterDecompositions(client, model=model) as cs:
        cs.truncators(list(layers.values()), weights, stats, store, progress=lambda d, t: done.append(t))
        assert cs.tasks == 4 * LAYERS + 3  # the same tasks as tier 1's: one per distinct input
    assert store.spilled > 0 and len(done) == len(layers) == 6 * LAYERS + 3
    for name, layer in layers.items():
        with threadpool_limits(limits=1, user_api="blas"):  # as a worker computes, and the local tier 3 in tests
            local = Truncator(layer, weights[layer.param], stats.layers[name])
        got, cut = store.get(name), local.cut()  # the store keeps each as its factors at full rank (its cut)
        assert got is not None and len(got.full) == len(cut.full)
        assert all(np.array_equal(a, b) for p, q in zip(got.full, cut.full) for a, b in zip(p, q)), name  # to the bit
        r = min(8, layer.m, layer.n)
        assert all(np.array_equal(a, b) for a, b in zip(got.factors(r), cut.factors(r)))
        assert torch.equal(got.weight(r), cut.weight(r))
    store.close()


def test_factorize_with_a_session_on_the_cluster_gives_the_local_weights(cluster, gpt, monkeypatch):
    from threadpoolctl import threadpool_limits

    from auditor.calibration import CalibrationSession
    from auditor.calibration.apply import factorize
    from auditor.options import AuditOptions

    lc, client = cluster
    model, layers, stats, _ = gpt
    plan = {"blocks.0.fc": 16, "blocks.1.q": 8, "blocks.1.k": 8, "head": 16}
    cal = load_calibration({"idx": torch.zeros(8, CONTEXT, dtype=torch.int64)}, model, holdout=0.25, batch_size=4)
    remote = CalibrationSession(model, cal, layers=layers, stats=stats,
                                options=AuditOptions(scheduler=client, cache=False))
    assert remote.decompositions.on_cluster
    sent: list[list[str]] = []
    orig = ClusterDecompositions._run

    def run(self: ClusterDecompositions, fn, part: list) -> list:
        sent.append([l.name for t in part for l in t.layers])
        return orig(self, fn, part)

    monkeypatch.setattr(ClusterDecompositions, "_run", run)
    got = factorize(model, plan, remote)
    # the plan's layers block by block, a round giving each of the 2 workers a task (q and k: one input, one task)
    assert sent == [["blocks.0.fc", "blocks.1.q", "blocks.1.k"], ["head"]]
    with threadpool_limits(limits=1, user_api="blas"):  # as the workers decompose
        want = factorize(model, plan, CalibrationSession(model, cal, layers=layers, stats=stats))
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    assert any(k.startswith("blocks.1.q.") and k != "blocks.1.q.weight" for k in a)  # q was factorized


class Wide(nn.Module):
    """Four 768-wide layers: each decomposition takes a good part of a second on one thread (a task to kill)."""

    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(768, 768) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = torch.tanh(fc(x))
        return x


def test_a_worker_killed_mid_decomposition_is_replaced_and_the_spectra_are_the_same(cluster):
    lc, client = cluster
    torch.manual_seed(1)
    model = Wide().eval()
    cal = load_calibration({"x": torch.randn(1000, 768)}, model, holdout=0.2, batch_size=200)
    layers = by_name(collect_layers(model, ParamTable.of(model)))
    stats, local = tier1(model, layers, cal, align=8)
    remote, victim = kill_worker_mid_task(
        client, lambda: tier1(model, layers, None, align=8, stats=stats, scheduler=client)[1], "spectra_task",
        settle=0.1, timeout=120)
    _same(remote, local)
    client.wait_for_workers(2, timeout=30)  # the nanny started a new worker in its place
    assert victim not in client.scheduler_info()["workers"]


def _cli_json(cli_inproc, out: Path, *args: object) -> dict:
    out.mkdir()
    r = cli_inproc(MODEL, "--format", "json", "-o", out, "-q", *args)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "lowrank-audit.json").read_text())


def test_cli_audit_runs_tier1_on_the_cluster_and_gives_the_local_json(cluster, calib_file, tmp_path, cli_inproc):
    lc, _ = cluster
    local = _cli_json(cli_inproc, tmp_path / "local", "--calibration", calib_file, "--no-cache")
    # with a cache: the first run's decompositions go block by block with the statistics, the second reads the
    # statistics back from the cache and sends the decompositions one block at a time
    remote = [_cli_json(cli_inproc, tmp_path / f"remote{i}", "--calibration", calib_file, "--cache-dir",
                        tmp_path / "cache", "--scheduler", lc.scheduler_address) for i in (1, 2)]
    env_l = local["meta"].pop("environment")
    assert "tier1" not in env_l
    for r in remote:
        assert r["meta"].pop("environment")["tier1"] == f"dask {lc.scheduler_address} (2 workers)"
        # tier 3 cuts from the gradient pass's loss-aware truncations, made here: nothing left to decompose there
        assert "tier3 decompositions" not in r["calibration"].pop("seconds")
    local["calibration"].pop("seconds")
    assert remote[1]["calibration"]["statistics_cached"] and not remote[0]["calibration"]["statistics_cached"]
    for r in remote:
        r["calibration"].pop("statistics_cached")
    local["calibration"].pop("statistics_cached")
    assert remote[0] == local  # every JSON number
    for key in ("spectra", "spectra_stats"):  # the weight spectra: read from the cache the first run filled
        assert remote[1].pop(key) != local[key]
        local.pop(key)
    assert remote[1] == local
