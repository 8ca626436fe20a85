"""The ready integrations: the pre-commit hook's command run on sample plans (exit codes 0, 1, 2) and the GitHub
Action's audit step run as the runner would (bash, its environment, $GITHUB_OUTPUT and $GITHUB_STEP_SUMMARY)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
HOOKS = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))
ACTION = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _shim(folder: Path) -> Path:
    """A ``lowrank-audit`` on PATH that runs this checkout (the console script of an installed copy may be another
    version)."""
    folder.mkdir(exist_ok=True)
    exe = folder / "lowrank-audit"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m auditor "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def _hook() -> dict:
    (hook,) = HOOKS
    return hook


def run_hook(files: list[Path], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    hook = _hook()
    argv = shlex.split(hook["entry"]) + [*hook.get("args", []), *args] + [str(f) for f in files]
    assert argv[0] == "lowrank-audit"
    return subprocess.run([sys.executable, "-m", "auditor", *argv[1:]], capture_output=True, text=True, cwd=cwd,
                          env=_env(), timeout=600)


def test_hook_declaration():
    hook = _hook()
    assert hook["id"] == "lowrank-plan" and hook["language"] == "python" and hook["pass_filenames"] is True
    files, exclude = re.compile(hook["files"]), re.compile(hook["exclude"])
    picked = [p for p in ["compression/plan.toml", "plan.json", "ci/llama-plan-v2.toml", "pyproject.toml",
                          "src/planner.py", "package.json", "docs/plan.md"]
              if files.search(p) and not exclude.search(p)]
    assert picked == ["compression/plan.toml", "plan.json", "ci/llama-plan-v2.toml"]


def test_hook_command_on_sample_plans(tmp_path):
    ok = tmp_path / "plan.toml"
    ok.write_text('finetune = "1 epoch, lr 1e-4"\n[ranks]\n"fc2" = 16\n"fc3" = 24\n', encoding="utf-8")
    broken = tmp_path / "broken-plan.toml"
    broken.write_text('finetune = "x"\n[ranks]\n"fc2" = "sixteen"\n', encoding="utf-8")
    over = tmp_path / "over-plan.toml"
    over.write_text('finetune = "x"\n\n[ranks]\n"fc2" = 300\n', encoding="utf-8")

    r = run_hook([ok], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == r.stderr == ""
    r = run_hook([ok, broken], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: plan {broken}, layer fc2: cannot read rank 'sixteen'")

    model = f"{ROOT / 'sample_models' / 'digits.py'}:mlp"
    r = run_hook([ok], "--model", model, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(" info " in line for line in r.stdout.splitlines())  # only notes; nothing to block a commit
    r = run_hook([ok, over], "--model", model, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"{over}:4: error LR001 rank 300 for fc2 (512x512) is at or above the break-even rank 256.0" in r.stdout
    assert r.stdout.count(" error ") == 1


def test_action_declaration():
    assert ACTION["runs"]["using"] == "composite"
    steps = ACTION["runs"]["steps"]
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("github/codeql-action/upload-sarif@"))
    assert upload["with"]["sarif_file"] == "${{ steps.audit.outputs.sarif }}"
    audit = next(s for s in steps if s.get("id") == "audit")
    assert "GITHUB_STEP_SUMMARY" in audit["run"] and "--format md,json,sarif" in audit["run"]
    assert ACTION["inputs"]["model"]["required"] is True
    for s in steps:  # inputs reach a script only through env: nothing typed into a PR can become shell code
        assert "${{" not in s.get("run", ""), s.get("name")


def _audit_step(tmp_path: Path, **inputs: str) -> tuple[subprocess.CompletedProcess, dict[str, str], str]:
    step = next(s for s in ACTION["runs"]["steps"] if s.get("id") == "audit")
    defaults = {k: str(v.get("default", "")) for k, v in ACTION["inputs"].items()}
    values = {**defaults, **inputs}
    env = _env()
    for name, expr in step["env"].items():
        key = re.fullmatch(r"\$\{\{ inputs\.([\w-]+) \}\}", expr).group(1)
        env[name] = values[key]
    env["PATH"] = f"{_shim(tmp_path / 'bin')}{os.pathsep}{env['PATH']}"
    env["GITHUB_OUTPUT"] = str(tmp_path / "github_output")
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "summary.md")
    env["COLUMNS"] = "100"
    r = subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    outputs = dict(line.split("=", 1) for line in (tmp_path / "github_output").read_text().splitlines())
    return r, outputs, (tmp_path / "summary.md").read_text(encoding="utf-8")


def test_action_audit_step_runs(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text('finetune = "x"\n[ranks]\n"fc2" = 300\n', encoding="utf-8")
    r, outputs, summary = _audit_step(tmp_path, model=f"{ROOT / 'sample_models' / 'digits.py'}:mlp",
                                      plan="plan.toml", args="--no-cache --energy 0.9,0.95")
    assert r.returncode == 0, r.stderr  # the step itself passes; the last step fails the job on exit-code
    assert outputs == {"exit-code": "1", "sarif": "lowrank-audit/lowrank-audit.sarif"}
    assert summary.startswith("## Low-rank audit: DigitsMLP")
    sarif = json.loads((tmp_path / "lowrank-audit" / "lowrank-audit.sarif").read_text(encoding="utf-8"))
    lr001 = next(x for x in sarif["runs"][0]["results"] if x["ruleId"] == "LR001")
    assert lr001["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "plan.toml", "uriBaseId": "%SRCROOT%"}, "region": {"startLine": 3}}
    assert "::error file=plan.toml,line=3,title=LR001 rank-at-or-above-break-even::" in r.stdout
    table = (tmp_path / "lowrank-audit" / "lowrank-audit.txt").read_text(encoding="utf-8")
    assert "r95" in table and "r99" not in table  # the --energy flag from args reached the audit
    assert "left out to fit" not in table and "…" not in table  # the .txt report keeps every column (any $COLUMNS)
    assert table.splitlines()[-1].startswith("FAIL: 1 error(s)")


def test_action_audit_step_with_bad_input(tmp_path):
    r, outputs, summary = _audit_step(tmp_path, model=str(tmp_path / "missing.py") + ":model")
    assert r.returncode == 0 and outputs["exit-code"] == "2"
    assert summary.startswith("lowrank-audit wrote no report (exit 2)")
    assert r.stderr.count("error: ") == 1
