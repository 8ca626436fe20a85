"""Speed (auditor/speed): the timer's mechanics on a fake clock, the time break-even bisection on a cost model whose
crossover follows from its numbers, the plan chosen by latency, the cache, the reports' speed sections (only when
measured) and the command line's bad input. No test reads a wall time: where real modules run, only the structure
of the result is checked."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import auditor
from auditor.speed.layer_timing import TimeCache, Timer, bisect_break_even, rank_grid, time_break_even, time_layers
from auditor.speedresults import LayerSpeed, ModelRun, SpeedReport, seconds
from auditor.speed.speed_stage import candidates, latency_plan
from auditor.speed.timing import MIN_BLOCK_S, Timing, measure, measure_many
from auditor.structure.trace import ExampleInputs

from _speedclock import CostClock


class Ticker:
    """A clock that a call of ``work`` advances by ``step`` seconds."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_measure_sizes_blocks_to_the_minimum_block_time_on_a_fake_clock():
    clk = Ticker()

    def work() -> None:
        clk.t += 0.0003  # 0.3 ms a call: a block needs 7 calls to last 2 ms

    t = measure(work, clock=clk, min_time=0.1, min_blocks=5, warmup=0)
    assert t.calls * 0.0003 >= MIN_BLOCK_S > (t.calls // 2) * 0.0003
    assert t.median == pytest.approx(0.0003) and t.iqr == pytest.approx(0.0, abs=1e-12)
    assert t.blocks * t.calls * 0.0003 >= 0.1


def test_measure_many_interleaves_blocks_so_a_load_change_falls_on_both():
    """The machine slows down by 10x half-way through: measured side by side, the ratio of the two calls is kept."""
    clk = Ticker()
    calls = {"n": 0}

    def slow_down() -> float:
        return 10.0 if calls["n"] > 400 else 1.0

    def a() -> None:
        calls["n"] += 1
        clk.t += 0.001 * slow_down()

    def b() -> None:
        calls["n"] += 1
        clk.t += 0.003 * slow_down()

    ta, tb = measure_many([a, b], clock=clk, min_time=0.5, min_blocks=5, warmup=0)
    assert tb.median / ta.median == pytest.approx(3.0)


def test_timing_quartiles_and_round_trip():
    t = Timing.of([1.0, 2.0, 3.0, 4.0, 100.0], calls=3)
    assert (t.median, t.q1, t.q3, t.blocks, t.calls) == (3.0, 2.0, 4.0, 5, 3)
    assert Timing.from_dict(t.to_dict()) == t


@pytest.mark.parametrize("m, n, align, grid_head, step", [
    (4096, 4096, 8, [64, 128, 192], 64),  # break-even 2048: 32 ranks 64 apart
    (512, 512, 8, [8, 16, 24], 8),
    (10, 256, 8, [1, 2, 3], 1),  # break-even 9.6: every rank up to 9
    (64, 64, 8, [1, 2, 3], 1),  # break-even 32: every rank up to 32
])
def test_rank_grid(m, n, align, grid_head, step):
    grid, got_step = rank_grid(m, n, align)
    assert grid[:3] == grid_head and got_step == step and grid[-1] <= m * n / (m + n) < grid[-1] + step


def test_time_break_even_on_a_cost_model_is_the_crossover_it_implies():
    """dense 512x512 at batch 1: 262,144 MACs x 1 ns + 50 us = 312.1 us; factorized at rank r: 1,024 r ns + 100 us,
    faster while r < 207.1: on the grid of 8 the time break-even is 200."""
    lin = nn.Linear(512, 512)
    a = auditor.audit(nn.Sequential(lin), torch.zeros(1, 512), spectra=False, cache=False)
    timer = Timer(clock=CostClock(), min_time=0.01)
    be = time_break_even(a.layer("0"), lin, torch.zeros(1, 512), timer, align=8, at="traced")
    assert be.rank == 200 and be.step == 8 and not be.capped and be.param_break_even == 256.0
    assert be.dense.median == pytest.approx(312.144e-6)
    assert [r for r, _ in be.probes] == [128, 192, 224, 208, 200]  # bisection: five of the 32 ranks measured
    assert dict(be.probes)[208].median == pytest.approx(208 * 1.024e-6 + 100e-6)


def test_time_break_even_none_when_even_the_smallest_rank_is_slower():
    lin = nn.Linear(16, 16)  # dense 256 ns + 50 us; any factorization pays two launches (100 us)
    a = auditor.audit(nn.Sequential(lin), torch.zeros(1, 16), spectra=False, cache=False)
    be = time_break_even(a.layer("0"), lin, torch.zeros(1, 16), Timer(clock=CostClock(), min_time=0.01), 8, "traced")
    assert be.rank is None and be.label() == "none (rank 1 is already slower)"


def test_time_layers_shares_one_measurement_between_identical_layers_and_times_the_latency_shape():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    a = auditor.audit(model, torch.zeros(2, 64), spectra=False, cache=False)
    planned = [(a.layer("0"), 8), (a.layer("2"), 8)]
    rows, bes, notes = time_layers(model, ExampleInputs((torch.zeros(2, 64),)), planned,
                                   Timer(clock=CostClock(), min_time=0.01), align=8, latency_shape=(4, 3))
    assert [(r.layer, r.at, r.input_shape) for r in rows] == [
        ("0", "traced", (2, 64)), ("0", "latency-shape", (4, 3, 64)),
        ("2", "traced", (2, 64)), ("2", "latency-shape", (4, 3, 64))]
    assert [(b.layers, b.at) for b in bes] == [(("0", "2"), "traced"), (("0", "2"), "latency-shape")]
    assert rows[1].dense.median == pytest.approx(12 * 4096e-9 + 50e-6) and notes == []


def test_layer_timings_are_cached_by_shape_rank_dtype_device_threads_and_versions(tmp_path):
    lin = nn.Linear(8, 8)
    x = torch.zeros(1, 8)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), cache_fake_times=True)  # no timing luck
    first, hit = timer.times([(lin, "Linear(8, 8)")], x)
    again, hit2 = timer.times([(lin, "Linear(8, 8)")], x)
    assert (hit, hit2, again) == (False, True, first) and timer.hits == 1
    other, hit3 = timer.times([(lin, "Linear(8, 8)")], x.double().float()[:, :8].expand(2, 8))
    assert not hit3  # another input shape is another entry
    [entry, *_] = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert {"device", "device_name", "threads", "torch", "module", "input", "input_dtype"} <= set(entry["key"])


