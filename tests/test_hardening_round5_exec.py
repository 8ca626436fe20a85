"""Hardening round 5 (issue 39), the parts about code that runs unasked and timings that lie: the speed worker runs
isolated (a ``json.py`` or an ``auditor/`` package in the working folder is never imported), the exported-archive
check refuses case variants, duplicate entries and members nobody names, a timing that stalls or does not repeat is
refused and never cached, the speed cache re-validates what it reads and keeps no half-written entry, and a second
Ctrl-C prints no traceback. Every stall is made by a fake clock (tests/_speedclock.py), never by timing luck."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import auditor
from auditor.errors import AuditError
from auditor.export import check_archive, load_program
from auditor.speed.layer_timing import TimeCache, Timer, Unrepeatable, time_layers
from auditor.speed.model import Blocks, check_runs, measure_subprocesses, worker_env, worker_path
from auditor.speed.timing import Timing, refusal
from auditor.structure.trace import ExampleInputs

from _factories import write_low_rank_mlp
from _speedclock import CostClock

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


# --- code that runs without being asked ------------------------------------------------------------------------

def _plant(folder: Path) -> Path:
    """A ``json.py`` and an ``auditor/`` package that each write a marker file when imported."""
    marker = folder / "RAN"
    code = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (folder / "json.py").write_text(code + "from _json_missing import *\n")
    (folder / "auditor").mkdir()
    (folder / "auditor" / "__init__.py").write_text(code)
    return marker


def test_the_worker_path_holds_neither_the_working_folder_nor_relative_entries(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", ".", str(tmp_path), *sys.path])
    path = worker_path()
    assert path[0] == str(ROOT) and "" not in path and "." not in path
    assert all(os.path.isabs(p) and os.path.realpath(p) != str(tmp_path.resolve()) for p in path)


def test_the_worker_waits_passively_on_explicit_threads():
    env = worker_env(3)
    assert (env["OMP_WAIT_POLICY"], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("PASSIVE", "3", "3")


def _dense_timed(source: str, options):
    """The dense model measured in the worker; a busy machine's two repeats more than 25% apart are refused as not
    repeatable (a RuntimeError saying so): measured again, three tries in all."""
    for attempt in range(3):
        try:
            [dense] = measure_subprocesses(source, options, [{}], "cpu", 1,
                                           blocks=Blocks(timeout=120, min_time=0.05, min_blocks=8))
            return dense
        except RuntimeError as e:
            if "not repeatable" not in str(e) or attempt == 2:
                raise


@pytest.mark.parametrize("planted", ["torch.py", "sitecustomize.py", "typing.py", "auditor/speed/__init__.py",
                                     "dataclasses.py"])
def test_the_worker_imports_no_planted_module_of_the_working_folder(tmp_path, monkeypatch, planted):
    """Variants: a module the worker imports (or Python does at start-up) planted in the working folder, with
    ``sys.path`` of this process holding ``''`` as ``python -m`` or ``-c`` would."""
    from auditor.options import LoadOptions

    marker = tmp_path / "RAN"
    target = tmp_path / planted
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"open({str(marker)!r}, 'a').write('ran')\nraise SystemExit(7)\n")
    write_low_rank_mlp(tmp_path / "src", widths=(8, 6, 4), rank=2) if (tmp_path / "src").mkdir() is None else None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    dense = _dense_timed("src/m.py:model", LoadOptions())
    assert not marker.exists() and dense.params == 8 * 6 + 6 + 6 * 4 + 4


def test_the_worker_imports_nothing_from_the_working_folder(tmp_path, monkeypatch):
    """A relative ``m.py:model`` source, run from a folder holding a planted ``json.py`` and ``auditor/``: the
    worker measures the real model (its exact parameter count) and nothing planted runs."""
    from auditor.options import LoadOptions

    marker = _plant(tmp_path)
    write_low_rank_mlp(tmp_path, widths=(8, 6, 4), rank=2)
    monkeypatch.chdir(tmp_path)
    dense = _dense_timed("m.py:model", LoadOptions())
    assert not marker.exists()
    assert dense.params == 8 * 6 + 6 + 6 * 4 + 4 and dense.timing.median > 0


def _isolated_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command line as its console script runs it (no working folder on the path), this tree imported."""
    boot = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from auditor.cli import main; sys.exit(main())"
    return subprocess.run([PY, "-I", "-c", boot, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_measure_speed_from_a_folder_with_planted_modules_runs_none_of_them(tmp_path):
    marker = _plant(tmp_path)
    write_low_rank_mlp(tmp_path, widths=(48, 64, 48, 4), rank=3)
    for _ in range(3):  # a busy machine's two repeats more than 25% apart are refused as not repeatable: again
        r = _isolated_cli("m.py:model", "--measure-speed", "--format", "json", "-q", "--no-cache", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert not marker.exists()
        d = json.loads(r.stdout)
        sp = d["speed"]
        if sp["model"] is not None:
            break
    assert sp["model"]["where"] == "subprocess" and sp["model"]["dense"]["params"] == d["totals"]["params"] == (
        48 * 64 + 64 + 64 * 48 + 48 + 48 * 4 + 4)


def test_cli_factorize_measure_speed_from_a_folder_with_a_planted_json_runs_none_of_it(tmp_path):
    marker = _plant(tmp_path)
    write_low_rank_mlp(tmp_path, widths=(8, 6, 4), rank=2)
    (tmp_path / "plan.toml").write_text('finetune = "none"\n[ranks]\n"0" = 2\n')
    for attempt in range(3):  # a busy machine's repeats more than 25% apart are refused as not repeatable: again
        r = _isolated_cli("factorize", "m.py:model", "--plan", "plan.toml", "-o", f"out{attempt}", "--measure-speed",
                          cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert not marker.exists()
        if "not repeatable" not in r.stderr:
            break
    assert "speed on cpu (1 thread)" in r.stderr and "speed not measured" not in r.stderr


# --- the exported archive ----------------------------------------------------------------------------------------

EVIL = b"cos\nsystem\n(S'touch /nonexistent/evil'\ntR."  # a pickle that runs os.system when loaded


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from auditor.export import cli_write
    from auditor.factorize import factorize, save_factorized

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
    plan = {"0": 4}
    new = factorize(model, plan)
    out = tmp_path_factory.mktemp("export") / "out"
    save_factorized(new, plan, out, source="m.py")
    cli_write(out, new, None, (torch.randn(2, 16),), ("pt2",))
    return out


def _rezip(src: Path, dst: Path, edit) -> None:
    """Copy the archive ``src`` to ``dst`` through ``edit(list of (name, bytes)) -> list of (name, bytes)``."""
    with zipfile.ZipFile(src) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name: that is the point
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
            for name, data in edit(entries):
                z.writestr(name, data)


def _forge(out: Path, tmp_path: Path, edit) -> Path:
    """A copy of the export folder whose model.pt2 is edited and whose plan.json records the new digest (a forger
    updates both)."""
    import hashlib
    import shutil

    d = tmp_path / "forged"
    shutil.copytree(out, d)
    _rezip(out / "model.pt2", d / "model.pt2", edit)
    meta = json.loads((d / "plan.json").read_text())
    data = (d / "model.pt2").read_bytes()
    meta["export"]["pt2"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (d / "plan.json").write_text(json.dumps(meta))
    return d


def _sample_with(entries_edit):
    """An edit of the outer archive that rewrites the sample-input archive inside it."""
    def edit(entries):
        out = []
        for name, data in entries:
            if name.endswith("data/sample_inputs/model.pt"):
                buf = io.BytesIO()
                with zipfile.ZipFile(io.BytesIO(data)) as inner:
                    inner_entries = [(i.filename, inner.read(i)) for i in inner.infolist()]
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
                        for n, b in entries_edit(inner_entries):
                            z.writestr(n, b)
                data = buf.getvalue()
            out.append((name, data))
        return out
    return edit


def _before(target: str, extra: tuple[str, bytes]):
    """Insert ``extra`` just before the member ending with ``target``."""
    def edit(entries):
        i = next(k for k, (n, _) in enumerate(entries) if n.endswith(target))
        return [*entries[:i], extra, *entries[i:]]
    return edit


def _append(*extra: tuple[str, bytes]):
    return lambda entries: [*entries, *extra]


def _rename(target: str, new: str):
    return lambda entries: [(n.replace(target, new) if n.endswith(target) else n, b) for n, b in entries]


def _weights_config(entries) -> dict:
    return json.loads(next(b for n, b in entries if n.endswith("model_weights_config.json")))


# torch.export.save into memory names the archive's one top-level folder "archive"
ARCHIVES = {
    # a malicious sample-input archive before the honest one of the same name (Python's zipfile reads the last)
    "duplicate sample inputs": (lambda e: _before("data/sample_inputs/model.pt", (
        "archive/data/sample_inputs/model.pt", _evil_sample()))(e), "twice"),
    "duplicate weight file": (_before("data/weights/weight_0", ("archive/data/weights/weight_0", b"\0" * 8)), "twice"),
    "duplicate config": (_before("data/weights/model_weights_config.json", (
        "archive/data/weights/model_weights_config.json", json.dumps({"config": {"0.0.weight": {
            "path_name": "weight_0", "use_pickle": True}}}).encode())), "twice"),
    "case-varied twin of a weight": (_append(("archive/data/weights/WEIGHT_0", EVIL)), "twice"),
    "upper-case .PKL weight": (_append(("archive/data/weights/weight_9.PKL", EVIL)), "pickled weight"),
    "mixed-case .Pickle constant": (_append(("archive/data/constants/c.Pickle", EVIL)), "pickled weight"),
    "upper-case .PT weight": (_append(("archive/data/weights/w.PT", EVIL)), "pickled weight"),
    "constants config under a case-varied name": (_append((
        "archive/data/constants/model_constants_config.JSON",
        json.dumps({"config": {"c": {"path_name": "tensor_0", "use_pickle": True}}}).encode())), "twice"),
    "constants config renamed in another case": (_rename("model_constants_config.json", "model_constants_config.JSON"),
                                                 "does not write"),
    "weights config under a case-varied name": (_rename("model_weights_config.json", "Model_Weights_Config.json"),
                                                "does not write"),
    "weight file no config names": (_append(("archive/data/weights/weight_99", EVIL)), "no payload config names"),
    "unexpected member first": (lambda e: [("archive/extra/evil.py", b"import os"), *e], "does not write"),
    "unexpected member last": (_append(("archive/extra/evil.py", b"import os")), "does not write"),
    "upper-case sample inputs": (_rename("data/sample_inputs/model.pt", "data/sample_inputs/MODEL.PT"),
                                 "does not write"),
    "case-varied pickle in the sample inputs": (_sample_with(lambda e: [("archive/DATA.PKL", EVIL), *e]), "twice"),
    "upper-case pickle alone in the sample inputs": (_sample_with(
        lambda e: [(n.replace("data.pkl", "data.PKL"), EVIL if n.endswith("data.pkl") else b) for n, b in e]),
        "os.system"),
    "duplicate pickle in the sample inputs": (_sample_with(_before("archive/data.pkl", ("archive/data.pkl", EVIL))),
                                              "twice"),
    "config key given twice": (lambda e: [(n, b.replace(b'{"0.0.weight": {', b'{"0.0.weight": {"use_pickle": true}, '
                                                        b'"0.0.weight": {', 1)) for n, b in e], "unreadable"),
    "a second root differing in case": (_append(("ARCHIVE/data/weights/weight_0", EVIL)), "twice"),
    "a second program name in another case": (_append(("archive/models/MODEL.json", b"{}")), "twice"),
    "a path through ..": (_append(("archive/data/weights/../weights/weight_7", EVIL)), "does not write"),
    "a backslash path": (_append(("archive/data\\weights\\weight_0.pkl", EVIL)), "does not write"),
    "a folder entry under the weights": (_append(("archive/data/weights/evil/", b"")), "does not write"),
    "a weight file name with a suffix": (_append(("archive/data/weights/weight_0.pt", EVIL)), "pickled weight"),
    "config path name in another case": (lambda e: [(n, b.replace(b'"weight_0"', b'"Weight_0"')) for n, b in e],
                                         "stored as a pickle"),
    "config use_pickle not a boolean false": (lambda e: [(n, b.replace(b'"use_pickle": false', b'"use_pickle": 0', 1))
                                                         for n, b in e], "stored as a pickle"),
}


def _evil_sample() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", EVIL)
        z.writestr("archive/version", b"3\n")
    return buf.getvalue()


@pytest.mark.parametrize("case", list(ARCHIVES))
def test_a_tampered_archive_is_refused_in_one_line_before_torch_reads_it(exported, tmp_path, case):
    edit, says = ARCHIVES[case]
    d = _forge(exported, tmp_path, edit)
    for check in (lambda: check_archive(d / "model.pt2"), lambda: load_program(d)):
        with pytest.raises(AuditError) as e:
            check()
        line = e.value.line()
        assert says in line and "\n" not in line and "Do not load it" in line


def test_the_untampered_archive_still_loads(exported, tmp_path):
    d = _forge(exported, tmp_path, lambda e: e)
    prog = load_program(d)
    assert prog.module()(torch.zeros(1, 16)).shape == (1, 4)


# --- timings that lie ----------------------------------------------------------------------------------------------

class StallClock(CostClock):
    """:class:`CostClock` whose Linear calls cost ``factor`` times more while torch runs more than one thread (as
    spin-waiting OpenMP threads on a busy machine do), or (``inputs``) only the calls on those input tensors."""

    def __init__(self, factor: float = 50.0, inputs: set[int] | None = None, after: int = 0) -> None:
        super().__init__()
        self.factor, self.inputs, self.after, self.reads = factor, inputs, after, 0

    def cost(self, mod: nn.Linear, x: torch.Tensor) -> float:
        base = super().cost(mod, x)
        if self.inputs is not None:
            return base * self.factor if x.data_ptr() in self.inputs else base
        if self.after:
            return base * self.factor if self.reads > self.after else base
        return base * self.factor if torch.get_num_threads() > 1 else base

    def __call__(self) -> float:
        self.reads += 1
        return super().__call__()


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def _pair(w: int = 64):
    lin = nn.Linear(w, w)
    return [(lin, "dense"), (nn.Sequential(nn.Linear(w, 4), nn.Linear(4, w)), "dense rank 4")]


def test_a_stall_of_the_threads_is_refused_not_timed(two_threads, tmp_path):
    """2 threads cost 50x what one thread costs: the one-thread cross-check refuses it, and nothing is cached."""
    timer = Timer(cache=TimeCache(tmp_path), clock=StallClock(), min_time=0.01, cache_fake_times=True)
    with pytest.raises(Unrepeatable, match=r"on one thread \(the threads stall each other\)"):
        timer.times(_pair(), torch.zeros(1, 64))
    assert list(tmp_path.iterdir()) == [] and torch.get_num_threads() == 2


def test_without_a_stall_two_threads_pass_the_cross_check(two_threads, tmp_path):
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    (dense, fact), cached = timer.times(_pair(), torch.zeros(1, 64))
    assert not cached and dense.median == pytest.approx(64 * 64e-9 + 50e-6)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_load_that_comes_midway_is_not_repeatable(tmp_path, monkeypatch, one_thread):
    """Blocks whose second half took twice the first (a load that came midway), in each attempt: refused after
    the third attempt, nothing cached; blocks that hold steady after a cold first block pass."""
    from auditor.speed import layer_timing

    attempts = []

    def blocks(fns, **kw):
        attempts.append(kw)
        return [[1e-4] * 5 + [2e-4] * 5 for _ in fns], [1] * len(fns)

    monkeypatch.setattr(layer_timing, "measure_blocks", blocks)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    with pytest.raises(Unrepeatable, match=r"took 100 µs and 200 µs in two repeats \(more than 25% apart\)"):
        timer.times(_pair(), torch.zeros(1, 64))
    assert len(attempts) == 3 and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(layer_timing, "measure_blocks", lambda fns, **kw: ([[9e-4] + [1e-4] * 9] * len(fns), [1, 1]))
    (dense, _), _ = timer.times(_pair(), torch.zeros(1, 64))
    assert dense.median == 1e-4 and len(list(tmp_path.glob("*.json"))) == 2


def test_a_stalled_layer_disagreeing_with_its_same_shape_twin_is_refused_with_its_break_even(tmp_path):
    """Layers 0 and 2 have one shape; the calls on layer 0's input stall 30x: both rows are refused (a note says
    why), their shared break-even too, and no entry of theirs stays cached."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    x = torch.randn(2, 64)
    a = auditor.audit(model, x, spectra=False, cache=False)
    planned = [(a.layer("0"), 8), (a.layer("2"), 8), (a.layer("4"), 8)]
    from auditor.speed import layer_timing

    clock = StallClock(factor=30, inputs=set())
    real = layer_timing.capture_inputs

    def capture(*args, **kw):
        got = real(*args, **kw)
        clock.inputs = {got["0"].data_ptr()}
        return got

    layer_timing.capture_inputs, saved = capture, layer_timing.capture_inputs
    try:
        timer = Timer(cache=TimeCache(tmp_path), clock=clock, min_time=0.01, cache_fake_times=True)
        rows, bes, notes = time_layers(model, ExampleInputs((x,)), planned, timer, align=8)
    finally:
        layer_timing.capture_inputs = saved
    assert [r.layer for r in rows] == ["4"]
    assert [b.layers for b in bes] == [("4",)]
    [note] = [n for n in notes if "same shape" in n]
    assert note.startswith("Not timed: 0, 2 (traced): layers of the same shape took ") and "more than 25% apart" in note
    cached = {json.loads(p.read_text())["key"]["module"] for p in tmp_path.glob("*.json")}
    assert cached and all(m.startswith(repr(model[4])) for m in cached)


def test_a_layers_cached_dense_time_is_the_one_its_row_reported(tmp_path, one_thread):
    """A clock whose launch cost grows a little with every block: the bisection's probes time the dense layer
    again (a little slower each time); the cache keeps the row's dense time, not the last probe's."""
    class Drift(CostClock):
        def __call__(self) -> float:
            self.launch += 0.02e-6
            return super().__call__()

    model = nn.Sequential(nn.Linear(256, 256))
    x = torch.zeros(1, 256)
    a = auditor.audit(model, x, spectra=False, cache=False)
    timer = Timer(cache=TimeCache(tmp_path), clock=Drift(), min_time=0.01, cache_fake_times=True)
    rows, bes, _ = time_layers(model, ExampleInputs((x,)), [(a.layer("0"), 8)], timer, align=8)
    assert len(bes[0].paired) >= 3 and bes[0].paired[-1].median != rows[0].dense.median
    [key] = [k for k in timer.keys([(model[0], repr(model[0]))], x)]
    assert timer.cache.get(key) == rows[0].dense


BAD_TIMINGS = {
    "nan": {"median_s": math.nan, "q1_s": math.nan, "q3_s": math.nan},
    "zero": {"median_s": 0.0, "q1_s": 0.0, "q3_s": 0.0},
    "negative": {"median_s": -1e-4, "q1_s": -1e-4, "q3_s": -1e-4},
    "infinite": {"median_s": math.inf, "q1_s": math.inf, "q3_s": math.inf},
    "absurd": {"median_s": 1e9, "q1_s": 1e9, "q3_s": 1e9},
    "below a nanosecond": {"median_s": 1e-15, "q1_s": 1e-15, "q3_s": 1e-15},
    "quartiles out of order": {"median_s": 1e-4, "q1_s": 2e-4, "q3_s": 3e-4},
    "a string": {"median_s": "1e-4", "q1_s": 1e-4, "q3_s": 1e-4},
    "a boolean": {"median_s": True, "q1_s": 1e-4, "q3_s": 1e-4},
    "zero blocks": {"blocks": 0},
    "a float count": {"calls_per_block": 1.5},
}


def _entry(timer: Timer, mods, x, timing: dict) -> Path:
    [key, *_] = timer.keys(mods, x)
    path = timer.cache._path(key)
    good = {"median_s": 1e-4, "q1_s": 1e-4, "q3_s": 1e-4, "iqr_s": 0.0, "blocks": 5, "calls_per_block": 1}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "timing": {**good, **timing}}))  # NaN and Infinity as Python writes them
    return path


@pytest.mark.parametrize("case", list(BAD_TIMINGS))
def test_a_planted_insane_cache_entry_is_discarded_and_measured_again(tmp_path, case):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    mods = _pair()
    _entry(timer, mods[:1], x, BAD_TIMINGS[case])
    (dense, _), cached = timer.times(mods, x)
    assert not cached and dense.median == pytest.approx(64 * 64e-9 + 50e-6)
    [key, _] = timer.keys(mods, x)
    assert timer.cache.get(key) == dense  # the measured time replaced it


def test_a_deeply_nested_cache_entry_is_not_an_internal_error(tmp_path):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    mods = _pair()
    [key, _] = timer.keys(mods, x)
    path = timer.cache._path(key)
    path.write_text('{"key": ' + "[" * 5000 + "]" * 5000 + "}")
    assert path.stat().st_size < 16 << 10
    assert timer.cache.get(key) is None and not path.exists()
    (dense, _), cached = timer.times(mods, x)
    assert not cached and dense.median == pytest.approx(64 * 64e-9 + 50e-6)


def test_a_huge_cache_entry_is_not_read(tmp_path, monkeypatch):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    path = _entry(timer, _pair()[:1], x, {})
    path.write_text(path.read_text()[:-1] + ', "pad": "' + "x" * (1 << 20) + '"}')  # valid, sane, 1 MiB
    [key] = timer.keys(_pair()[:1], x)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self}"))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail(f"read {self}"))
    assert timer.cache.get(key) is None and not path.exists()


@pytest.mark.parametrize("text", ["[]", '{"key": 1}', '"x"', "{", "\udcff", '{"timing": {}}'])
def test_a_malformed_or_foreign_cache_entry_is_discarded(tmp_path, text):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    [key] = timer.keys(_pair()[:1], x)
    path = timer.cache._path(key)
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert timer.cache.get(key) is None and not path.exists()


def test_a_symlinked_cache_entry_is_not_followed(tmp_path):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path / "c"), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    _entry(timer, _pair()[:1], x, {})
    [key] = timer.keys(_pair()[:1], x)
    path = timer.cache._path(key)
    path.rename(tmp_path / "elsewhere.json")
    path.symlink_to(tmp_path / "elsewhere.json")
    assert timer.cache.get(key) is None
    (dense, _), cached = timer.times(_pair(), x)
    assert not cached and not path.is_symlink() and timer.cache.get(key) == dense
    assert (tmp_path / "elsewhere.json").exists()  # the link's target is left alone


def test_a_sane_entry_is_read_back(tmp_path):
    x = torch.zeros(1, 64)
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    _entry(timer, _pair()[:1], x, {})
    [key] = timer.keys(_pair()[:1], x)
    assert timer.cache.get(key) == Timing(1e-4, 1e-4, 1e-4, 5, 1)


def _dead_pid() -> int:
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    return p.pid


def test_half_written_entries_of_a_dead_run_are_swept_and_a_write_leaves_none(tmp_path):
    dead = _dead_pid()
    old_style = tmp_path / f"{'a' * 32}.tmp{dead}"
    new_style = tmp_path / f".{'b' * 32}.{dead}.x1y2.tmp"
    live = tmp_path / f".{'c' * 32}.{os.getppid()}.z3.tmp"  # a run still going: left alone
    for p in (old_style, new_style, live):
        p.write_text("{")
    timer = Timer(cache=TimeCache(tmp_path), clock=CostClock(), min_time=0.01, cache_fake_times=True)
    timer.times(_pair(), torch.zeros(1, 64))
    assert not old_style.exists() and not new_style.exists() and live.exists()
    assert sorted(p.suffix for p in tmp_path.iterdir() if p != live) == [".json", ".json"]


def test_an_interrupted_cache_write_leaves_no_half_written_entry(tmp_path, monkeypatch):
    cache = TimeCache(tmp_path)

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.put({"k": 1}, Timing(1e-4, 1e-4, 1e-4, 5, 1))
    assert list(tmp_path.iterdir()) == []


def test_an_audited_object_whose_threads_stall_gets_no_whole_model_time(two_threads):
    """In this process (an audited object has no source to reload) the same checks hold: a 50x stall at two
    threads is refused with a note, the layers too, and the audit goes on."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    a = auditor.audit(model, torch.zeros(1, 64), spectra=False, cache=False, measure_speed=True,
                      speed_clock=StallClock(), plan={"ranks": {"0": 8}})
    sp = a.speed
    assert sp.model is None and sp.layers == []
    assert any(n.startswith("Whole model not timed: the timing is not repeatable: the model took ") and
               "on one thread (the threads stall each other)" in n for n in sp.notes), sp.notes


def test_an_audited_object_without_a_stall_is_timed_in_process(two_threads):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    a = auditor.audit(model, torch.zeros(1, 64), spectra=False, cache=False, measure_speed=True,
                      speed_clock=CostClock(), plan={"ranks": {"0": 8}})
    assert a.speed.model is not None and a.speed.model.where == "in-process"
    assert a.speed.model.dense.timing.median == pytest.approx(64 * 64e-9 + 64 * 16e-9 + 100e-6)


@pytest.mark.parametrize("per, one, says", [
    ([[1e-3] * 6, [1e-3] * 3 + [3e-3] * 3], None, "in two repeats"),  # the plan's second half 3x slower
    ([[35.6e-3] * 6, [30e-3] * 6], [0.52e-3, 0.3e-3], "threads stall"),  # the digits MLP at 2 threads
    ([[1e-3] * 6, [0.5e-3] * 6], [1e-3, 2e-3], "faster than the dense model with threads and slower"),
    ([[1e-3] * 6, [math.nan] * 6], None, "no sane time"),
    ([[1e-3] * 6, [0.0] * 6], None, "no sane time"),
])
def test_whole_model_timings_that_cannot_be_trusted_are_refused(per, one, says):
    with pytest.raises(RuntimeError, match=says):
        check_runs(per, one, ["the dense model", "plan 1"], 2)


def test_whole_model_timings_that_repeat_pass():
    check_runs([[1e-3, 1.1e-3] * 3, [0.6e-3, 0.62e-3] * 3], [1.05e-3, 0.7e-3], ["the dense model", "plan 1"], 2)
    check_runs([[1e-3] * 6, [0.95e-3] * 6], [1e-3, 1.05e-3], ["the dense model", "plan 1"], 2)  # a tie either way


def test_refusal_names_the_two_repeats():
    assert refusal("x", [9e-3, 1e-3, 1e-3, 2e-3, 2e-3]) == "x took 1 ms and 2 ms in two repeats (more than 25% apart)"
    assert refusal("x", [9e-3, 1e-3, 1e-3, 1.1e-3, 1.1e-3]) is None  # the first (sizing, cold) block left out


# --- a second Ctrl-C -------------------------------------------------------------------------------------------------

SLOW = """
import os, threading, time
def model():
    threading.Thread(target=time.sleep, args=(3,)).start()  # joined at exit
    open(os.environ["MARK"], "w").write("ready")
    time.sleep(60)
"""


def test_a_second_ctrl_c_prints_no_traceback(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    mark = tmp_path / "ready"
    p = subprocess.Popen([PY, "-m", "auditor", str(tmp_path / "slow.py") + ":model", "-q", "--no-cache"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MARK": str(mark)}, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)  # while the thread is joined at exit
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 130 and err == "interrupted: no report written\n"


def test_main_called_in_process_puts_the_sigint_handler_back(cli_inproc, tmp_path):
    before = signal.getsignal(signal.SIGINT)
    r = cli_inproc("rules")
    assert r.returncode == 0 and signal.getsignal(signal.SIGINT) is before


# --- what a killed run leaves --------------------------------------------------------------------------------------

def _age(path: Path, seconds: float = 7200) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_killed_runs_scratch_folder_in_tmpdir_is_swept_by_the_next_run(tmp_path, monkeypatch):
    """A run killed (SIGKILL: no finally, no finaliser) while its Grams spill to TMPDIR leaves its folder; the next
    run that makes one removes it, once that process is gone and the folder is an hour old. A live run's folder,
    and a dead run's recent one, stay."""
    import tempfile

    from auditor import _env

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    code = ("import os, signal; from auditor.calibration.statistics.stats import GramStore; s = GramStore(); "
            "open(os.path.join(s.dir, 'g.npy'), 'w').write('x'); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([PY, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}, check=False)
    [left] = list(tmp.iterdir())
    assert left.name.startswith("lowrank-audit-grams-") and (left / "g.npy").exists()
    recent = tmp / f"lowrank-audit-moments-{_dead_pid()}-abc"
    live = tmp / f"lowrank-audit-truncators-{os.getppid()}-abc"
    other = tmp / "lowrank-audit-grams-notapid-x"
    for d in (recent, live, other):
        d.mkdir()
    for d in (left, live, other):
        _age(d)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(_env, "_SWEPT", set())
    from auditor.calibration.statistics.stats import GramStore

    store = GramStore()
    assert not left.exists() and recent.exists() and live.exists() and other.exists() and store.dir.exists()
    assert store.dir.name.startswith(f"lowrank-audit-grams-{os.getpid()}-")


def test_a_killed_runs_staged_calibration_entry_is_swept_from_the_cache(tmp_path, monkeypatch):
    from auditor import _env

    dead = _dead_pid()
    staged = tmp_path / f".{'e' * 32}.{dead}.tmp"
    staged.mkdir()
    (staged / "g.npy").write_text("x")
    _age(staged)
    mine = tmp_path / f".{'f' * 32}.{os.getpid()}.tmp"
    mine.mkdir()
    _age(mine)
    entry = tmp_path / ("a" * 32)
    entry.mkdir()
    _age(entry)
    monkeypatch.setattr(_env, "_SWEPT", set())
    _env.sweep_scratch(tmp_path)
    assert not staged.exists() and mine.exists() and entry.exists()


SLOW_FINALLY = """
import os, time
def model():
    open(os.environ["MARK"], "w").write("ready")
    try:
        time.sleep(60)
    finally:
        time.sleep(2)  # a clean-up the second Ctrl-C falls into
"""


def test_a_second_ctrl_c_during_a_clean_up_is_ignored(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_FINALLY)
    mark = tmp_path / "ready"
    p = subprocess.Popen([PY, "-m", "auditor", str(tmp_path / "slow.py") + ":model", "-q", "--no-cache"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MARK": str(mark)}, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)  # inside the finally
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 130 and err == "interrupted: no report written\n"


def test_a_sigint_ignored_by_the_shell_stays_ignored(tmp_path):
    """A background job (SIGINT ignored when it started) is not interrupted by one: the audit finishes."""
    src = write_low_rank_mlp(tmp_path, widths=(8, 6, 4), rank=2)
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nfrom m import model as _m\ndef model():\n    time.sleep(3)\n    return _m()\n")
    p = subprocess.Popen([PY, "-m", "auditor", f"{slow}:model", "-q", "--no-cache"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert src and p.returncode == 0 and "interrupted" not in err, err
