"""Issue 19, the command line and calibration inputs: exit codes (an internal error is 3, user code's exits are its
failure, exit 2), every calibration batch checked before any work, caps on rows, bytes and the Grams' memory, the
statistics cache verified, the metric's direction and the forward's repeatability checked, clear words for odd
paths and flags, tied vectors counted once, and the library's entry points in eval mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from auditor.errors import AuditError, ExitCode

ROOT = Path(__file__).resolve().parents[1]

FACTORY = '''
import sys
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
    with torch.no_grad():
        m[0].weight.copy_(torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g))
        m[2].weight.copy_(torch.randn(48, 3, generator=g) @ torch.randn(3, 64, generator=g))
    return m, (torch.zeros(1, 48),)


def rows(n=16, width=48, seed=1):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def cal():
    return [rows(seed=s) for s in range(4)]


def cal_other():
    return [rows(seed=s + 10) for s in range(4)]


TARGETS = {}


def _targets(model, batches):
    key = tuple(float(b.sum()) for b in batches)
    if key not in TARGETS:
        with torch.no_grad():
            TARGETS[key] = [model(b) for b in batches]  # the first call scores the dense model
    return TARGETS[key]


def neg_mse(model, batches):
    return -float(sum((model(b) - t).pow(2).mean() for b, t in zip(batches, _targets(model, batches))))


def mse(model, batches):
    return -neg_mse(model, batches)


def exit0(model, batches):
    sys.exit(0)


def exit3(model, batches):
    sys.exit(3)


class Custom(BaseException):
    pass


def custom(model, batches):
    raise Custom("from the metric")


def cal_exit0():
    sys.exit(0)


def cal_exit3():
    yield rows()
    sys.exit(3)


def cal_custom():
    raise Custom("from the calibration")


def endless():
    while True:
        yield rows(2)


def endless_empty():
    while True:
        yield torch.zeros(0, 48)


def wide_later():
    return [rows(), rows(seed=2), rows(width=40)]


def dtype_later():
    return [rows(), rows(seed=2).double(), rows(seed=3)]


def structure_later():
    return [rows(), (rows(seed=2), rows(seed=3)), rows(seed=4)]


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(48, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.fc(x) + 0.1 * torch.randn(x.shape[0], 64))


def noisy():
    return Noisy(), (torch.zeros(1, 48),)


class Ids(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, input_ids, attention_mask=None):
        h = self.fc(self.emb(input_ids))
        return h if attention_mask is None else h * attention_mask[..., None]


def ids():
    return Ids(), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}


def ids_cal(bad=None, mask=None):
    g = torch.Generator().manual_seed(0)
    out = [{"input_ids": torch.randint(0, 100, (4, 8), generator=g), "attention_mask": torch.ones(4, 8,
            dtype=torch.long)} for _ in range(4)]
    if bad is not None:
        out[-1]["input_ids"][1, 2] = bad
    if mask is not None:
        out[2]["attention_mask"] = mask
    return out


def ids_oov():
    return ids_cal(bad=100)


def ids_negative():
    return ids_cal(bad=-1)


def mask_zero():
    return ids_cal(mask=torch.zeros(4, 8, dtype=torch.long))


def mask_row_zero():
    m = torch.ones(4, 8, dtype=torch.long)
    m[3] = 0
    return ids_cal(mask=m)


def wide():
    return nn.Sequential(nn.Linear(100_000, 8, bias=False), nn.Linear(8, 4)), (torch.zeros(1, 100_000),)


def wide_cal():
    return [torch.zeros(2, 100_000)]
'''


@pytest.fixture
def src(tmp_path) -> str:
    p = tmp_path / "h19.py"
    p.write_text(FACTORY)
    return str(p)


def one_line(res, code: int = 2, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---- exit codes ----------------------------------------------------------------------------------------------------

def test_an_internal_error_is_one_line_and_exit_3_with_the_traceback_under_verbose(cli_inproc, src, monkeypatch):
    import auditor.pipeline

    def broken(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(auditor.pipeline, "audit_source", broken)
    res = cli_inproc(f"{src}:model", "-q")
    assert ExitCode.INTERNAL == 3
    one_line(res, 3, "internal error: KeyError: 'a bug'", "--verbose")
    res = cli_inproc(f"{src}:model", "-q", "--verbose")
    assert res.returncode == 3 and "Traceback" in res.stderr and "raise KeyError" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("internal error: KeyError")


def test_internal_error_in_a_subcommand_is_exit_3(cli_inproc, src, monkeypatch):
    import auditor.cli.factorize_command

    monkeypatch.setattr(auditor.cli.factorize_command, "run", lambda args: 1 / 0)
    one_line(cli_inproc("factorize", f"{src}:model", "--plan", "p.toml", "-o", "x"), 3, "ZeroDivisionError")


@pytest.mark.parametrize("fn,said", [("exit0", "metric exit0 called sys.exit(0) instead of returning"),
                                     ("exit3", "metric exit3 called sys.exit(3) instead of returning"),
                                     ("custom", "metric custom raised Custom: from the metric")])
def test_a_metric_that_exits_or_raises_a_base_exception_is_exit_2(cli_inproc, src, tmp_path, fn, said):
    res = cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:cal", "--metric", f"{src}:{fn}",
                     "--measure-floor", "--no-cache", "--format", "json", "-o", tmp_path / "out")
    one_line(res, 2, said)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fn,said", [("cal_exit0", "calibration function {src}:cal_exit0() called sys.exit(0)"),
                                     ("cal_exit3", "calibration function {src}:cal_exit3() called sys.exit(3)"),
                                     ("cal_custom", "calibration function {src}:cal_custom() raised Custom: from "
                                                    "the calibration")])
def test_a_calibration_function_that_exits_is_exit_2(cli_inproc, src, fn, said):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:{fn}", "--no-cache"), 2, said.format(src=src))


def test_a_usage_error_is_one_line(cli_inproc, src):
    res = cli_inproc(f"{src}:model", "--frobnicate")
    assert one_line(res, 2) == "error: unrecognized arguments: --frobnicate. See lowrank-audit --help."
    assert "usage:" not in res.stderr
    one_line(cli_inproc("rules", "--nope"), 2, "See lowrank-audit rules --help")


def test_help_text_lists_the_exit_codes():
    from auditor.cli.audit_command import _parser

    text = " ".join(_parser().format_help().split())
    assert "Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input" in text
    assert "3 internal error (a bug; --verbose shows the traceback), 130 interrupted" in text


def _closed_stdout(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command line started with descriptor 1 closed, as ``lowrank-audit ... >&-`` does."""
    return subprocess.run([sys.executable, "-m", "auditor", *map(str, args)], cwd=cwd, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
                          preexec_fn=lambda: os.close(1))