def _layer_speed(name: str, dense: float, fact: float) -> LayerSpeed:
    return LayerSpeed(name, "linear", 64, 64, 8, (1, 64), "traced", Timing(dense, dense, dense, 5, 1),
                      Timing(fact, fact, fact, 5, 1))


def _run(seconds_: float) -> ModelRun:
    return ModelRun(Timing(seconds_, seconds_, seconds_, 5, 1), None, "", 0)


def test_budget_latency_leaves_the_layers_that_cost_time_dense_until_the_measured_latency_meets_it():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    a = auditor.audit(model, torch.zeros(1, 64), spectra=False, cache=False)
    items = [(a.layer("0"), 8), (a.layer("1"), 8), (a.layer("2"), 8)]
    timed = {"0": _layer_speed("0", 10.0, 4.0), "1": _layer_speed("1", 10.0, 13.0), "2": _layer_speed("2", 10.0, 11.0)}
    assert [[l.name for l, _ in p] for p in candidates(items, timed)] == [["0", "1", "2"], ["0", "2"], ["0"]]
    asked = []

    def run(ranks: dict[str, int]) -> tuple[ModelRun, ModelRun]:  # 30 s dense, each layer's change added
        asked.append(sorted(ranks))
        return _run(30.0), _run(30.0 + sum(timed[k].factorized.median - 10.0 for k in ranks))

    lp = latency_plan(0.15, items, timed, run)  # 15% of 30 s: at most 25.5 s
    assert asked == [["0", "1", "2"], ["0", "2"]] and lp.ranks == {"0": 8, "2": 8} and lp.dropped == ("1",)
    assert lp.measured.timing.median == 25.0 and lp.predicted_change == pytest.approx(-5 / 30)
    assert lp.params_removed == 2 * (64 * 64 - 8 * 128)
    none = latency_plan(0.5, items, timed, run)
    assert not none.met and none.ranks == {} and none.measured is None


def test_seconds_reads_as_a_person_would_write_it():
    assert [seconds(x) for x in (3.87e-5, 2.74e-3, 1.2, 4e-8, 0.1234)] == ["38.7 µs", "2.74 ms", "1.2 s", "40 ns",
                                                                          "123 ms"]


# ---- through the audit: LR020, the reports ------------------------------------------------------------------
def _slow_plan_audit(rank: int, **kw):
    """A 512x512 layer at batch 1 on a cost clock a thousand times slower than the default (so that a block is one
    call and the audit measures few): dense 312.1 ms, factorized 1,024 r us + 100 ms."""
    torch.manual_seed(0)
    return auditor.audit(nn.Sequential(nn.Linear(512, 512)), torch.zeros(1, 512), plan={"ranks": {"0": rank}},
                         spectra=False, cache=False, measure_speed=True, speed_clock=CostClock(1e-6, 50e-3), **kw)


