"""Hardening round 5 (issue 39), the cases the first two hardening branches left: a plan whose perplexity overflows
to infinity misses the tolerance (exit 1, not an ``OverflowError``), a plan measured on nothing is called unmeasured
(LR015), a full disk or a file-size limit leaves no half-written output folder, a config asking for an enormous model
is refused before anything is allocated, and a cache folder that cannot be written is no internal error. Each case
failed on main at 225cdcf (25 of 27) unless its docstring says otherwise: the two that passed there are controls (a
--cache-dir that is a file, a config without weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# ---- 1. a plan whose perplexity is infinite ---------------------------------------------------------------------

BLOW = '''
import torch
from torch import nn

SCALE = 1e6


class Blow(nn.Module):
    """Logits that stay as the head makes them while ``blow``'s second output is near +-1, and jump by SCALE per unit
    once rank 1 drops that output: the held-out loss overflows exp (1e6 nats a token)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(32, 2)
        self.blow = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 32, bias=False)
        with torch.no_grad():
            s0 = torch.randint(0, 2, (32,), generator=g) * 2 - 1
            s1 = torch.randint(0, 2, (32,), generator=g) * 2 - 1
            self.emb.weight.copy_(torch.stack([4.0 * s0, 1.0 * s1], 1))
            self.blow.weight.copy_(torch.eye(2))
            self.head.weight.copy_(torch.randn(32, 2, generator=g))
        self.register_buffer("pattern", torch.randn(32, generator=g))

    def forward(self, input_ids):
        h = self.blow(self.emb(input_ids))
        return self.head(h) + torch.where(h[..., 1:].abs() < 0.5, SCALE * self.pattern, 0.0)


def model():
    return Blow(), (torch.zeros(1, 8, dtype=torch.long),)


def model_huge():
    global SCALE
    SCALE = 1e30
    return model()


def model_nan():
    global SCALE
    SCALE = float("inf")  # +inf and -inf logits on one row: the factorized loss is NaN, measured on nothing
    return model()


def cal():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 32, (4, 16), generator=g)} for _ in range(8)]
'''


@pytest.fixture(scope="module")
def blow(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("blow")
    (d / "blow.py").write_text(BLOW)
    (d / "plan.toml").write_text('[ranks]\n"blow" = 1\n')
    return d


def _blow_args(d: Path, fn: str = "model") -> list[str]:
    return [f"{d / 'blow.py'}:{fn}", "--calibration", f"{d / 'blow.py'}:cal", "--plan", str(d / "plan.toml"),
            "--no-cache"]


@pytest.mark.parametrize("fn", ["model", "model_huge"])
def test_an_infinite_perplexity_misses_the_tolerance_in_the_review(blow, cli_inproc, tmp_path, fn):
    """The verification's exp(loss difference) overflowed: ``OverflowError``, exit 3. Now: exit 1, the verdict and
    LR015 say the perplexity is infinite, LR016 (not a number) stays quiet, every format is written."""
    r = cli_inproc(*_blow_args(blow, fn), "-q", "--format", "text,json,md,sarif,html", "-o", tmp_path)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    verdict = r.stdout.splitlines()[0]
    assert verdict.startswith("FAIL:")
    assert "-> infinite (perplexity infinite, tolerance +1%)" in verdict and verdict.endswith("misses the tolerance")
    lr015 = [x for x in r.stdout.splitlines() if x.startswith("LR015 error")]
    assert len(lr015) == 1 and "measures perplexity increase infinite (perplexity infinite)" in lr015[0]
    assert "missing the tolerance 0.01" in lr015[0]
    assert not any(x.startswith("LR016") for x in r.stdout.splitlines())
    data = json.loads((tmp_path / "lowrank-audit.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert "LR015" in {f["code"] for f in data["findings"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lowrank-audit.html", "lowrank-audit.json", "lowrank-audit.md", "lowrank-audit.sarif", "lowrank-audit.txt"]


@pytest.mark.parametrize("recover", [[], ["--recover", "2"]])
def test_factorize_of_an_infinite_perplexity_misses_the_tolerance(blow, cli_inproc, tmp_path, recover):
    """``factorize`` and ``factorize --recover``: exit 1 with the miss in words, plan.json strict JSON."""
    out = tmp_path / "out"
    r = cli_inproc("factorize", *_blow_args(blow), "--allow-no-saving", "-o", out, *recover)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert "perplexity increase on the held-out part: measured infinite (on 4 verification rows, no interval): " \
           "misses the tolerance 0.01" in r.stderr
    assert "the factorized model misses the tolerance 0.01" in r.stderr
    plan = json.loads((out / "plan.json").read_text(), parse_constant=lambda c: pytest.fail(f"constant {c}"))
    assert plan["measured"]["value"] is None


# ---- 5. LR015 on a plan measured on nothing ---------------------------------------------------------------------

def test_lr015_calls_a_plan_measured_on_nothing_unmeasured(blow, cli_inproc):
    """The plan's measurement is NaN (nothing scored): LR015 said it "measures ... nan ..., missing the tolerance"."""
    r = cli_inproc(*_blow_args(blow, "model_nan"), "-q")
    assert r.returncode == 1, r.stderr
    lr015 = [x for x in r.stdout.splitlines() if x.startswith("LR015 error")]
    assert len(lr015) == 1
    assert "factorized all at once is unmeasured: its perplexity increase on the held-out rows is not a number, so " \
           "whether it holds the tolerance 0.01 is unknown" in lr015[0]
    assert "missing" not in lr015[0] and "nan" not in lr015[0]
    assert "not measured all at once" in r.stdout.splitlines()[0]


# ---- 4. a cache folder that cannot be used ----------------------------------------------------------------------

SMALL = '''
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 4)), (torch.zeros(1, 48),)