def test_stdout_closed(src, tmp_path):
    res = _closed_stdout([f"{src}:model", "--format", "json", "--no-cache"], tmp_path)
    one_line(res, 2, "standard output is closed (>&-), and the json would go there")
    res = _closed_stdout([f"{src}:model", "-q", "--format", "json", "-o", tmp_path / "out", "--no-cache"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "out" / "lowrank-audit.json").read_text())["format_version"] == 1


# ---- every batch checked, and caps -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,said", [
    ("wide_later", "calibration held-out batch 0 from {src}:wide_later (arg0 16x40; batch 0: 16x48) does not fit "
                   "Sequential.forward: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("dtype_later", "calibration batch 1 from {src}:dtype_later has other inputs than batch 0: input 0 float64 2-D, "
                    "where batch 0 has float32 2-D"),
    ("structure_later", "calibration batch 1 from {src}:structure_later has other inputs than batch 0: 2 positional "
                        "and keywords none, where batch 0 has 1 positional and keywords none"),
])
def test_later_and_held_out_batches_are_checked(cli_inproc, src, fn, said):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:{fn}", "--no-cache"), 2, said.format(src=src))


@pytest.mark.parametrize("fn,said", [
    ("ids_oov", "calibration input input_ids in held-out batch 0 from {src}:ids_oov holds token id 100, outside the "
                "model's vocabulary (0 to 99: its largest embedding has 100 rows)"),
    ("ids_negative", "calibration input input_ids in held-out batch 0 from {src}:ids_negative holds token id -1"),
    ("mask_zero", "calibration attention_mask in batch 2 from {src}:mask_zero is all zeros (every position masked "
                  "out)"),
    ("mask_row_zero", "calibration attention_mask in batch 2 from {src}:mask_row_zero is all zeros in row 3"),
])
def test_token_ids_and_masks_of_every_batch(cli_inproc, src, fn, said):
    one_line(cli_inproc(f"{src}:ids", "-q", "--calibration", f"{src}:{fn}", "--no-cache"), 2, said.format(src=src))