def test_lr020_flags_a_layer_planned_past_its_time_break_even_with_both_times_and_the_faster_rank():
    a = _slow_plan_audit(240, settings=auditor.Settings(select=("LR020",)))
    [f] = a.findings
    assert f.code == "LR020" and f.layers == ["0"]
    assert f.evidence == dict(rank=240, factorized_s=pytest.approx(345.76e-3), dense_s=pytest.approx(312.144e-3),
                              device="cpu", threads=torch.get_num_threads(), input_shape=[1, 512], at="traced",
                              time_break_even=200)
    assert "346 ms against 312 ms dense" in f.message and "rank 200 or below is faster" in f.message


def test_speed_sections_in_json_text_and_markdown_only_when_measured():
    a = _slow_plan_audit(64)
    d = json.loads(a.to_json())["speed"]
    assert (d["device"], d["dtype"], d["threads"]) == ("cpu", "float32", torch.get_num_threads())
    [row] = d["layers"]
    assert row["dense"]["median_s"] == pytest.approx(312.144e-3) and {"q1_s", "q3_s", "iqr_s"} <= set(row["dense"])
    assert row["speedup"] == pytest.approx(312.144 / (64 * 1.024 + 100))
    assert d["model"]["where"] == "in-process" and d["model"]["factorized"]["params"] == 512 + 64 * 1024
    assert d["model"]["speedup"] == pytest.approx(row["speedup"])  # the model is that one layer
    jsonschema = pytest.importorskip("jsonschema")
    from pathlib import Path

    schema = json.loads((Path(__file__).resolve().parents[1] / "docs" / "schema.json").read_text())
    jsonschema.validate(json.loads(a.to_json()), schema)
    md = a.to_markdown()
    assert f"- **Speed**: size -75%, latency -47% on cpu ({_threads()}), batch 1" in md
    assert "### Speed (measured)" in md and "| `0` | 64 | 1x512 | 4.00 | 4.00 |" in md
    assert "speed, measured on cpu" in a.to_text()
    plain = auditor.audit(nn.Sequential(nn.Linear(512, 512)), torch.zeros(1, 512), spectra=False, cache=False)
    assert "speed" not in json.loads(plain.to_json()) and "Speed" not in plain.to_markdown()


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n != 1 else ''}"


def test_speed_report_where_names_threads_on_cpu_only():
    assert SpeedReport("cpu", "float32", 1, {}).where() == "cpu (1 thread)"
    assert SpeedReport("cuda:0", "float16", 8, {}).where() == "cuda:0"


@pytest.mark.parametrize("args, says", [
    (["--budget-latency", "1.5"], "latency budget 1.5 is not a fraction in (0, 1)"),
    (["--latency-shape", "0,128"], "--latency-shape '0,128' is not a shape"),
])
def test_cli_bad_speed_flags_are_one_line_and_exit_2(cli_inproc, tmp_path, args, says):
    from _factories import write_low_rank_mlp

    r = cli_inproc(write_low_rank_mlp(tmp_path), *args, "-q")
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cli_device_cuda_without_a_gpu_is_refused(cli_inproc, tmp_path):
    from _factories import write_low_rank_mlp

    r = cli_inproc(write_low_rank_mlp(tmp_path), "--measure-speed", "--device", "cuda", "-q")
    assert r.returncode == 2 and "cuda" in r.stderr.lower() and len(r.stderr.strip().splitlines()) == 1


