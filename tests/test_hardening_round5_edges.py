"""Issue 41, hardening round 5 continued, the four edges beside the gradient fallback
(tests/test_hardening_round5_gradients.py): ``factorize`` on one or two held-out rows records the plan as unverified,
not as holding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FACTORY = '''
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


def cal():
    return [torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in range(8)]


def held(n):
    return [torch.randn(n, 48, generator=torch.Generator().manual_seed(99))]


def held1():
    return held(1)


def held2():
    return held(2)


def held64():
    return held(64)
'''


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("edges")
    (d / "m.py").write_text(FACTORY)
    (d / "plan.toml").write_text('[ranks]\n"0" = 8\n"2" = 8\n')
    return str(d / "m.py")


@pytest.mark.parametrize("held", ["held1", "held2"])
def test_factorize_on_one_or_two_held_out_rows_is_unverified(cli_inproc, src, tmp_path, held):
    plan = str(Path(src).parent / "plan.toml")
    res = cli_inproc("factorize", f"{src}:model", "--plan", plan, "--calibration", f"{src}:cal", "--holdout",
                     f"{src}:{held}", "--no-cache", "-o", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "out" / "plan.json").read_text())["measured"]
    assert m["holds"] is None and m["interval"] == [None, None] and m["rows"] == 1
    assert m["unverified"] == ("1 verification row gives no interval, too few to say whether the plan holds; about "
                               "8 verification rows (about 16 held out) would")
    line = next(x for x in res.stderr.splitlines() if x.startswith("relative output error on the held-out part"))
    assert ": UNVERIFIED, 1 verification row gives no interval" in line
    assert "within the tolerance" not in res.stderr and "holds the tolerance" not in res.stderr


def test_factorize_with_an_interval_still_holds(cli_inproc, src, tmp_path):
    plan = str(Path(src).parent / "plan.toml")
    res = cli_inproc("factorize", f"{src}:model", "--plan", plan, "--calibration", f"{src}:cal", "--holdout",
                     f"{src}:held64", "--no-cache", "-o", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "out" / "plan.json").read_text())["measured"]
    assert m["holds"] is True and "unverified" not in m and m["rows"] == 32 and None not in m["interval"]
    assert "within the tolerance 0.01" in res.stderr


# ---- the Action's output folder ---------------------------------------------------------------------------------
DIGITS = f"{Path(__file__).resolve().parents[1] / 'sample_models' / 'digits.py'}:mlp"


def _outside(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace and a folder outside it holding a report the planted link would let the action replace."""
    ws, elsewhere = tmp_path / "ws", tmp_path / "elsewhere"
    ws.mkdir()
    elsewhere.mkdir()
    (elsewhere / "lowrank-audit.json").write_text("precious\n")
    return ws, elsewhere


@pytest.mark.parametrize("plant", ["lowrank-audit", "reports/sub"])
def test_action_refuses_a_symlinked_output_folder(tmp_path, plant):
    from test_hardening_io import _action_step

    ws, elsewhere = _outside(tmp_path)
    link = ws / plant.split("/")[0]
    link.symlink_to(elsewhere, target_is_directory=True)
    inputs = {"model": DIGITS, "args": "--no-spectra"} | ({} if plant == "lowrank-audit" else {"output-dir": plant})
    r, lines, summary = _action_step(ws, **inputs)
    assert r.returncode == 0, r.stderr
    assert lines == ["exit-code=2"], (lines, r.stderr)
    said = f"error: the output-dir input {inputs.get('output-dir', 'lowrank-audit')} goes through the symbolic link "
    assert r.stderr.startswith(said) and len(r.stderr.splitlines()) == 1, r.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["lowrank-audit.json"]
    assert (elsewhere / "lowrank-audit.json").read_text() == "precious\n"
    assert "symbolic link" in summary


@pytest.mark.parametrize("out", ["../elsewhere", "ABS"])
def test_action_refuses_an_output_folder_outside_the_workspace(tmp_path, out, monkeypatch):
    from test_hardening_io import _action_step

    ws, elsewhere = _outside(tmp_path)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ws))
    out = str(elsewhere) if out == "ABS" else out
    r, lines, _ = _action_step(ws, model=DIGITS, args="--no-spectra", **{"output-dir": out})
    assert lines == ["exit-code=2"], (lines, r.stderr)
    assert r.stderr.startswith(f"error: the output-dir input {out} ") and len(r.stderr.splitlines()) == 1
    assert ("climbs out with .." if out.startswith("..") else f"is outside the workspace {ws}") in r.stderr
    assert (elsewhere / "lowrank-audit.json").read_text() == "precious\n"