def cal():
    return [torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in range(8)]
'''

CACHE_WARNING = "cannot be used ({why}): running without a cache (give --cache-dir a folder you can write, or --no-cache)"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("small")
    (d / "m.py").write_text(SMALL)
    return d / "m.py"


def _deny_under(monkeypatch, prefix: Path) -> None:
    """What a user who is not root meets under a folder of mode 0555 or 0700 that is not theirs: every call on a
    path below ``prefix`` fails with EACCES (root passes such modes, so they are simulated)."""
    import errno
    import os

    def deny(fn):
        def wrapped(p, *a, **k):
            if isinstance(p, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(p)).startswith(str(prefix)):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(p))
            return fn(p, *a, **k)
        return wrapped

    for name in ("stat", "lstat", "open", "mkdir", "scandir", "listdir", "access", "replace", "unlink"):
        monkeypatch.setattr(os, name, deny(getattr(os, name)))


def _one_warning(err: str, why: str) -> None:
    lines = [x for x in err.splitlines() if "cache" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: the cache folder ") and \
        lines[0].endswith(CACHE_WARNING.format(why=why)), err
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("below", ["", "c", "c/d"])
@pytest.mark.parametrize("extra", [[], ["--calibration", "{m}:cal"]])
def test_a_cache_folder_that_cannot_be_searched_runs_uncached_with_one_warning(small, cli_inproc, tmp_path,
                                                                                monkeypatch, below, extra):
    """--cache-dir at or under a folder the user may not search: ``PermissionError`` from ``Path.exists``, exit 3."""
    denied = tmp_path / "denied"
    _deny_under(monkeypatch, denied)
    r = cli_inproc(f"{small}:model", "-q", "--cache-dir", denied / below if below else denied,
                   *[x.format(m=small) for x in extra])
    assert r.returncode == 0, r.stderr
    _one_warning(r.stderr, "Permission denied")


@pytest.mark.parametrize("extra", [[], ["--calibration", "{m}:cal"], ["--measure-speed"]])
def test_a_cache_folder_under_a_file_runs_uncached_with_one_warning(small, cli_inproc, tmp_path, extra):
    """The spectra, the calibration statistics and the speed cache each under a regular file. (Exit 0 on main at
    225cdcf, uncached in silence: it fails there only for the warning line, which is new.)"""
    (tmp_path / "file").write_text("x")
    r = cli_inproc(f"{small}:model", "-q", "--cache-dir", tmp_path / "file" / "cache",
                   *[x.format(m=small) for x in extra])
    assert r.returncode == 0, r.stderr
    _one_warning(r.stderr, "Not a directory")
    assert (tmp_path / "file").read_text() == "x"


def test_a_cache_dir_that_is_a_file_is_one_line_exit_2(small, cli_inproc, tmp_path):
    (tmp_path / "file").write_text("x")
    r = cli_inproc(f"{small}:model", "--cache-dir", tmp_path / "file")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --cache-dir {tmp_path / 'file'}: not a folder. Give a folder for the caches (made when missing)."]


def test_factorize_with_a_default_cache_it_cannot_search(small, cli_inproc, tmp_path, monkeypatch):
    """factorize has no --cache-dir: $LOWRANK_AUDITOR_CACHE under a folder it may not search."""
    denied = tmp_path / "denied"
    monkeypatch.setenv("LOWRANK_AUDITOR_CACHE", str(denied / "c"))
    (tmp_path / "plan.toml").write_text('[ranks]\n"0" = 8\n')
    _deny_under(monkeypatch, denied)
    r = cli_inproc("factorize", f"{small}:model", "--plan", tmp_path / "plan.toml", "--calibration", f"{small}:cal",
                   "-o", tmp_path / "out")
    assert r.returncode in (0, 1), r.stderr
    _one_warning(r.stderr, "Permission denied")
    assert (tmp_path / "out" / "plan.json").is_file()


@pytest.fixture
def read_only_fs(tmp_path):
    """A read-only tmpfs (root only): what root meets where mode bits do not stop it."""
    import os
    import subprocess

    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("below", ["", "c"])
def test_a_cache_on_a_read_only_filesystem_runs_uncached_with_one_warning(small, cli_inproc, read_only_fs, below):
    """(Exit 0 on main at 225cdcf, every write failing in silence: it fails there only for the new warning line.)"""
    r = cli_inproc(f"{small}:model", "-q", "--calibration", f"{small}:cal", "--cache-dir",
                   read_only_fs / below if below else read_only_fs)
    assert r.returncode == 0, r.stderr
    _one_warning(r.stderr, "Read-only file system" if below else "not writable")


def test_a_user_who_is_not_root_with_a_0555_cache_folder(small, tmp_path):
    """The real thing where the interpreter can be run as ``nobody`` (``setpriv``); skipped elsewhere."""
    import os
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if os.geteuid() != 0 or shutil.which("setpriv") is None or subprocess.run(
            [*drop, sys.executable, "-c", "import auditor"], capture_output=True,
            env={**os.environ, "PYTHONPATH": str(root)}).returncode != 0:
        pytest.skip("cannot run this interpreter as nobody")
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="edges2-", dir="/tmp"))  # pytest's own folder is 0700: nobody can't enter
    home.chmod(0o755)
    shutil.copy(small, home / "m.py")
    (home / "m.py").chmod(0o644)
    small = home / "m.py"
    ro = home / "ro"
    ro.mkdir(mode=0o555)
    ro.chmod(0o555)
    env = {**os.environ, "PYTHONPATH": str(root), "HOME": str(home), "OMP_NUM_THREADS": "1"}
    for cache in (ro, ro / "c"):
        r = subprocess.run([*drop, sys.executable, "-m", "auditor", f"{small}:model", "-q", "--cache-dir", str(cache)],
                           capture_output=True, text=True, env=env, cwd=home)
        assert r.returncode == 0, r.stderr
        _one_warning(r.stderr, "Permission denied" if cache != ro else "not writable")
    ro.chmod(0o755)
    shutil.rmtree(home)


# ---- 3. a config bomb -------------------------------------------------------------------------------------------

LIMITED = """
import resource, runpy, sys
lim = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
sys.argv = ["lowrank-audit", *sys.argv[2:]]
runpy.run_module("auditor", run_name="__main__")
"""


@pytest.mark.parametrize("weights", [True, False])
def test_a_config_bomb_is_refused_before_anything_is_allocated_under_a_memory_limit(tmp_path, weights):
    """A config asking for 2.6 billion parameters (10.1 GiB) beside the sample Llama's weights (or without them,
    with --calibration), audited under RLIMIT_AS 5000 MiB (well below the machine's memory, so the estimate against
    MemAvailable let it through): the build began and failed on an allocation. Now one line, exit 2."""
    import os
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    src = root / "sample_models" / "llama"
    d = tmp_path / "bomb"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "calib.txt", *(["model.safetensors"] if weights else [])):
        shutil.copy(src / f, d / f)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=12, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128)
    (d / "config.json").write_text(json.dumps(config))
    (tmp_path / "limited.py").write_text(LIMITED)
    r = subprocess.run([sys.executable, str(tmp_path / "limited.py"), "5000", str(d), "-q", "--no-cache",
                        "--calibration", str(d / "calib.txt")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    if weights:
        assert lines[0].startswith("error: building LlamaForCausalLM from ") and \
            "needs about 10.1 GiB of memory (2,634,125,312 parameters as float32), but only " in lines[0]
    else:  # never built: the structure is read on the meta device, and calibration needs real weights
        assert lines[0].startswith("error: calibration needs real weights")


# ---- 2. a full disk and a file-size limit -----------------------------------------------------------------------

FSIZE = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit get EFBIG instead of a killing signal
n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
sys.argv = ["lowrank-audit", *sys.argv[2:]]
runpy.run_module("auditor", run_name="__main__")
"""


WIDER = '''
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4)), \\
        (torch.zeros(1, 48),)