def test_cli_measure_speed_times_the_whole_model_in_fresh_processes(cli, tmp_path):
    """Real times (not checked), exact parameter counts: the dense and the factorized model each in its own process."""
    from _factories import write_low_rank_mlp

    src = write_low_rank_mlp(tmp_path, widths=(48, 64, 48, 4), rank=3)
    for _ in range(3):  # a busy machine's two repeats more than 25% apart are refused as not repeatable: again
        r = cli(src, "--measure-speed", "--format", "json", "-q", env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        sp, rv = d["speed"], d["plan_review"]
        if sp["model"] is not None:
            break
    assert sp["threads"] == 1 and sp["model"]["where"] == "subprocess"
    assert sp["model"]["dense"]["params"] == d["totals"]["params"]
    assert sp["model"]["factorized"]["params"] == d["totals"]["params"] - rv["params_before"] + rv["params_after"]
    assert sp["model"]["dense"]["memory"] in ("rss", "rss-process-peak") and sp["model"]["dense"]["peak_bytes"] > 0
    timed, planned = {s["layer"] for s in sp["layers"]}, {i["layer"] for i in rv["items"]}
    assert timed and timed <= planned
    # a layer whose times a busy machine made unrepeatable is refused and said so, never reported
    assert all(any(n.startswith("Not timed:") and layer in n for n in sp["notes"]) for layer in planned - timed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_timing_on_cuda_uses_events():
    lin = nn.Linear(256, 256).cuda()
    timer = Timer(device="cuda", min_time=0.01)
    (t,), _ = timer.times([(lin, "Linear(256, 256) cuda")], torch.zeros(4, 256))
    assert t.median > 0 and t.blocks >= 5


def test_html_speed_section_only_when_measured(monkeypatch):
    """The HTML (and so the PDF) gains a speed table with x time beside x params and x MACs; other reports do not."""
    from pathlib import Path

    import auditor.render.html as html

    monkeypatch.setattr(html, "template_dir", lambda: Path(__file__).resolve().parents[1] / "templates")
    html._env.cache_clear()
    try:
        page = _slow_plan_audit(240).to_html()
        plain = auditor.audit(nn.Sequential(nn.Linear(512, 512)), torch.zeros(1, 512), spectra=False,
                              cache=False).to_html()
    finally:
        html._env.cache_clear()
    assert '<section id="speed">' in page
    assert '<th title="dense time / factorized time, measured; above 1 is faster">× time</th>' in page
    assert ("<td>240</td><td>1x512</td><td>1.07</td><td>1.07</td><td>312 ms ±0 ns</td><td>346 ms ±0 ns</td>"
            "<td>0.90</td><td>200</td><td>256.0</td>") in page
    assert 'id="speed"' not in plain


def test_cli_factorize_export_measure_speed_times_the_pt2_program_too(cli, tmp_path):
    """Each of dense, factorized and the exported .pt2 in its own process: one line each (times not checked)."""
    from _factories import write_low_rank_mlp

    src = write_low_rank_mlp(tmp_path, widths=(48, 64, 48, 4), rank=3)
    plan = tmp_path / "plan.toml"
    plan.write_text('finetune = "none"\n[ranks]\n"0" = 8\n')
    head = "speed on cpu (1 thread), median ±half the IQR per forward, peak RSS:"
    for attempt in range(3):  # a busy machine's two repeats more than 25% apart are refused as not repeatable: again
        r = cli("factorize", src, "--plan", plan, "-o", tmp_path / f"out{attempt}", "--export", "pt2",
                "--measure-speed", env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        lines = r.stderr.splitlines()
        if head in lines or "not repeatable" not in r.stderr:
            break
    start = lines.index(head)
    assert [l.split(":")[0].strip() for l in lines[start + 1:start + 4]] == ["dense", "factorized",
                                                                          "model.pt2 (torch)"]
    assert "x time 1.00" in lines[start + 1] and "MiB" in lines[start + 3]


def test_cli_measure_speed_on_a_weights_only_checkpoint_is_one_line_and_exit_2(cli_inproc):
    r = cli_inproc("sample_models/digits_mlp.safetensors", "--measure-speed", "-q", "--no-cache")
    assert r.returncode == 2 and "--measure-speed needs the model's code" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_budget_frontier_plans_are_timed_end_to_end_beside_the_dense_model():
    """With --budget, the calibration's frontier plans (at most 4, spread over it) each timed whole; on the cost
    clock each factorized model's parameter count is exact and its time follows from its ranks."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 4) @ torch.randn(4, 64))
    rows = {"x": torch.randn(200, 64, generator=torch.Generator().manual_seed(0))}
    a = auditor.audit(nn.Sequential(lin), torch.zeros(1, 64), cache=False, calibration=rows, budget=0.5,
                      measure_speed=True, speed_clock=CostClock(1e-6, 50e-3))
    sp, frontier = a.speed, a.calibration.budget.frontier
    assert 1 <= len(sp.frontier) <= 4 and sp.frontier_dense.timing.median == pytest.approx(4096e-6 + 50e-3)
    by_removed = {p.removed: p for p in frontier}
    for f in sp.frontier:
        r = by_removed[f.removed].plan["0"]
        assert f.run.params == 4096 - f.removed == r * 128
        assert f.run.timing.median == pytest.approx(r * 128e-6 + 100e-3)
    assert "frontier (--budget), latency beside the dense model's" in a.to_text()


def test_each_layer_kind_says_whether_its_module_is_timed_alone_and_at_which_shape():
    """--measure-speed asks the kinds (``LayerKind.timed``, ``timing_shape``); a kind registered later says it too."""
    from auditor import kinds
    from auditor.results import Kind
    from auditor.speed.layer_timing import reshape_input

    assert sorted(str(k.kind) for k in kinds.kinds() if k.timed) == sorted(
        str(k) for k in (Kind.LINEAR, Kind.CONV1D_HF, Kind.CONV, Kind.EMBEDDING))
    x = torch.zeros(2, 3, 8, 8)
    assert reshape_input(x, Kind.CONV, (5, 7)).shape == (5, 3, 8, 8)
    assert reshape_input(torch.zeros(2, 16), Kind.LINEAR, (4, 9)).shape == (4, 9, 16)
    ids = reshape_input(torch.tensor([[3, 1]]), Kind.EMBEDDING, (4, 9))
    assert ids.shape == (4, 9) and ids.dtype == torch.int64 and int(ids.max()) <= 3