def test_a_later_batch_of_another_length_that_fits_is_accepted(src):
    from auditor.calibration import load_calibration
    from auditor.sources import load_source

    m = load_source(f"{src}:ids").model
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (4, n), generator=g)} for n in (8, 8, 12, 5)]
    cal = load_calibration(batches, m, 0.25)
    assert [b.kwargs["input_ids"].shape[1] for b in cal.fit + cal.holdout] == [8, 8, 12, 5]


def test_an_endless_generator_stops_at_the_row_cap(cli_inproc, src):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:endless", "--calibration-max-rows", "1000",
                        "--no-cache"), 2, f"calibration source {src}:endless yields more than 1,000 rows (stopped "
             "reading at batch 500)", "--calibration-max-rows 2000")
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:endless_empty", "--calibration-max-rows", "50",
                        "--no-cache"), 2, "yields more than 50 rows (stopped reading at batch 50)")


def test_byte_cap_on_yielded_tensors_and_files(cli_inproc, src, tmp_path):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:endless", "--calibration-max-bytes", "64K",
                        "--no-cache"), 2, "yields more than 64.0 KiB of tensors (stopped reading at batch 170)")
    from safetensors.torch import save_file

    f = tmp_path / "big.safetensors"
    save_file({"input": torch.zeros(4096, 48)}, str(f))
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f, "--calibration-max-bytes", "100K", "--no-cache"), 2,
             f"calibration file {f} is 768.1 KiB, more than the 100.0 KiB calibration data is capped at")
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f, "--calibration-max-rows", "4000", "--no-cache"), 2,
             f"calibration source {f} holds 4,096 rows, more than the cap of 4,000")
    assert cli_inproc(f"{src}:model", "-q", "--calibration", f, "--no-cache").returncode == 0


@pytest.mark.parametrize("flag,value,said", [("--calibration-max-bytes", "lots", "--calibration-max-bytes 'lots' is "
                                                                                  "not a size"),
                                             ("--calibration-max-rows", "0", "calibration_max_rows 0 is not a "
                                                                             "positive whole number")])
def test_bad_cap_values(cli_inproc, src, flag, value, said):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:cal", flag, value), 2, said)


def test_caps_need_calibration(cli_inproc, src):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration-max-rows", "10"), 2,
             "--calibration-max-rows need(s) calibration data")


def test_the_grams_memory_is_estimated_before_allocating(cli_inproc, src, monkeypatch):
    """The CLI's pre-flight estimate refuses first, naming the stage and the Gram that dominates it; the library's
    own check (an audit called without that estimate) refuses before any Gram is allocated too."""
    import auditor.sources.hf as hf
    import auditor.spectra.backend as backend

    monkeypatch.setattr(hf, "available_memory", lambda: 16 << 30)
    monkeypatch.setattr(backend, "available_memory", lambda: 16 << 30)
    line = one_line(cli_inproc(f"{src}:wide", "-q", "--no-spectra", "--calibration", f"{src}:wide_cal", "--holdout",
                               "0", "--no-cache"), 2,
                    "of host memory (in its verification stage: the sequential fit's float64 Grams and whitenings "
                    "n x n, the largest 100,000 x 100,000) but 16,384 MiB is available")  # the plan fitted as
    #                  factorize writes it (the number the audit states) holds two Grams and a whitening per input
    assert "--estimate prints each stage's cost" in line
    from auditor.calibration.session import _check_memory
    from auditor.sources import load_source
    from auditor.structure.layers import ParamTable, collect_layers

    model = load_source(f"{src}:wide").model
    with pytest.raises(AuditError) as e:
        _check_memory(list(collect_layers(model, ParamTable.of(model)).values()), model)
    assert ("calibration statistics need about 223.5 GiB of memory (a float64 Gram n x n per layer input; the "
            "largest: layer 0 (100,000 x 100,000)), and 16.0 GiB is available") in str(e.value)


def test_statistics_memory_counts_every_layer():
    from auditor.calibration.stage import statistics_memory
    from auditor.structure.layers import ParamTable, collect_layers

    m = nn.Sequential(nn.Linear(10, 20), nn.Conv2d(4, 6, 3, groups=2), nn.Embedding(50, 7))
    need, largest = statistics_memory(list(collect_layers(m, ParamTable.of(m)).values()))
    grams = 8 * (10 * 10 + 2 * 18 * 18 + 50)
    assert need == grams + 2 * 8 * 2 * 18 * 18 and largest == "layer 1 (2 x 18 x 18)"