'''


@pytest.fixture(scope="module")
def wider(tmp_path_factory) -> Path:
    """Factorized with both exports about 96 KiB: model.pt2 35 KB, model.onnx 25 KB, model.safetensors 18 KB."""
    d = tmp_path_factory.mktemp("wider")
    (d / "m.py").write_text(WIDER)
    return d / "m.py"


def _run(tmp_path: Path, *args: str, fsize: int | None = None):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "fsize.py").write_text(FSIZE)
    head = [sys.executable, str(tmp_path / "fsize.py"), str(fsize)] if fsize else [sys.executable, "-m", "auditor"]
    return subprocess.run([*head, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})


@pytest.fixture
def small_fs(tmp_path):
    """A 200 KiB tmpfs (root only), unmounted after."""
    import os
    import subprocess

    d = tmp_path / "fs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def _only_error(err: str, start: str) -> None:
    lines = [x for x in err.splitlines() if not x.startswith("model.pt2: the batch")]  # the export's own note
    assert len(lines) == 1 and lines[0].startswith(start), err


@pytest.mark.parametrize("free_kib", [30, 60, 90])
def test_factorize_export_onto_a_nearly_full_disk_is_one_line_and_leaves_nothing(wider, small_fs, tmp_path, free_kib):
    """The model needs about 96 KiB with both exports: torch's zip writer threw a C++ error on ENOSPC, the message
    blamed the exporter ("not the disk") and its destructor aborted the process at exit (134, 16 lines)."""
    (small_fs / "filler").write_bytes(bytes((200 - free_kib) << 10))
    (tmp_path / "plan.toml").write_text('[ranks]\n"0" = 8\n')
    r = _run(tmp_path, "factorize", f"{wider}:model", "--plan", str(tmp_path / "plan.toml"), "--export", "pt2,onnx",
             "-o", str(small_fs / "out"))
    assert r.returncode == 2, r.stderr
    _only_error(r.stderr, f"error: cannot write {small_fs / 'out'}: No space left on device; nothing was written.")
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_factorize_export_under_a_file_size_limit_is_one_line_and_leaves_nothing(wider, tmp_path):
    (tmp_path / "plan.toml").write_text('[ranks]\n"0" = 8\n')
    r = _run(tmp_path, "factorize", f"{wider}:model", "--plan", str(tmp_path / "plan.toml"), "--export", "pt2,onnx",
             "-o", str(tmp_path / "out"), fsize=20000)
    assert r.returncode == 2, r.stderr
    _only_error(r.stderr, f"error: cannot write {tmp_path / 'out'}: File too large; nothing was written.")
    assert not (tmp_path / "out").exists()


def test_reports_under_a_file_size_limit_say_one_line(wider, tmp_path):
    """Two lines on main at 225cdcf: matplotlib's "Could not save font_manager cache" before the error."""
    r = _run(tmp_path, f"{wider}:model", "--no-cache", "--format", "json,md,html,text", "-o", str(tmp_path / "rep"),
             fsize=20000)
    assert r.returncode == 2, r.stderr
    _only_error(r.stderr, "error: cannot write ")
    assert "File too large" in r.stderr and not (tmp_path / "rep").exists()


def test_a_simulated_enospc_from_the_program_writer_is_one_line(wider, cli_inproc, tmp_path, monkeypatch):
    """Without root: the program's bytes meet ENOSPC as they are written. (At 225cdcf there was no such writer to
    patch: torch wrote the file itself; the tmpfs cases above are the ones that failed there.)"""
    import errno

    import auditor.artifacts.export as export

    real = export._save_program

    def full(prog, path):
        real(prog, path)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(export, "_save_program", full)
    (tmp_path / "plan.toml").write_text('[ranks]\n"0" = 8\n')
    r = cli_inproc("factorize", f"{wider}:model", "--plan", tmp_path / "plan.toml", "--export", "pt2",
                   "-o", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    _only_error(r.stderr, f"error: cannot write {tmp_path / 'out'}: No space left on device; nothing was written.")
    assert not (tmp_path / "out").exists()