def test_action_writes_inside_the_workspace(tmp_path, monkeypatch):
    from test_hardening_io import _action_step

    ws, _ = _outside(tmp_path)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ws))
    r, lines, _ = _action_step(ws, model=DIGITS, args="--no-spectra", **{"output-dir": f"{ws}/out/reports"})
    assert lines[-1] in ("exit-code=0", "exit-code=1"), (lines, r.stderr)
    assert (ws / "out" / "reports" / "lowrank-audit.json").is_file()


def test_cli_says_when_its_output_folder_is_a_link(cli_inproc, tmp_path):
    ws, elsewhere = _outside(tmp_path)
    (ws / "reports").symlink_to(elsewhere, target_is_directory=True)
    res = cli_inproc(DIGITS, "--no-spectra", "-q", "--format", "json", "-o", "reports", cwd=ws)
    assert res.returncode == 0, res.stderr
    assert f"note: -o reports is a symbolic link: the reports go to {elsewhere.resolve()}" in res.stderr


# ---- latency edges ------------------------------------------------------------------------------------------------
SPEED = '''
import os
import torch
from torch import nn


class Loud(nn.Module):
    """Writes to file descriptor 1 on every call, as C code or os.write does (print() is not enough to test it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        os.write(1, b'{"t": 0.0}\\n{not a reply\\n')
        return self.b(self.a(x))


def loud():
    torch.manual_seed(0)
    return Loud(), (torch.zeros(2, 64),)


def wide():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 256), nn.Linear(256, 8)), (torch.zeros(1, 4096),)
'''


@pytest.fixture(scope="module")
def speed_src(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("speed")
    (d / "s.py").write_text(SPEED)
    (d / "a.toml").write_text('[ranks]\n"a" = 8\n')
    (d / "0.toml").write_text('[ranks]\n"0" = 8\n')
    return str(d / "s.py")


def test_latency_shape_too_large_to_allocate_is_refused_before_allocating(cli_inproc, speed_src, tmp_path):
    plan = str(Path(speed_src).parent / "0.toml")
    res = cli_inproc(f"{speed_src}:wide", "--plan", plan, "--measure-speed", "--latency-shape", "200000000", "-q",
                     "--format", "json", "-o", str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: --latency-shape 200000000 needs about 3,433.2 GiB to time layer 0 (its "
                                 "input at that shape and its outputs), more than the ")
    assert res.stderr.rstrip().endswith("GiB available. Give a smaller --latency-shape.")
    assert len(res.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_latency_shape_that_fits_is_timed(cli_inproc, speed_src, tmp_path):
    import torch

    from auditor.results import Kind
    from auditor.speed.layer_timing import latency_bytes

    class L:  # a 4096 -> 256 linear layer
        kind, m, n = Kind.LINEAR, 256, 4096

    assert latency_bytes(torch.zeros(1, 4096), L, (64,)) == 64 * 4096 * 4 + 2 * 64 * 256 * 4
    plan = str(Path(speed_src).parent / "0.toml")
    want = [([1, 4096], "traced"), ([64, 4096], "latency-shape")]
    for attempt in range(3):  # a busy machine's repeats more than 25% apart are refused as not repeatable: again
        out = tmp_path / f"out{attempt}"
        res = cli_inproc(f"{speed_src}:wide", "--plan", plan, "--measure-speed", "--latency-shape", "64", "-q",
                         "--no-spectra", "--format", "json", "-o", str(out))
        assert res.returncode == 0, res.stderr
        report = json.loads((out / "lowrank-audit.json").read_text())["speed"]
        rows = [(r["input_shape"], r["at"]) for r in report["layers"]]
        if rows == want or "Not timed" not in json.dumps(report):  # refused on a busy machine: its note says so
            break
    assert rows == want


def test_a_forward_writing_to_descriptor_1_is_timed(cli_inproc, speed_src, tmp_path, one_thread):
    """The whole-model timing's worker answers on its own descriptor: what the forward writes to 1 is not a reply."""
    plan = str(Path(speed_src).parent / "a.toml")
    for attempt in range(3):  # a busy machine's repeats more than 25% apart are refused as not repeatable: again
        out = tmp_path / f"out{attempt}"
        res = cli_inproc(f"{speed_src}:loud", "--plan", plan, "--measure-speed", "-q", "--no-spectra", "--format",
                         "json", "-o", str(out))
        assert res.returncode == 0, res.stderr
        speed = json.loads((out / "lowrank-audit.json").read_text())["speed"]
        if not any("not repeatable" in n for n in speed["notes"]):
            break
    assert speed["model"] is not None and not any("not timed" in n for n in speed["notes"]), speed["notes"]
    m = speed["model"]
    assert m["where"] == "subprocess" and m["dense"]["median_s"] > 0 and m["factorized"]["median_s"] > 0
    assert m["dense"]["params"] == 4680 and m["factorized"]["params"] == 64 * 8 + 8 * 64 + 64 + 8 * 64 + 8