def test_one_row_cannot_be_split(src):
    from auditor.calibration import load_calibration

    with pytest.raises(AuditError, match="holds one row, so nothing can be held out of it"):
        load_calibration({"input": torch.zeros(1, 48)}, None, 0.25)
    assert load_calibration({"input": torch.zeros(1, 48)}, None, 0).holdout_rows == 0


# ---- the statistics cache ------------------------------------------------------------------------------------------

def _tier1(cli_inproc, src, out: Path, cache: Path, cal: str = "cal") -> dict:
    res = cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:{cal}", "--cache-dir", cache, "--format", "json",
                     "-o", out)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "lowrank-audit.json").read_text())["calibration"]


def _ranks(c: dict) -> dict:
    return {k: v["ranks_for"] for k, v in c["layers"].items()}


def _entry(cache: Path) -> Path:
    [meta] = list((cache / "calibration").glob("*/meta.json"))
    return meta.parent


@pytest.mark.parametrize("damage", ["foreign", "nan", "shape", "negative", "asymmetric", "bytes", "not-psd", "meta",
                                    "gone"])
def test_a_damaged_or_foreign_statistics_entry_is_recomputed(cli_inproc, src, tmp_path, damage):
    from auditor.calibration.statistics.stats import InputStatistics, replace_gram

    cache = tmp_path / "cache"
    first = _tier1(cli_inproc, src, tmp_path / "1", cache)
    assert first["statistics_cached"] is False
    assert _tier1(cli_inproc, src, tmp_path / "2", cache)["statistics_cached"] is True
    entry = _entry(cache)
    gram_file = entry / InputStatistics.open(entry).layers.meta["2"]["file"]
    if damage == "foreign":  # another calibration's entry copied over this one's
        other = _tier1(cli_inproc, src, tmp_path / "o", tmp_path / "c2", cal="cal_other")
        assert _ranks(other) != _ranks(first)
        shutil.rmtree(entry)
        shutil.copytree(_entry(tmp_path / "c2"), entry)
    elif damage in ("bytes", "meta"):
        f = gram_file if damage == "bytes" else entry / "meta.json"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))
    elif damage == "gone":
        gram_file.unlink()
    else:
        stats = InputStatistics.open(entry)
        layers = {k: replace_gram(v, np.array(v.gram)) for k, v in stats.layers.items()}
        g = layers["2"].gram
        if damage == "nan":
            g[0, 1, 1] = np.nan
        elif damage == "shape":
            layers["2"].gram = g[:, :10, :10].copy()
        elif damage == "negative":
            g[0, 3, 3] = -1.0
        elif damage == "asymmetric":
            g[0, 1, 2] += 1.0
        else:
            g[0, 1, 2] = g[0, 2, 1] = 2 * np.sqrt(g[0, 1, 1] * g[0, 2, 2])
        InputStatistics(layers, stats.missing, stats.warnings, stats.batches, stats.digest).spill(
            entry, key=entry.name)  # valid checksums: the content checks must catch it
    again = _tier1(cli_inproc, src, tmp_path / "3", cache)
    assert again["statistics_cached"] is False and _ranks(again) == _ranks(first)
    assert _tier1(cli_inproc, src, tmp_path / "4", cache)["statistics_cached"] is True  # rewritten, intact


def test_a_spilled_gram_that_changes_during_the_audit_is_refused(tmp_path, src):
    from auditor.calibration import input_statistics, load_calibration
    from auditor.calibration.statistics.stats import InputStatistics, StatisticsMismatch
    from auditor.layers import ParamTable, collect_layers
    from auditor.load import load_source

    m = load_source(f"{src}:model").model
    stats = input_statistics(m, collect_layers(m, ParamTable.of(m)), load_calibration([torch.randn(16, 48)], m, 0))
    spilled = stats.spill(tmp_path / "s", key="abc")
    assert all(np.array_equal(spilled.layers[k].gram, v.gram) for k, v in stats.layers.items())
    f = tmp_path / "s" / spilled.layers.meta["2"]["file"]
    raw = bytearray(f.read_bytes())
    raw[-8] ^= 0x01  # the lowest mantissa bit of the last entry: still a valid Gram, only the checksum sees it
    f.write_bytes(bytes(raw))
    with pytest.raises(StatisticsMismatch, match="2: its Gram file g.*changed"):
        spilled.layers["2"]
    with pytest.raises(StatisticsMismatch, match="changed"):
        InputStatistics.open(tmp_path / "s", key="abc")
    with pytest.raises(StatisticsMismatch, match="another key"):
        InputStatistics.open(tmp_path / "s", key="abd")


