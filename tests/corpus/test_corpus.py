"""Run every case of tests/corpus/make_corpus.py through the command line: the expected exit code, no traceback, the
message fragment, one line on a refusal, and nothing written outside -o. Cases waiting for another helper's fix are
strict xfails naming the owner, so they turn into failures (XPASS) the moment that fix is merged."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_corpus import OUT, Case, LibCase, cases, lib_cases  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD_MEMORY = 8 * 2**30  # address space for a child case: a blow-up fails, it does not take the machine down


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=f"fixed by {case.owner}, merged later")] if case.owner else []
    return pytest.param(case, id=case.name, marks=marks)


def _snapshot(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def _limits(case: Case):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
        if case.fsize is not None:  # Python ignores SIGXFSZ: a write past it fails with EFBIG, as on a full disk
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))
    return limit


def _child(case: Case, d: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k, v in case.env.items():
        if v == "":
            env.pop(k, None)
        else:
            env[k] = str(d / "home") if v == "HOME" else v
    closed = case.stdout == "CLOSED"  # descriptor 1 closed before the interpreter starts, as `>&-` does
    stdout = None if closed else open(case.stdout, "w") if case.stdout not in (None, "EPIPE") else subprocess.PIPE
    if case.stdout == "EPIPE":  # a reader that stopped reading (`| head`): a pipe whose read end is closed
        read, write = os.pipe()
        os.close(read)
        stdout = os.fdopen(write, "w")
    try:
        return subprocess.run([sys.executable, "-m", "auditor", *argv], cwd=d, env=env, stdout=stdout,
                              stderr=subprocess.PIPE, text=True, timeout=case.timeout,
                              preexec_fn=(lambda: (_limits(case)(), os.close(1))) if closed else _limits(case))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case.name}: still running after {case.timeout} s (a hang)")
    finally:
        if case.stdout and not closed:
            stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("case", [_param(c) for c in cases()])
def test_case(case: Case, cli_inproc, tmp_path):
    d = tmp_path / case.name
    d.mkdir()
    argv = [a.replace(OUT, str(d / OUT)) if a.startswith(OUT) else a for a in case.make(d)]
    if case.prepare:
        case.prepare(d, cli_inproc)
    before = _snapshot(d)
    res = _child(case, d, argv) if case.child else cli_inproc(*argv, cwd=d)
    stdout = res.stdout or ""
    assert res.returncode in case.codes, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "Traceback" not in stdout, res.stderr[-2000:]
    if res.returncode == 2:
        lines = [l for l in res.stderr.splitlines() if l.strip() and not l.startswith("[transformers]")]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    if case.fragment:
        assert case.fragment in res.stderr + stdout, res.stderr[-2000:]
    for text in case.absent:
        assert text not in res.stderr + stdout, res.stderr[-2000:]
    new = _snapshot(d) - before
    allowed = (OUT, "cache", "home")
    assert all(p.split(os.sep)[0] in allowed for p in new), sorted(new)  # nothing written outside -o
    if res.returncode == 2:
        assert not (d / OUT).exists() or not any((d / OUT).iterdir())
    if case.check:
        case.check(d, res, cli_inproc)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in lib_cases()])
def test_api_case(case: LibCase, tmp_path):
    """The Python API on a hostile input: AuditError with one line naming the problem, never another exception."""
    from auditor.errors import AuditError

    d = tmp_path / case.name
    d.mkdir()
    call = case.make(d)
    with pytest.raises(AuditError) as info:
        call()
    line = str(info.value)
    assert "\n" not in line and case.fragment in line, line
    if case.check:
        case.check(d)
