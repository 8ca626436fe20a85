"""Issue 13, the command line's part: all-or-nothing output, destinations that are never replaced, and one clear
line (exit 2) for every malformed plan, setting and baseline."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.artifacts import outputs
from auditor.errors import AuditError
from _factories import write_low_rank_mlp



@pytest.fixture
def src(tmp_path: Path) -> str:
    return write_low_rank_mlp(tmp_path, widths=(64, 128, 64, 10), rank=4, batch=2)


def one_line(res, code: int = 2, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# -- destinations --------------------------------------------------------------------------------------------------

def test_output_dir_that_is_a_file(cli_inproc, src, tmp_path):
    f = tmp_path / "report"
    f.write_text("keep")
    one_line(cli_inproc(src, "-q", "--format", "json", "-o", f), 2, "-o", "is a file, not a folder")
    assert f.read_text() == "keep"


def test_output_dir_under_proc(cli_inproc, src):
    one_line(cli_inproc(src, "-q", "--format", "json", "-o", "/proc/lowrank-audit-x"), 2, "cannot write in /proc")


def test_emit_plan_at_a_folder(cli_inproc, src, tmp_path):
    one_line(cli_inproc(src, "-q", "--emit-plan", tmp_path), 2, "is a folder", "plan.toml")


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_emit_plan_never_replaces_a_non_regular_file(cli_inproc, src, tmp_path, kind):
    target = tmp_path / "t"
    real = tmp_path / "real.toml"
    real.write_text("# mine\n")
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(real)
    one_line(cli_inproc(src, "-q", "--emit-plan", target), 2, "refusing to replace it")
    assert (target.is_fifo() if kind == "fifo" else target.is_symlink()) and real.read_text() == "# mine\n"


def test_dev_null_is_refused_before_anything_runs():
    # checked without running the CLI: a regression here would turn /dev/null into a regular file (as root)
    with pytest.raises(AuditError, match="is a device; refusing to replace it"):
        outputs.check_destination("/dev/null", "--emit-plan")


def test_emit_plan_over_the_plan_under_review(cli_inproc, src, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text('finetune = "1 epoch"\n[ranks]\n"0" = 8\n')
    one_line(cli_inproc(src, "-q", "--plan", plan, "--emit-plan", plan), 2, "is the plan under review")
    assert plan.read_text() == 'finetune = "1 epoch"\n[ranks]\n"0" = 8\n'


def test_emit_plan_replaces_a_regular_file_by_rename(cli_inproc, src, tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text("old")
    inode = plan.stat().st_ino
    res = cli_inproc(src, "-q", "--emit-plan", plan)
    assert res.returncode == 0, res.stderr
    assert plan.read_text().startswith("# Compression plan") and plan.stat().st_ino != inode  # a new file renamed in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py", "plan.toml"]  # no staging folder left


# -- all or nothing -----------------------------------------------------------------------------------------------

def _full_disk_on(n: int, monkeypatch):
    calls = []
    real = outputs._open_new

    def opener(path):
        calls.append(path)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path)

    monkeypatch.setattr(outputs, "_open_new", opener)


def test_full_disk_writes_nothing_and_keeps_old_reports(cli_inproc, src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "lowrank-audit.json").write_text("old report")
    before = tree(tmp_path)
    _full_disk_on(3, monkeypatch)  # json and md staged, html fails
    res = cli_inproc(src, "-q", "--format", "json,md,html", "-o", out, "--emit-plan", out / "plan.toml")
    line = one_line(res, 2, "cannot write", "lowrank-audit.html", "No space left on device",
                    "no file was written and existing files were left as they were")
    assert ".lowrank-audit-" not in line  # names the destination, not the staging file
    assert tree(tmp_path) == before


def test_full_disk_in_a_new_folder_removes_the_folder(cli_inproc, src, tmp_path, monkeypatch):
    _full_disk_on(2, monkeypatch)
    res = cli_inproc(src, "-q", "--format", "json,md", "-o", tmp_path / "a" / "b")
    one_line(res, 2, "No space left on device")
    assert not (tmp_path / "a").exists()


def test_failure_while_moving_restores_what_was_replaced(cli_inproc, src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "lowrank-audit.json").write_text("old json")
    real = os.replace
    calls = []

    def replace(a, b):  # os.replace itself is patched: count only the reports' renames (not the cache's)
        calls.extend([b] if Path(b).parent == out else [])
        if len(calls) == 2 and Path(b).parent == out:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(a, b)

    monkeypatch.setattr(outputs.os, "replace", replace)
    res = cli_inproc(src, "-q", "--format", "json,md", "-o", out)
    one_line(res, 2, "cannot move", "lowrank-audit.md", "no file was written")
    assert sorted(p.name for p in out.iterdir()) == ["lowrank-audit.json"]
    assert (out / "lowrank-audit.json").read_text() == "old json"


def test_ctrl_c_while_moving_is_held_then_rolled_back(cli_inproc, src, tmp_path, monkeypatch):
    real = outputs.OutputSet._move

    def move(self, e):
        real(self, e)
        if e is self.entries[0]:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C between two renames

    monkeypatch.setattr(outputs.OutputSet, "_move", move)
    res = cli_inproc(src, "-q", "--format", "json,md", "-o", tmp_path / "out")
    assert res.returncode == 130 and res.stderr.strip().splitlines()[-1] == "interrupted: no report written"
    assert not (tmp_path / "out").exists()


def test_ctrl_c_after_the_files_are_in_place_says_which_exist(cli_inproc, src, tmp_path, monkeypatch):
    real = outputs.shutil.rmtree

    def rmtree(path, ignore_errors=False):
        real(path, ignore_errors=ignore_errors)
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.shutil, "rmtree", rmtree)
    out = tmp_path / "out"
    res = cli_inproc(src, "-q", "--format", "json,md", "-o", out)
    assert res.returncode == 130
    assert res.stderr.strip().splitlines()[-1] == \
        f"interrupted: wrote {out / 'lowrank-audit.json'}, {out / 'lowrank-audit.md'}"
    assert json.loads((out / "lowrank-audit.json").read_text())["format_version"] == 1


def test_stdout_to_dev_full(src, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "auditor", src, "--format", "json", "--emit-plan",
                              out / "plan.toml"], stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                             timeout=300)
    line = one_line(res, 2, "cannot write to standard output", "No space left on device")
    assert "no file was written" in line and not out.exists()  # the plan was rolled back with it


# -- plans --------------------------------------------------------------------------------------------------------

BAD_PLANS = {
    "zero-be": ('[ranks]\n"0" = "0be"\n', "must be a fraction above 0"),
    "tiny-be": ('[ranks]\n"0" = "0.001be"\n', "of break-even 42.7 is rank 0"),
    "negative": ('[ranks]\n"0" = -3\n', "layer 0: rank -3 must be positive"),
    "zero": ('[ranks]\n"0" = 0\n', "rank 0 must be positive"),
    "nan": ('[ranks]\n"0" = nan\n', "rank nan is not an integer"),
    "inf": ('[ranks]\n"0" = inf\n', "rank inf is not an integer"),
    "float": ('[ranks]\n"0" = 64.0\n', "rank 64.0 is not an integer"),
    "float-absurd": ('[ranks]\n"0" = 1e30\n', "rank 1e+30 is not an integer"),
    "int-absurd": ('[ranks]\n"0" = 1000000000000000000000000000000\n', "is larger than any matrix"),
    "text-absurd": ('[ranks]\n"0" = "99999999999999999999999"\n', "is larger than any matrix"),
    "bool": ('[ranks]\n"0" = true\n', "rank true is not an integer"),
    "word": ('[ranks]\n"0" = "half"\n', "cannot read rank 'half'"),
    "energy-out": ('[ranks]\n"0" = "energy:1.5"\n', "is out of (0, 1]"),
    "dotted": ('[ranks]\nfc1.weight = 8\n', "is a table, not a rank", 'Quote the pattern'),
    "unknown-layer": ('finetune = "x"\n[ranks]\n"fc9" = 8\n', "matches no factorizable layer"),
    "nan-threshold": ('[ranks]\n"0" = 8\n[thresholds]\nenergy_floor = nan\n', "energy_floor", "bad value nan"),
    "negative-threshold": ('[ranks]\n"0" = 8\n[thresholds]\nmin_share = -0.1\n', "min_share = -0.1", "out of range"),
    "inf-threshold": ('[ranks]\n"0" = 8\n[thresholds]\nwider_factor = inf\n', "wider_factor", "bad value inf"),
    "bool-threshold": ('[ranks]\n"0" = 8\n[thresholds]\nalign = true\n', "'align'", "bad value True"),
    "fail-on-typo": ('[ranks]\n"0" = 8\n[thresholds]\nfail_on = "nevr"\n', "bad value 'nevr'", "Did you mean never"),
    "empty-targets": ('[ranks]\n"0" = 8\n[thresholds]\nenergy_targets = []\n', "energy_targets in",
                      "plan.toml is empty"),
    "finetune-list": ('finetune = ["a"]\n[ranks]\n"0" = 8\n', "'finetune' is a list, not text"),
    "ranks-list": ('ranks = [1, 2]\n', "'ranks' is a list, not a table"),
    "toml-syntax": ('[ranks\n', "is not valid TOML"),
    "json-bare-string": ('"ranks"', "is text ('ranks'), not a table of ranks"),
    "json-list": ('[{"ranks": {"0": 8}}]', "is a list, not a table of ranks"),
    "json-null": ("null", "is null, not a table of ranks"),
    "json-nested": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "json-duplicate": ('{"ranks": {"0": 8, "0": 16}}', "duplicate key '0'"),
    "json-nan": ('{"ranks": {"0": NaN}}', "NaN is not a number JSON allows"),
    "json-huge-float": ('{"ranks": {"0": 8}, "thresholds": {"energy_floor": 1e999}}', "number 1e999 is too large"),
    "json-huge-int": ('{"ranks": {"0": 1' + "0" * 5000 + "}}", "is not valid JSON"),
    "json-int-absurd": ('{"ranks": {"0": 1000000000000000000000000000000}}', "is larger than any matrix"),
    "non-utf8": (b'[ranks]\n"\xff" = 8\n', "is not UTF-8 text (byte 0xff at offset 9)"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_is_one_line(cli_inproc, src, tmp_path, case):
    content, *needles = BAD_PLANS[case]
    path = tmp_path / ("plan.json" if case.startswith("json") else "plan.toml")
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = one_line(cli_inproc(src, "-q", "--plan", path, "--format", "json", "-o", tmp_path / "out"), 2, *needles)
    assert "unknown key" not in line
    assert not (tmp_path / "out").exists()


def test_unknown_layer_names_the_closest(cli_inproc, src, tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('finetune = "x"\n[ranks]\n"2.weigth" = 8\n')
    one_line(cli_inproc(src, "-q", "--plan", path), 2, "pattern '2.weigth' matches no factorizable layer",
             "Closest layer names: 2.weight")


def test_plan_is_a_folder(cli_inproc, src, tmp_path):
    one_line(cli_inproc(src, "-q", "--plan", tmp_path), 2, "is not a regular file")


@pytest.mark.parametrize("flags, needles", [
    (["--target-energy", "nan"], ["target_energy", "bad value nan"]),
    (["--energy-floor", "-0.5"], ["energy_floor = -0.5 in the command line", "out of range (0, 1]"]),
    (["--min-share", "inf"], ["min_share", "bad value inf"]),
    (["--energy", "0.9,nan"], ["energy_targets", "bad value 'nan'"]),
    (["--align", "0"], ["align = 0", "at least 1"]),
    (["--select", "LR0O4"], ["rule select 'LR0O4' matches no rule"]),
])
def test_bad_threshold_flags(cli_inproc, src, flags, needles):
    one_line(cli_inproc(src, "-q", *flags), 2, *needles)


def test_pyproject_table_not_a_table(cli_inproc, src, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool]\nlowrank-auditor = "fast"\n')
    one_line(cli_inproc(src, "-q", cwd=tmp_path), 2, "[tool.lowrank-auditor] is not a table")


# -- baselines ----------------------------------------------------------------------------------------------------

BAD_BASELINES = {
    "not-json": ("{", "is not readable JSON"),
    "non-utf8": (b'{"a": "\xff"}', "is not readable JSON"),
    "list": ("[]", "the top level is not an object"),
    "missing-findings": ('{"format_version": 1}', "'findings' is missing"),
    "findings-not-list": ('{"format_version": 1, "findings": {}}', "'findings' is not a list"),
    "finding-no-code": ('{"format_version": 1, "findings": [{"message": "x"}]}', "finding 0 has no text 'code'"),
    "finding-layers": ('{"format_version": 1, "findings": [{"code": "LR001", "message": "x", "layers": "fc1"}]}',
                       "'layers' is not a list of names"),
    "layers-no-name": ('{"format_version": 1, "findings": [], "layers": [{"m": 3}]}', "'layers' is not a list"),
    "saved-text": ('{"format_version": 1, "findings": [], "plan_review": {"params_saved": "many"}}',
                   "no whole 'params_saved'"),
    "duplicate": ('{"format_version": 1, "findings": [], "findings": []}', "duplicate key 'findings'"),
    "nan": ('{"format_version": NaN, "findings": []}', "NaN is not a number JSON allows"),
}


@pytest.mark.parametrize("case", sorted(BAD_BASELINES))
def test_bad_baseline_is_one_line(cli_inproc, src, tmp_path, case):
    content, needle = BAD_BASELINES[case]
    path = tmp_path / "old.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line(cli_inproc(src, "-q", "--baseline", path, "--format", "md", "-o", tmp_path / "out"), 2, needle)
    assert not (tmp_path / "out").exists()


def test_good_baseline_still_compares(cli_inproc, src, tmp_path):
    out = tmp_path / "out"
    assert cli_inproc(src, "-q", "--format", "json", "-o", out).returncode == 0
    res = cli_inproc(src, "-q", "--format", "json", "-o", out, "--baseline", out / "lowrank-audit.json")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "lowrank-audit.json").read_text())["baseline"]["new_findings"] == []


def test_report_over_the_plan_under_review(cli_inproc, src, tmp_path):
    plan = tmp_path / "lowrank-audit.json"
    plan.write_text('{"finetune": "x", "ranks": {"0": 8}}')
    one_line(cli_inproc(src, "-q", "--plan", plan, "--format", "json", "-o", tmp_path), 2,
             "would replace the plan under review")
    assert plan.read_text() == '{"finetune": "x", "ranks": {"0": 8}}'


def test_api_plan_with_a_non_text_pattern():
    from auditor.planning.plan import Plan

    with pytest.raises(AuditError, match="pattern 1 is not a layer name or glob"):
        Plan.from_dict({"ranks": {1: 8}}, "api")