def test_statistics_round_trip_and_key(tmp_path, src):
    from auditor.calibration import input_statistics, load_calibration
    from auditor.calibration.statistics.stats import InputStatistics, StatisticsMismatch
    from auditor.structure.layers import ParamTable, collect_layers
    from auditor.sources import load_source

    m = load_source(f"{src}:model").model
    stats = input_statistics(m, collect_layers(m, ParamTable.of(m)), load_calibration([torch.randn(16, 48)], m, 0))
    stats.save(tmp_path / "s.npz", key="abc")
    back = InputStatistics.load(tmp_path / "s.npz", key="abc")
    assert all(np.array_equal(back.layers[k].gram, v.gram) for k, v in stats.layers.items())
    with pytest.raises(StatisticsMismatch, match="another key"):
        InputStatistics.load(tmp_path / "s.npz", key="abd")


# ---- the metric and the forward ------------------------------------------------------------------------------------

def test_a_lower_is_better_metric_is_refused(cli_inproc, src):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:cal", "--metric", f"{src}:mse",
                        "--measure-floor", "--no-cache"), 2,
             "metric mse rises when the model is cut down (", "with every layer at rank 1, 0 dense): it looks "
             "lower-is-better", "return the negative (e.g. -loss)")


def test_a_higher_is_better_metric_is_accepted(cli_inproc, src, tmp_path):
    res = cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:cal", "--metric", f"{src}:neg_mse",
                     "--tolerance", "0.001", "--measure-floor", "--no-cache", "--format", "json", "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    cal = json.loads((tmp_path / "lowrank-audit.json").read_text())["calibration"]
    assert not [w for w in cal["warnings"] if "barely moves" in w]
    assert cal["layers"]["0"]["floor"]["floor"] is not None


def test_a_metric_blind_to_truncation_is_a_warning(src):
    from auditor.calibration import Evaluator, Metric, load_calibration
    from auditor.sources import load_source

    m = load_source(f"{src}:model").model
    cal = load_calibration([torch.randn(8, 48) for _ in range(3)], m, 0.34)
    ev = Evaluator(m, cal, Metric(lambda model, batches: 1.0, 0.01, "constant"))
    assert [w for w in ev.warnings if w.startswith("metric constant barely moves when the model is cut down")]
    assert not cal.warnings  # returned to the caller, not written on the calibration it was handed


def test_the_direction_check_restores_every_weight_bit_for_bit(src):
    from auditor.calibration import Evaluator, Metric, load_calibration
    from auditor.sources import load_source

    m = load_source(f"{src}:model").model
    before = {k: v.clone() for k, v in m.state_dict().items()}
    cal = load_calibration([torch.randn(8, 48) for _ in range(3)], m, 0.34)
    with torch.no_grad():
        dense = m(cal.holdout[0].args[0])
    Evaluator(m, cal, Metric(lambda model, batches: -float((model(batches[0]) - dense).pow(2).sum()), 0.01, "s"))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_a_nondeterministic_forward_is_refused(cli_inproc, src):
    one_line(cli_inproc(f"{src}:noisy", "-q", "--calibration", f"{src}:cal", "--measure-floor", "--no-cache"), 2,
             "the model's forward does not repeat: two runs on held-out batch 0 differ by",
             "(at most 1e-06 allowed)", "likely noise in the forward")


def test_dropout_left_on_is_named(src):
    from auditor.calibration import Evaluator, load_calibration

    m = nn.Sequential(nn.Linear(48, 64), nn.Dropout(0.5), nn.Linear(64, 4)).train()
    cal = load_calibration([torch.randn(8, 48) for _ in range(3)], m, 0.34)
    with pytest.raises(AuditError, match=r"likely it is in training mode \(dropout on\)"):
        Evaluator(m, cal)


# ---- words -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what,said", [("fifo", "is a FIFO (named pipe), not a file"),
                                       ("folder", "is a folder, not a file"), ("device", "is a device, not a file"),
                                       ("missing", "does not exist"),
                                       ("dangling", "is a symbolic link to nothing")])
def test_odd_calibration_paths_are_named_for_what_they_are(cli_inproc, src, tmp_path, what, said):
    p = tmp_path / "cal.safetensors"
    if what == "fifo":
        os.mkfifo(p)
    elif what == "folder":
        p.mkdir()
    elif what == "device":
        p = Path("/dev/null")
    elif what == "dangling":
        p.symlink_to(tmp_path / "gone")
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", p, "--no-cache"), 2, f"calibration file {p} {said}")


def test_unreadable_calibration_file(tmp_path):
    from auditor.calibration.data.inputs import describe_missing

    p = tmp_path / "x.safetensors"
    p.write_bytes(b"x")
    p.chmod(0)
    try:
        if os.access(p, os.R_OK):
            pytest.skip("running as root: every file is readable")
        assert describe_missing(p) == "cannot be read (permission denied)"
    finally:
        p.chmod(0o600)


@pytest.mark.parametrize("value,said", [("nan", "tolerance nan is not a finite number"),
                                        ("inf", "tolerance inf is not a finite number"),
                                        ("-0.1", "tolerance -0.1 is negative")])
def test_tolerance_words(cli_inproc, src, value, said):
    one_line(cli_inproc(f"{src}:model", "-q", "--calibration", f"{src}:cal", "--tolerance", value), 2, said)


def test_path_map_without_a_scheduler_is_refused(cli_inproc, src, monkeypatch):
    monkeypatch.delenv("LOWRANK_AUDITOR_SCHEDULER", raising=False)
    one_line(cli_inproc(f"{src}:model", "-q", "--path-map", "/a=/b"), 2,
             "--path-map applies to a Dask cluster, and no --scheduler is given")


@pytest.mark.parametrize("address,said", [
    ("ucx://127.0.0.1:8786", "ucx:// needs UCX and the ucx-py package"),
    ("tls://127.0.0.1:8786", "tls:// needs TLS certificates"),
    ("inproc://10.0.0.1/1/1", "inproc:// is a scheduler inside another process's memory"),
    ("garbage", "--scheduler 'garbage' is not a scheduler address (HOST:PORT, port 1 to 65535)"),
    ("tcp://", "is not a scheduler address"), ("tcp://h:notaport", "is not a scheduler address"),
    ("tcp://h:70000", "is not a scheduler address"), ("gopher://h:70", "has the unknown scheme gopher://"),
])
def test_malformed_scheduler_addresses_fail_at_once_with_one_line(cli_inproc, src, address, said):
    one_line(cli_inproc(f"{src}:model", "-q", "--scheduler", address), 2, said)


def test_connect_timeout_must_be_a_number(cli_inproc, src, monkeypatch):
    monkeypatch.setenv("LOWRANK_AUDITOR_CONNECT_TIMEOUT", "soon")
    one_line(cli_inproc(f"{src}:model", "-q", "--scheduler", "tcp://127.0.0.1:8786"), 2,
             "$LOWRANK_AUDITOR_CONNECT_TIMEOUT='soon' is not a number of seconds")
    from auditor.spectra.dask_executor import DaskExecutor

    with pytest.raises(AuditError, match="is not a number of seconds"):
        DaskExecutor("tcp://127.0.0.1:8786")


# ---- counting ---------------------------------------------------------------------------------------------------------

def test_a_tied_bias_is_counted_once_in_a_weights_only_audit(tmp_path):
    import auditor
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    bias = torch.randn(25, generator=g)
    save_file({"cls.predictions.bias": bias, "cls.predictions.decoder.bias": bias.clone(),
               "cls.predictions.decoder.weight": torch.randn(25, 16, generator=g),
               "ln1.weight": torch.ones(16), "ln2.weight": torch.ones(16),  # equal by initialisation: both count
               "fc.weight": torch.randn(16, 16, generator=g)}, str(tmp_path / "m.safetensors"))
    a = auditor.audit_source(str(tmp_path / "m.safetensors"), options=auditor.AuditOptions(spectra=False))
    assert a.total_params == 25 + 25 * 16 + 16 + 16 + 16 * 16


def test_shared_storage_in_a_state_dict_is_counted_once_whatever_it_holds(tmp_path):
    from auditor.sources import WeightsOnly

    z = torch.zeros(30)
    torch.save({"a.bias": z, "b.bias": z, "c.bias": torch.zeros(30), "w.weight": torch.ones(4, 30)},
               tmp_path / "m.pt")
    w = WeightsOnly.from_state_dict(tmp_path / "m.pt")
    assert w.ties() == {"b.bias": "a.bias"} and w.total_params == 30 + 30 + 120


def test_two_parameter_objects_on_one_storage_are_one_tensor():
    from auditor.structure.layers import ParamTable

    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    m[1].weight = nn.Parameter(m[0].weight.data)  # another Parameter object, the same bytes
    table = ParamTable.of(m)
    assert table.total == 64 + 8 + 8 and table.names_of("1.weight") == ["0.weight", "1.weight"]


# ---- eval mode ----------------------------------------------------------------------------------------------------

def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 64), nn.Dropout(0.5), nn.Linear(64, 4))
    m.train()
    m[1].eval()  # a caller's mixed modes come back exactly
    m[1].train()
    m[2].eval()
    return m


def test_library_entry_points_run_in_eval_mode_and_restore_the_modes():
    from auditor.calibration import curves_from_spectra, input_statistics, load_calibration, plan_for_budget, tier1
    from auditor.factorize import factorize
    from auditor.structure.layers import ParamTable, collect_layers

    m = _dropout_model()
    modes = [x.training for x in m.modules()]
    layers = collect_layers(m, ParamTable.of(m))
    cal = load_calibration([torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in range(4)], m)
    ref = copy_eval = None
    import copy

    copy_eval = copy.deepcopy(m).eval()
    ref = input_statistics(copy_eval, layers, cal)
    got = input_statistics(m, layers, cal)
    assert [x.training for x in m.modules()] == modes
    assert all(np.array_equal(got.layers[k].gram, ref.layers[k].gram) for k in ref.layers)
    stats, spectra = tier1(m, layers, cal)
    assert [x.training for x in m.modules()] == modes
    assert all(np.array_equal(stats.layers[k].gram, ref.layers[k].gram) for k in ref.layers)
    f = factorize(m, {"0": 8}, cal)
    assert [x.training for x in m.modules()] == modes and f is not None
    bp = plan_for_budget(m, list(layers.values()), cal, curves_from_spectra(spectra, list(layers.values())),
                         budget=0.3, stats=stats)
    assert [x.training for x in m.modules()] == modes
    be = plan_for_budget(copy_eval, list(layers.values()), cal, curves_from_spectra(spectra, list(layers.values())),
                         budget=0.3, stats=stats)
    assert bp.plan == be.plan and bp.metric == be.metric


def test_a_metric_that_overflows_on_the_cut_model_is_not_refused(src):
    from auditor.calibration import Evaluator, Metric, load_calibration
    from auditor.sources import load_source

    m = load_source(f"{src}:model").model
    cal = load_calibration([torch.randn(8, 48, generator=torch.Generator().manual_seed(s)) for s in range(3)], m,
                           0.34)
    with torch.no_grad():
        dense = m(cal.holdout[0].args[0])

    def neg_perplexity(model, batches):
        err = float((model(batches[0]) - dense).pow(2).mean())
        return -float("inf") if err > 1e-3 else -1.0  # exp() of a large loss overflows

    Evaluator(m, cal, Metric(neg_perplexity, 0.01, "neg_perplexity"))
    assert not cal.warnings


def test_position_ids_and_labels_are_not_token_ids(src):
    from auditor.calibration.data.inputs import check_batches
    from auditor.sources import load_source

    m = load_source(f"{src}:ids").model
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (2, 8), generator=g),
                "position_ids": torch.arange(500, 508).expand(2, 8), "labels": torch.full((2, 8), -100)}
               for _ in range(2)]
    check_batches(_calibration_of(batches), m, probe=False)  # position 500 and label -100 are no vocabulary ids
    batches[1]["input_ids"][0, 0] = 500
    with pytest.raises(AuditError, match="input_ids in batch 1 from <batches> holds token id 500"):
        check_batches(_calibration_of(batches), m, probe=False)


def _calibration_of(batches):
    from auditor.calibration.data.inputs import Batch, Calibration

    return Calibration([Batch((), b) for b in batches], [])
