"""The hostile and broken inputs of issue 13, generated (no committed binaries): one case per kind, each with the
exit code and the message fragment the command line must give.

    python tests/corpus/make_corpus.py DIR        # write every case into DIR/<case>/ with its case.json

``tests/corpus/test_corpus.py`` generates each case into a temporary folder and runs it. A case's ``argv`` is relative
to its folder (``OUT`` stands for the -o folder); ``owner`` names the helper whose fix the case waits for (its test
is a strict xfail until that fix is merged); ``child`` cases run in a separate interpreter with a memory limit and a
timeout, because the failure they guard against is a crash, an OOM kill or a hang.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/, for the shared factories (also as a script)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _factories import low_rank_mlp  # noqa: E402

OUT = "OUT"


@dataclass
class Case:
    name: str
    kind: str  # the heading
    make: Callable[[Path], list[str]]  # writes the inputs into the folder, returns argv
    code: int | tuple[int, ...]  # the exit code (or the codes the issue leaves open)
    fragment: str | None = None  # must appear in stderr (exit 2) or in stdout + stderr
    absent: tuple[str, ...] = ()  # must appear in neither
    check: Callable[[Path, Any, Callable], None] | None = None  # (folder, result, run) -> asserts more
    prepare: Callable[[Path, Callable], None] | None = None  # (folder, run): a first run, before the case's own
    owner: str | None = None  # helper whose fix is not in main yet: "load", "spectra", "wire"
    child: bool = False  # run in a child interpreter (memory limit, timeout, real stdout)
    stdout: str | None = None  # child only: a path for stdout ("/dev/full"), "CLOSED" (started with >&-) or "EPIPE"
    env: dict[str, str] = field(default_factory=dict)  # child only
    timeout: int = 180  # child only: seconds before the run counts as a hang
    fsize: int | None = None  # child only: RLIMIT_FSIZE in bytes (a write past it fails as on a full disk)

    @property
    def codes(self) -> tuple[int, ...]:
        return self.code if isinstance(self.code, tuple) else (self.code,)


# -- small writers ---------------------------------------------------------------------------------------------------

LOW_RANK = low_rank_mlp()  # the model most cases audit: two rank-3 layers, every weight seeded


def _py(d: Path, body: str, fn: str = "model") -> str:
    """A factory file named after its folder (module names never collide between cases)."""
    p = d / f"{d.name.replace('-', '_')}.py"
    p.write_text("import torch\nfrom torch import nn\n" + body)
    return f"{p}:{fn}"


def _mlp(d: Path) -> str:
    return _py(d, LOW_RANK)


def _text(d: Path, name: str, content: str | bytes) -> Path:
    p = d / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _safetensors(path: Path, tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def _low_rank(m: int = 64, n: int = 48, r: int = 3, seed: int = 0, dtype: Any = None) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, r, generator=g, dtype=torch.float64) @ torch.randn(r, n, generator=g, dtype=torch.float64)
    return w.to(dtype or torch.float32).contiguous()


GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 128, "n_positions": 16,
               "n_embd": 32, "n_layer": 2, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}


def _hf_dir(d: Path, config: dict | None = None) -> Path:
    ck = d / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(config or GPT2_CONFIG))
    return ck


def _plan(d: Path, content: str | bytes, suffix: str = ".toml") -> list[str]:
    return [_mlp(d), "-q", "--plan", str(_text(d, "plan" + suffix, content)), "--format", "json", "-o", OUT]


def _json_report(out: Path) -> dict:
    def bare(c: str) -> Any:
        raise AssertionError(f"bare {c} in the JSON report")

    return json.loads((out / "lowrank-audit.json").read_text(), parse_constant=bare)


# -- checks ----------------------------------------------------------------------------------------------------------

def _emitted_plan_is_data_only(d: Path, res: Any, run: Callable) -> None:
    from auditor.config import tomllib

    data = tomllib.loads((d / OUT / "plan.toml").read_text(encoding="utf-8"))
    assert set(data) == {"finetune", "ranks"}, data
    again = run(str(d / "w.safetensors"), "-q", "--plan", str(d / OUT / "plan.toml"), "--format", "json")
    assert again.returncode == 0, again.stderr  # reviewed: nothing but LR005 (a warning), no injected settings


def _tied_not_targeted(d: Path, res: Any, run: Callable) -> None:
    from auditor.config import tomllib

    plan = d / OUT / "plan.toml"
    assert "emb" not in tomllib.loads(plan.read_text())["ranks"]
    plan.write_text(plan.read_text().replace('finetune = ""', 'finetune = "1 epoch"'))
    again = run(_mlp_tied_spec(d), "-q", "--plan", str(plan), "--fail-on", "warning")
    assert again.returncode == 0, again.stderr + again.stdout


def _mlp_tied_spec(d: Path) -> str:
    return f"{d / (d.name.replace('-', '_') + '.py')}:model"


TIED = '''
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(256, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 256, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(256, 3, generator=g) @ torch.randn(3, 64, generator=g))
            self.mid.weight.copy_(torch.randn(64, 3, generator=g) @ torch.randn(3, 64, generator=g))
        self.out.weight = self.emb.weight
    def forward(self, ids):
        return self.out(self.mid(self.emb(ids)))
def model():
    return Tied(), (torch.zeros(1, 8, dtype=torch.long),)
'''


def _layers_present(*names: str) -> Callable:
    def check(d: Path, res: Any, run: Callable) -> None:
        got = {l["name"] for l in _json_report(d / OUT)["layers"]}
        assert set(names) <= got, (names, got)
    return check


def _valid_json(d: Path, res: Any, run: Callable) -> None:
    _json_report(d / OUT)


def _stdout_is_json(d: Path, res: Any, run: Callable) -> None:
    assert json.loads(res.stdout)["format_version"] == 1


def _counted_once(d: Path, res: Any, run: Callable) -> None:
    assert _json_report(d / OUT)["totals"]["params"] == 64 * 48 + 48 * 32, "a tied tensor was counted twice"


def _no_lr007(d: Path, res: Any, run: Callable) -> None:
    assert not [f for f in _json_report(d / OUT)["findings"] if f["code"] == "LR007"]


def _all_zero_found(d: Path, res: Any, run: Callable) -> None:
    found = [f for f in _json_report(d / OUT)["findings"] if f["code"] == "LR010"]
    assert [f["layers"] for f in found] == [["big"]] and "all-zero" in found[0]["message"], found


def _structure_or_memory(d: Path, res: Any, run: Callable) -> None:
    text = (res.stdout + res.stderr).lower()
    if res.returncode == 0:  # with -q the note is in the report, not on the terminal
        text += " ".join(_json_report(d / OUT)["meta"]["notes"]).lower()
    assert ("structure" in text) if res.returncode == 0 else ("memory" in text or "gb" in text), text[-500:]


def _cache_entries_checked(d: Path, res: Any, run: Callable) -> None:
    import numpy as np

    first = _json_report(d / OUT)["suggestions"]
    entries = [p for p in (d / "cache").rglob("*.f64")]
    assert entries
    for p in entries:
        np.full(p.stat().st_size // 8, np.nan).tofile(p)  # same size, NaN content
    again = run(_mlp(d), "-q", "--cache-dir", str(d / "cache"), "--format", "json", "-o", str(d / "out2"))
    assert again.returncode == 0, again.stderr
    again_s = _json_report(d / "out2")["suggestions"]
    assert again_s == first, {k: (first[k], again_s[k]) for k in first if first[k] != again_s.get(k)}


def _home_untouched(d: Path, res: Any, run: Callable) -> None:
    assert not any((d / "home").iterdir()), list((d / "home").rglob("*"))


def _no_raw_controls(d: Path, res: Any, run: Callable) -> None:
    md = (d / OUT / "lowrank-audit.md").read_text()
    for text in (md, res.stdout):
        assert "\x1b" not in text and "\u202e" not in text and "\n[PASS" not in text
    import re

    live = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", md)  # code spans are inert: markup inside them is text
    assert "![x](http" not in live and "\n# evil" not in md, live



# issue 19: the calibration inputs and the command line (a factory with calibration functions and metrics)
CAL = LOW_RANK.replace("def model():\n", "def model():\n    torch.manual_seed(0)\n") + """
import sys


def rows(n=16, width=48, seed=1):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def cal(offset=0):
    return [rows(seed=s + offset) for s in range(4)]


def cal_other():
    return cal(10)


def wide_held_out():
    return [rows(), rows(seed=2), rows(width=40)]


def endless():
    while True:
        yield rows(2)


class Custom(BaseException):
    pass


def cal_custom():
    raise Custom("from the calibration")


def metric_exit0(model, batches):
    sys.exit(0)


TARGETS = []


def mse(model, batches):
    if not TARGETS:  # the first call scores the dense model
        with torch.no_grad():
            TARGETS.extend(model(b) for b in batches)
    return float(sum((model(b) - t).pow(2).mean() for b, t in zip(batches, TARGETS)))


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(48, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.fc(x) + 0.1 * torch.randn(x.shape[0], 64))


def noisy():
    torch.manual_seed(0)
    return Noisy(), (torch.zeros(1, 48),)


class Ids(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.fc = nn.Linear(32, 32)

    def forward(self, input_ids, attention_mask=None):
        h = self.fc(self.emb(input_ids))
        return h if attention_mask is None else h * attention_mask[..., None]


def ids():
    torch.manual_seed(0)
    return Ids(), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}


def ids_cal(bad=None, mask=None):
    g = torch.Generator().manual_seed(0)
    out = [{"input_ids": torch.randint(0, 100, (4, 8), generator=g),
            "attention_mask": torch.ones(4, 8, dtype=torch.long)} for _ in range(4)]
    if bad is not None:
        out[-1]["input_ids"][1, 2] = bad
    if mask is not None:
        out[2]["attention_mask"] = mask
    return out


def ids_oov():
    return ids_cal(bad=100)


def mask_zero():
    return ids_cal(mask=torch.zeros(4, 8, dtype=torch.long))


def wide():
    return nn.Sequential(nn.Linear(200_000, 8, bias=False), nn.Linear(8, 4)), (torch.zeros(1, 200_000),)


def wide_cal():
    return [torch.zeros(2, 200_000)]
"""


def _cal(d: Path) -> str:
    """The issue-19 factory file of this case; returns its path (``PATH:fn`` names a function in it)."""
    return _py(d, CAL).rpartition(":")[0]


def _statistics_entry_from_another_calibration(d: Path, run: Callable) -> None:
    src = _cal(d)
    for cache, fn, out in (("cache", "cal", "first"), ("other", "cal_other", "o")):
        res = run(f"{src}:model", "-q", "--calibration", f"{src}:{fn}", "--cache-dir", str(d / cache),
                  "--format", "json", "-o", str(d / out))
        assert res.returncode == 0, res.stderr
    import shutil

    # an entry is a directory <key>/ (meta.json and one .npy per distinct Gram)
    [mine] = [p for p in (d / "cache" / "calibration").iterdir() if p.is_dir()]
    [foreign] = [p for p in (d / "other" / "calibration").iterdir() if p.is_dir()]
    shutil.rmtree(mine)
    shutil.copytree(foreign, mine)  # the other calibration's statistics under this one's key
    shutil.rmtree(d / "other")


def _statistics_recomputed(d: Path, res: Any, run: Callable) -> None:
    cal = _json_report(d / OUT)["calibration"]
    first = json.loads((d / "first" / "lowrank-audit.json").read_text())["calibration"]
    assert cal["statistics_cached"] is False
    assert {k: v["ranks_for"] for k, v in cal["layers"].items()} == \
        {k: v["ranks_for"] for k, v in first["layers"].items()}


def _tied_bias_once(d: Path, res: Any, run: Callable) -> None:
    assert _json_report(d / OUT)["totals"]["params"] == 25 + 25 * 16 + 16 * 16, "a tied bias was counted twice"


# -- the cases -------------------------------------------------------------------------------------------------------

def _cases() -> list[Case]:
    import torch

    c: list[Case] = []
    add = c.append
    W = "wrong audits that exit 0"
    R = "reading or replacing what was not asked"
    INJ = "injection"
    CR = "crashes, hangs, blow-ups"
    AON = "all-or-nothing output"
    LV = "loose validation"

    # ---- wrong audits that exit 0 (load, spectra, graph) ----
    def hf_partial(d: Path) -> list[str]:
        ck = _hf_dir(d)
        _safetensors(ck / "model.safetensors", {"transformer.h.0.mlp.c_fc.weight": torch.zeros(32, 128)})
        return [str(ck), "-q", "--format", "json", "-o", OUT]
    add(Case("hf-checkpoint-covers-one-matrix", W, hf_partial, 2, "lacks"))

    def hf_empty_map(d: Path) -> list[str]:
        ck = _hf_dir(d)
        _text(ck, "model.safetensors.index.json", json.dumps({"weight_map": {}}))
        return [str(ck), "-q", "--format", "json", "-o", OUT]
    add(Case("hf-index-weight-map-empty", W, hf_empty_map, 2, "empty weight_map"))

    def weights_missing(d: Path) -> list[str]:
        torch.save({"0.weight": torch.zeros(64, 48), "0.bias": torch.zeros(64)}, d / "w.pt")
        return [_mlp(d), "-q", "--weights", str(d / "w.pt"), "--format", "json", "-o", OUT]
    add(Case("weights-missing-a-tensor", W, weights_missing, 2, "lacks"))

    def weights_empty_dir(d: Path) -> list[str]:
        (d / "wdir").mkdir()
        return [_mlp(d), "-q", "--weights", str(d / "wdir"), "--format", "json", "-o", OUT]
    add(Case("weights-dir-without-weights", W, weights_empty_dir, 2, None))

    def bare_config(d: Path) -> list[str]:
        return [str(_hf_dir(d) / "config.json"), "-q", "--format", "json", "-o", OUT]
    add(Case("bare-config-random-weights", W, bare_config, (0, 2), None, check=_structure_or_memory))

    def norms(d: Path) -> list[str]:
        return [_py(d, '''
from torch.nn.utils import parametrize, spectral_norm
from torch.nn.utils.parametrizations import weight_norm
class Sym(nn.Module):
    def forward(self, w):
        return w + w.T
def model():
    m = nn.Sequential(weight_norm(nn.Linear(32, 32)), spectral_norm(nn.Linear(32, 32)), nn.Linear(32, 32))
    parametrize.register_parametrization(m[2], "weight", Sym())
    return m, (torch.zeros(1, 32),)
'''), "-q", "--format", "json", "-o", OUT]
    add(Case("weight-norm-spectral-norm-parametrize", W, norms, (0, 1), check=_layers_present("0", "1", "2")))

    def einsum(d: Path) -> list[str]:
        return [_py(d, '''
class E(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 48))
        self.fc = nn.Linear(48, 8)
    def forward(self, x):
        return self.fc(torch.einsum("bi,oi->bo", x, self.w)[:, :48])
def model():
    return E(), (torch.zeros(2, 48),)
'''), "-q", "--format", "json", "-o", OUT]
    add(Case("einsum-parameter-with-inputs", W, einsum, (0, 1), check=_layers_present("w", "fc")))

    def tied_shards(d: Path) -> list[str]:
        ck = d / "shards"
        ck.mkdir()
        a, b = _low_rank(64, 48), _low_rank(48, 32, seed=1)
        _safetensors(ck / "model-00001-of-00002.safetensors", {"emb.weight": a, "fc.weight": b})
        _safetensors(ck / "model-00002-of-00002.safetensors", {"head.weight": a.clone()})
        _text(ck, "model.safetensors.index.json", json.dumps({"weight_map": {
            "emb.weight": "model-00001-of-00002.safetensors", "fc.weight": "model-00001-of-00002.safetensors",
            "head.weight": "model-00002-of-00002.safetensors"}}))
        return [str(ck), "-q", "--format", "json", "-o", OUT]
    add(Case("tied-tensor-twice-in-two-shards", W, tied_shards, (0, 1), check=_counted_once))

    def walk_chains(d: Path) -> list[str]:
        return [_py(d, '''
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(64, 64), nn.Linear(64, 64)
    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x)
def model():
    return Attn(), (torch.zeros(1, 64),)
'''), "-q", "--tracer", "walk", "--format", "json", "-o", OUT]
    add(Case("lr007-on-module-walk", W, walk_chains, (0, 1), check=_no_lr007))

    def emitted_tied(d: Path) -> list[str]:
        return [_py(d, TIED), "-q", "--emit-plan", f"{OUT}/plan.toml", "--format", "json", "-o", OUT]
    add(Case("emitted-plan-targets-tied-weight", W, emitted_tied, 0, check=_tied_not_targeted))

    def cache_nan(d: Path) -> list[str]:
        return [_mlp(d), "-q", "--cache-dir", str(d / "cache"), "--format", "json", "-o", OUT]
    add(Case("cache-entries-nan", W, cache_nan, 0, check=_cache_entries_checked))

    def huge_values(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {"a.weight": _low_rank(dtype=torch.float64) * 1e200})
        return [str(d / "w.safetensors"), "-q", "--format", "json", "-o", OUT]
    add(Case("float64-near-1e200", W, huge_values, 0, absent=("non-finite",), check=_valid_json))

    def tiny_values(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {"a.weight": _low_rank(dtype=torch.float64) * 1e-200})
        return [str(d / "w.safetensors"), "-q", "--format", "json", "-o", OUT]
    add(Case("float64-near-1e-200", W, tiny_values, (0, 1), check=_valid_json))

    # ---- reading or replacing what was not asked ----
    def traversal(target: str) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            ck = d / "a" / "b"
            ck.mkdir(parents=True)
            _safetensors(d / "x.safetensors", {"stolen.weight": _low_rank()})
            _safetensors(ck / "model-1.safetensors", {"fc.weight": _low_rank()})
            path = target if target != "ABS" else str(d / "x.safetensors")
            _text(ck, "model.safetensors.index.json", json.dumps({"weight_map": {
                "fc.weight": "model-1.safetensors", "stolen.weight": path}}))
            return [str(ck), "-q", "--format", "json", "-o", OUT]
        return make
    add(Case("shard-index-dotdot", R, traversal("../../x.safetensors"), 2, None, absent=("stolen",)))
    add(Case("shard-index-absolute", R, traversal("ABS"), 2, None))
    add(Case("shard-index-etc-passwd", R, traversal("../../../../../../../../etc/passwd"), 2, None,
             absent=("exists",)))

    def emit_fifo(d: Path) -> list[str]:
        os.mkfifo(d / "fifo")  # stands in for /dev/null: never replace a non-regular file
        return [_mlp(d), "-q", "--emit-plan", str(d / "fifo")]
    add(Case("emit-plan-over-a-device-or-fifo", R, emit_fifo, 2, "refusing to replace it"))

    def emit_over_plan(d: Path) -> list[str]:
        plan = _text(d, "plan.toml", 'finetune = "x"\n[ranks]\n"0" = 8\n')
        return [_mlp(d), "-q", "--plan", str(plan), "--emit-plan", str(plan)]
    add(Case("emit-plan-over-the-plan-under-review", R, emit_over_plan, 2, "is the plan under review"))

    def remote_kernels(d: Path) -> list[str]:
        ck = _hf_dir(d, {**GPT2_CONFIG, "attn_implementation": "kernels-community/flash-attn"})
        return [str(ck / "config.json"), "--structure-only", "-q", "--format", "json", "-o", OUT]
    add(Case("config-attn-implementation-from-hub", R, remote_kernels, (0, 2), None,
             absent=("pip install kernels",)))  # never reach the Hub kernel loader at all

    def font_cache(d: Path) -> list[str]:
        (d / "home").mkdir()
        return [_mlp(d), "-q", "--format", "html", "-o", OUT]
    add(Case("matplotlib-cache-under-home", R, font_cache, 0, check=_home_untouched, child=True,
             env={"HOME": "HOME", "MPLCONFIGDIR": "", "XDG_CACHE_HOME": ""}))

    # ---- injection ----
    def toml_injection(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {'tiny\n[thresholds]\nfail_on = "never"\n#': torch.randn(64, 48),
                                           "fc.weight": _low_rank()})
        return [str(d / "w.safetensors"), "-q", "--emit-plan", f"{OUT}/plan.toml", "--format", "json", "-o", OUT]
    add(Case("emitted-plan-name-injection", INJ, toml_injection, 0, check=_emitted_plan_is_data_only))

    def terminal_markdown(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {
            "a\x1b]0;pwned\x07\x1b[2J.weight": _low_rank(), "b\nPASS: no errors.weight": _low_rank(seed=1),
            "c`![x](http://e/x.png)\n# evil.weight": _low_rank(seed=2), "\u202ed.weight": _low_rank(seed=3)})
        return [str(d / "w.safetensors"), "--format", "text,md", "-o", OUT]
    add(Case("names-in-terminal-and-markdown", INJ, terminal_markdown, 0, check=_no_raw_controls))

    def mathtext(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {"$\\undefinedcmd{x}$.weight": _low_rank(),
                                           "b.weight": _low_rank(seed=1)})
        return [str(d / "w.safetensors"), "-q", "--format", "html", "-o", OUT]
    add(Case("mathtext-name-in-charts", INJ, mathtext, 0))

    # ---- crashes, hangs, blow-ups ----
    def no_factorizable(d: Path) -> list[str]:
        return [_py(d, "def model():\n    return nn.LayerNorm(8), (torch.zeros(1, 8),)\n"),
                "-q", "--format", "json", "-o", OUT]
    add(Case("no-factorizable-layer", CR, no_factorizable, 0))

    def empty_pt(d: Path) -> list[str]:
        torch.save({}, d / "empty.pt")
        return [str(d / "empty.pt"), "-q", "--format", "json", "-o", OUT]
    add(Case("empty-pt", CR, empty_pt, (0, 2), None))

    def zero_dims(d: Path) -> list[str]:
        return [_py(d, "def model():\n    return nn.Sequential(nn.Linear(0, 8), nn.Linear(8, 4)), None\n"),
                "-q", "--format", "json", "-o", OUT]
    add(Case("zero-sized-dimension", CR, zero_dims, 0))

    def float8(d: Path) -> list[str]:
        _safetensors(d / "w.safetensors", {"a.weight": _low_rank().to(torch.float8_e4m3fn),
                                           "b.weight": _low_rank(seed=1)})
        return [str(d / "w.safetensors"), "-q", "--format", "json", "-o", OUT]
    add(Case("float8-weights", CR, float8, 0))

    def sparse(d: Path) -> list[str]:
        torch.save({"a.weight": _low_rank().to_sparse(), "b.weight": _low_rank(seed=1)}, d / "w.pt")
        return [str(d / "w.pt"), "-q", "--format", "json", "-o", OUT]
    add(Case("sparse-weights-in-pt", CR, sparse, (0, 2), None))

    def nonstring_keys(d: Path) -> list[str]:
        torch.save({1: _low_rank(), "b.weight": _low_rank(seed=1)}, d / "w.pt")
        return [str(d / "w.pt"), "-q", "--format", "json", "-o", OUT]
    add(Case("non-string-keys-in-pt", CR, nonstring_keys, 2, None))

    def lazy(d: Path) -> list[str]:
        return [_py(d, "def model():\n    return nn.Sequential(nn.LazyLinear(8)), None\n"), "-q"]
    add(Case("lazy-linear", CR, lazy, 2, "lazy"))

    def cycle(d: Path) -> list[str]:
        return [_py(d, "def model():\n    a = nn.Sequential(nn.Linear(8, 8))\n    b = nn.Sequential(a)\n"
                       "    a.add_module('back', b)\n    return b, None\n"), "-q"]
    add(Case("module-cycle", CR, cycle, 2, "cycle"))

    def base_exception(d: Path) -> list[str]:
        return [_py(d, "class Stop(BaseException):\n    pass\ndef model():\n    raise Stop('no')\n"), "-q"]
    add(Case("factory-raises-baseexception", CR, base_exception, 2, "Stop"))

    def exit_at_import(d: Path) -> list[str]:
        return [_py(d, "import sys\nsys.exit(0)\ndef model():\n    return nn.Linear(8, 8), None\n"), "-q"]
    add(Case("sys-exit-at-factory-import", LV, exit_at_import, 2, None))

    def prints(d: Path) -> list[str]:
        return [_py(d, LOW_RANK.replace("    return m,", "    print('building...')\n    return m,")),
                "-q", "--format", "json"]
    add(Case("factory-prints-to-stdout", LV, prints, 0, check=_stdout_is_json))

    def root_linear(d: Path) -> list[str]:
        return [_py(d, "def model():\n    return nn.Linear(64, 48), (torch.zeros(1, 64),)\n"),
                "-q", "--format", "json", "-o", OUT]
    add(Case("root-linear-name", LV, root_linear, 0, check=_layers_present("Linear")))

    add(Case("empty-model-spec", LV, lambda d: ["", "-q"], 2, None))

    def legacy_bin(d: Path) -> list[str]:
        torch.save({"0.weight": _low_rank(), "0.bias": torch.zeros(64), "2.weight": _low_rank(48, 64),
                    "2.bias": torch.zeros(48), "4.weight": torch.zeros(4, 48), "4.bias": torch.zeros(4)},
                   d / "w.bin", _use_new_zipfile_serialization=False)
        return [_mlp(d), "-q", "--weights", str(d / "w.bin"), "--format", "json", "-o", OUT]
    add(Case("legacy-non-zip-bin", LV, legacy_bin, (0, 1), None))

    for shape, label in (("1,,48", "empty"), ("-1,48", "negative"), ("0,48", "zero"),
                         ("99999999999,99999999999", "huge")):
        add(Case(f"input-shape-{label}", CR, lambda d, shape=shape: [_mlp(d), "-q", f"--input-shape={shape}"], 2, None,
                 owner=None))

    def ids_meta(d: Path) -> list[str]:
        return [str(_hf_dir(d) / "config.json"), "--structure-only", "--input-ids", "4096,1048576", "-q",
                "--format", "json", "-o", OUT]
    add(Case("input-ids-allocated-before-meta", CR, ids_meta, (0, 2), None, child=True))

    def zero_stride(d: Path) -> list[str]:
        big = torch.zeros(1).expand(30000, 30000)  # a 4-byte storage viewed as 30000 x 30000
        torch.save({"big.weight": big, "fc.weight": _low_rank()}, d / "w.pt")
        return [str(d / "w.pt"), "-q", "--format", "json", "-o", OUT]
    # an all-zero weight is an LR010 error finding (exit 1), never a crash
    add(Case("zero-stride-30000-squared", CR, zero_stride, 1, None, check=_all_zero_found, child=True, timeout=90))

    def fifo_in_cache(d: Path) -> list[str]:
        return [_mlp(d), "-q", "--cache-dir", str(d / "cache"), "--format", "json", "-o", OUT]
    def plant_fifos(d: Path, run: Callable) -> None:
        assert run(*[a.replace(OUT, str(d / "first")) for a in fifo_in_cache(d)]).returncode == 0
        for p in (d / "cache").rglob("*.f64"):
            p.unlink()
            os.mkfifo(p)  # reading it would block forever
    add(Case("fifo-in-cache", CR, fifo_in_cache, 0, None, prepare=plant_fifos, child=True,
             timeout=60))

    def bare_7b(d: Path) -> list[str]:
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
               "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
        return [str(_hf_dir(d, cfg) / "config.json"), "-q", "--format", "json", "-o", OUT]
    add(Case("bare-7b-config-oom", CR, bare_7b, (0, 2), None, check=_structure_or_memory, child=True))

    # ---- all-or-nothing output ----
    add(Case("output-dir-is-a-file", AON, lambda d: [_mlp(d), "-q", "--format", "json", "-o",
                                                      str(_text(d, "afile", "x"))], 2, "is a file, not a folder"))
    add(Case("output-dir-under-proc", AON, lambda d: [_mlp(d), "-q", "--format", "json", "-o", "/proc/lra"], 2,
             "cannot write in /proc"))
    add(Case("emit-plan-at-a-folder", AON, lambda d: [_mlp(d), "-q", "--emit-plan", str(d)], 2, "is a folder"))
    add(Case("stdout-to-dev-full", AON, lambda d: [_mlp(d), "--format", "json"], 2,
             "cannot write to standard output", child=True, stdout="/dev/full"))

    # ---- loose validation ----
    add(Case("plan-0be", LV, lambda d: _plan(d, '[ranks]\n"0" = "0be"\n'), 2, "must be a fraction above 0"))
    add(Case("plan-nan-threshold", LV, lambda d: _plan(d, '[ranks]\n"0" = 8\n[thresholds]\nenergy_floor = nan\n'),
             2, "bad value nan"))
    add(Case("plan-negative-threshold", LV, lambda d: _plan(d, '[ranks]\n"0" = 8\n[thresholds]\nmin_share = -1\n'),
             2, "out of range"))
    add(Case("plan-fail-on-typo", LV, lambda d: _plan(d, '[ranks]\n"0" = 8\n[thresholds]\nfail_on = "eror"\n'),
             2, "Did you mean error"))
    add(Case("select-typo", LV, lambda d: [_mlp(d), "-q", "--select", "LR0100"], 2, "matches no rule"))
    add(Case("plan-duplicate-json-keys", LV, lambda d: _plan(d, '{"ranks": {"0": 8, "0": 9}}', ".json"), 2,
             "duplicate key"))
    add(Case("plan-bare-string", LV, lambda d: _plan(d, '"ranks"', ".json"), 2, "not a table of ranks",
             absent=("unknown key",)))
    add(Case("plan-list", LV, lambda d: _plan(d, "[1, 2]", ".json"), 2, "is a list"))
    add(Case("plan-null", LV, lambda d: _plan(d, "null", ".json"), 2, "is null"))
    add(Case("plan-deeply-nested", LV, lambda d: _plan(d, "[" * 50000 + "]" * 50000, ".json"), 2,
             "nested too deeply"))
    add(Case("plan-non-utf8", LV, lambda d: _plan(d, b"[ranks]\n\"\xc3\x28\" = 8\n"), 2, "not UTF-8"))
    add(Case("plan-absurd-number", LV, lambda d: _plan(d, '{"ranks": {"0": 1e999}}', ".json"), 2, "too large"))
    add(Case("plan-absurd-rank", LV, lambda d: _plan(d, '[ranks]\n"0" = 100000000000000000000\n'), 2,
             "larger than any matrix"))
    add(Case("plan-unknown-layer", LV, lambda d: _plan(d, '[ranks]\n"fc9" = 8\n'), 2, "matches no factorizable"))
    for label, content, frag in (("not-json", "{", "not readable JSON"),
                                 ("wrong-types", '{"format_version": 1, "findings": "none"}', "not a list"),
                                 ("missing-keys", '{"layers": []}', "is missing")):
        add(Case(f"baseline-{label}", LV, lambda d, content=content: [
            _mlp(d), "-q", "--baseline", str(_text(d, "old.json", content)), "--format", "md", "-o", OUT], 2, frag))

    # ---- issue 19: exit codes, calibration inputs, the statistics cache, metrics, words, counting ----
    EX = "exit codes"
    CI = "calibration inputs checked and capped"
    SC = "the statistics cache"
    MF = "metric and forward"
    WD = "misleading words"
    CT = "counting"

    def h19(fn: str, *extra: str, model: str = "model") -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            src = _cal(d)
            return [f"{src}:{model}", "-q", "--no-cache", "--calibration", f"{src}:{fn}",
                    *(e.replace("PY:", f"{src}:") for e in extra)]
        return make
    add(Case("metric-calls-sys-exit-0", EX, h19("cal", "--metric", "PY:metric_exit0", "--measure-floor"), 2,
             "called sys.exit(0) instead of returning"))
    add(Case("calibration-raises-a-custom-base-exception", EX, h19("cal_custom"), 2, "raised Custom: from the "
             "calibration"))
    add(Case("usage-error-is-one-line", EX, lambda d: [_mlp(d), "--frobnicate"], 2,
             "unrecognized arguments: --frobnicate. See lowrank-audit --help", absent=("usage:",)))
    add(Case("stdout-closed", EX, lambda d: [_mlp(d), "--format", "json"], 2, "standard output is closed",
             child=True, stdout="CLOSED"))
    add(Case("held-out-batch-of-another-width", CI, h19("wide_held_out"), 2, "held-out batch 0 from"))
    add(Case("token-id-outside-the-vocabulary", CI, h19("ids_oov", model="ids"), 2, "holds token id 100, outside"))
    add(Case("all-zero-attention-mask", CI, h19("mask_zero", model="ids"), 2, "is all zeros (every position"))
    add(Case("endless-calibration-generator", CI, h19("endless"), 2, "yields more than 100,000 rows",
             child=True, timeout=120))
    add(Case("calibration-file-over-the-byte-cap", CI, lambda d: [
        _mlp(d), "-q", "--no-cache", "--calibration", str(_safetensors(d / "c.safetensors",
                                                                       {"input": torch.zeros(4096, 48)})),
        "--calibration-max-bytes", "100K"], 2, "more than the 100.0 KiB calibration data is capped at"))
    add(Case("gram-of-a-200000-wide-input", CI, h19("wide_cal", "--holdout", "0", "--no-spectra", model="wide"), 2,
             "float64 Grams and whitenings n x n, the largest 200,000 x 200,000", child=True, timeout=120))
    add(Case("one-row-calibration-with-holdout", CI, lambda d: [
        _mlp(d), "-q", "--no-cache", "--calibration", str(_safetensors(d / "c.safetensors",
                                                                       {"input": torch.zeros(1, 48)}))], 2,
        "holds one row, so nothing can be held out of it"))

    def foreign_entry(d: Path) -> list[str]:
        src = _cal(d)
        return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--cache-dir", str(d / "cache"),
                "--format", "json", "-o", OUT]
    add(Case("statistics-entry-from-another-calibration", SC, foreign_entry, 0,
             prepare=_statistics_entry_from_another_calibration, check=_statistics_recomputed))
    add(Case("lower-is-better-metric", MF, h19("cal", "--metric", "PY:mse", "--measure-floor"), 2,
             "it looks lower-is-better"))
    add(Case("noise-in-the-forward", MF, h19("cal", "--measure-floor", model="noisy"), 2,
             "the model's forward does not repeat"))

    def fifo_calibration(d: Path) -> list[str]:
        os.mkfifo(d / "c.safetensors")
        return [_mlp(d), "-q", "--calibration", str(d / "c.safetensors")]
    add(Case("calibration-is-a-fifo", WD, fifo_calibration, 2, "is a FIFO (named pipe), not a file",
             absent=("does not exist",), child=True, timeout=60))
    add(Case("tolerance-nan", WD, h19("cal", "--tolerance", "nan"), 2, "tolerance nan is not a finite number",
             absent=("negative",)))
    add(Case("path-map-without-scheduler", WD, lambda d: [_mlp(d), "-q", "--path-map", "/a=/b"], 2,
             "no --scheduler is given", child=True, env={"LOWRANK_AUDITOR_SCHEDULER": ""}))
    add(Case("scheduler-ucx", WD, lambda d: [_mlp(d), "-q", "--scheduler", "ucx://127.0.0.1:8786"], 2,
             "ucx:// needs UCX"))
    add(Case("scheduler-garbage", WD, lambda d: [_mlp(d), "-q", "--scheduler", "not an address"], 2,
             "is not a scheduler address"))
    add(Case("connect-timeout-not-a-number", WD, lambda d: [_mlp(d), "-q", "--scheduler", "tcp://127.0.0.1:8786"],
             2, "is not a number of seconds", child=True, env={"LOWRANK_AUDITOR_CONNECT_TIMEOUT": "soon"}))

    def tied_bias(d: Path) -> list[str]:
        g = torch.Generator().manual_seed(0)
        bias = torch.randn(25, generator=g)
        _safetensors(d / "w.safetensors", {"cls.predictions.bias": bias, "cls.predictions.decoder.bias": bias.clone(),
                                           "cls.predictions.decoder.weight": torch.randn(25, 16, generator=g),
                                           "fc.weight": torch.randn(16, 16, generator=g)})
        return [str(d / "w.safetensors"), "-q", "--format", "json", "-o", OUT]
    add(Case("tied-bias-in-a-weights-only-checkpoint", CT, tied_bias, (0, 1), check=_tied_bias_once))
    return c


# -- lowrank-audit factorize and its export (issue 19) ---------------------------------------------------------------

FZ = "factorize and its export"
SQUARE = "def model():\n    return nn.Sequential(nn.Linear(64, 64)), (torch.zeros(1, 64),)\n"


def _fz(d: Path, spec: str, plan: str = '[ranks]\n"0" = 8\n', *more: str) -> list[str]:
    return ["factorize", spec, "--plan", str(_text(d, "plan.toml", 'finetune = "1 epoch"\n' + plan)), *more]


def _intact(*names: str) -> Callable:
    """The files the refused run was pointed at are all still there, not emptied."""
    def check(d: Path, res: Any, run: Callable) -> None:
        for name in names:
            p = d / name
            assert p.is_file() and p.stat().st_size > 0, f"{name} was deleted"
    return check


def _nothing_beside(d: Path, res: Any, run: Callable) -> None:
    assert not (d / OUT).exists(), "a half-written output is in place"
    assert not [p for p in d.iterdir() if p.name.startswith(".lowrank-audit-")], list(d.iterdir())


def _factorize_cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    def over_inputs(d: Path) -> list[str]:
        proj = d / "proj"
        proj.mkdir()
        spec = _py(proj, LOW_RANK)
        argv = _fz(proj, spec)
        return [*argv, "-o", str(proj), "--force"]
    add(Case("factorize-force-over-its-inputs", FZ, over_inputs, 2, "an input of this run",
             check=_intact("proj/proj.py", "proj/plan.toml")))

    def over_cwd(d: Path) -> list[str]:
        return [*_fz(d, _mlp(d)), "-o", ".", "--force"]
    add(Case("factorize-force-over-the-working-folder", FZ, over_cwd, 2, "is the working folder",
             check=_intact("factorize_force_over_the_working_folder.py", "plan.toml")))

    def no_marker(d: Path) -> list[str]:
        (d / "mine").mkdir()
        _text(d / "mine", "notes.txt", "my own work")
        return [*_fz(d, _mlp(d)), "-o", str(d / "mine"), "--force"]
    add(Case("factorize-force-over-a-folder-without-marker", FZ, no_marker, 2,
             "has no lowrank-audit-factorized.json", check=_intact("mine/notes.txt")))

    def forged_marker(d: Path) -> list[str]:
        (d / "mine").mkdir()
        _text(d / "mine", "lowrank-audit-factorized.json", '{"tool": "lowrank-auditor"}')
        _text(d / "mine", "data.bin", "precious")
        return [*_fz(d, _mlp(d)), "-o", str(d / "mine"), "--force"]
    add(Case("factorize-force-marker-beside-other-files", FZ, forged_marker, 2, "did not write",
             check=_intact("mine/data.bin")))

    def symlink_out(d: Path) -> list[str]:
        (d / "real").mkdir()
        os.symlink(d / "real", d / "lnk")
        return [*_fz(d, _mlp(d)), "-o", str(d / "lnk")]
    add(Case("factorize-output-is-a-symlink", FZ, symlink_out, 2, "is a symbolic link"))

    add(Case("factorize-output-under-proc", FZ, lambda d: [*_fz(d, _mlp(d)), "-o", "/proc/lra-factorized"], 2,
             "cannot write in /proc"))
    add(Case("factorize-output-under-a-file", FZ,
             lambda d: [*_fz(d, _mlp(d)), "-o", str(_text(d, "afile", "x") / "sub")], 2, "is a file, not a folder"))
    add(Case("factorize-output-on-a-full-disk", FZ, lambda d: [*_fz(d, _mlp(d)), "-o", OUT, "--no-cache"], 2,
             "cannot write", check=_nothing_beside, child=True, fsize=8192))

    cplx = ('class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n'
            '        self.fc = nn.Linear(48, 64, dtype=torch.cfloat)\n'
            '    def forward(self, x):\n        return self.fc(x.to(torch.cfloat)).abs()\n'
            'def model():\n    return M(), (torch.zeros(1, 48),)\n')
    add(Case("factorize-complex-weights", FZ, lambda d: _fz(d, _py(d, cplx), '[ranks]\nfc = 4\n', "-o", OUT), 2,
             "complex"))

    def complex_calibrated(d: Path) -> list[str]:
        import torch

        _safetensors(d / "cal.safetensors", {"x": torch.randn(64, 48, generator=torch.Generator().manual_seed(0))})
        return _fz(d, _py(d, cplx), '[ranks]\nfc = 4\n', "--calibration", str(d / "cal.safetensors"), "-o", OUT,
                   "--no-cache")
    add(Case("factorize-complex-weights-calibrated", FZ, complex_calibrated, 2, "complex"))

    quant = ("import warnings\ndef model():\n    with warnings.catch_warnings():  # torch's deprecation notice\n"
             "        warnings.simplefilter('ignore')\n"
             "        return nn.Sequential(torch.ao.nn.quantized.dynamic.Linear(48, 64)), (torch.zeros(1, 48),)\n")
    add(Case("factorize-quantized-layer", FZ, lambda d: [*_fz(d, _py(d, quant)), "-o", OUT], 2, "is quantized"))
    ints = ("def model():\n    m = nn.Sequential(nn.Linear(48, 64))\n"
            "    m[0].weight = nn.Parameter(torch.ones(64, 48, dtype=torch.int8), requires_grad=False)\n"
            "    return m, None\n")
    add(Case("factorize-integer-weights", FZ, lambda d: [*_fz(d, _py(d, ints)), "-o", OUT], 2, "int8 weights"))
    add(Case("factorize-rank-at-break-even", FZ,
             lambda d: [*_fz(d, _py(d, SQUARE), '[ranks]\n"0" = 32\n'), "-o", OUT], 2,
             "rank 32 for 0 (64x64) is at or above its break-even rank 32.0"))
    add(Case("factorize-tied-second-name", FZ, lambda d: [*_fz(d, _py(d, TIED), "[ranks]\nout = 8\n"), "-o", OUT], 2,
             "names a tied weight: one tensor with the names emb.weight, out.weight"))
    add(Case("audit-plan-tied-second-name", FZ, lambda d: [
        _py(d, TIED), "-q", "--plan", str(_text(d, "plan.toml", "[ranks]\nout = 8\n")), "--format", "json", "-o",
        OUT], 2, "names a tied weight"))
    return c


@dataclass
class LibCase:
    """A hostile input to the Python API (``load_factorized``, ``save_factorized``): the call must raise AuditError
    with one line holding ``fragment``, never another exception, and ``check`` (the folder) must hold after it."""

    name: str
    kind: str
    make: Callable[[Path], Callable[[], Any]]  # writes the inputs, returns the call
    fragment: str
    check: Callable[[Path], None] | None = None


def _low_rank_model() -> Any:
    import torch
    from torch import nn

    ns: dict[str, Any] = {"torch": torch, "nn": nn}
    exec(LOW_RANK, ns)  # noqa: S102 - the corpus' own factory text
    return ns["model"]()[0]


def _factorized(d: Path, plan: dict[str, int] | None = None) -> tuple[Any, Path]:
    """The low-rank MLP, and a folder holding its factorization written by save_factorized."""
    from auditor.factorize import factorize, save_factorized

    model = _low_rank_model()
    plan = plan or {"0": 8, "2": 8}
    save_factorized(factorize(model, plan), plan, d / "fact")
    return model, d / "fact"


def _tamper_plan(content: str | bytes | Callable[[dict], Any]) -> Callable[[Path], Callable[[], Any]]:
    def make(d: Path) -> Callable[[], Any]:
        from auditor.factorize import load_factorized

        model, fact = _factorized(d)
        path = fact / "plan.json"
        if callable(content):
            path.write_text(json.dumps(content(json.loads(path.read_text()))))
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return lambda: load_factorized(model, fact)
    return make


def _tamper_weights(change: Callable[[dict], dict]) -> Callable[[Path], Callable[[], Any]]:
    def make(d: Path) -> Callable[[], Any]:
        from safetensors.torch import load_file, save_file

        from auditor.factorize import load_factorized

        model, fact = _factorized(d)
        path = fact / "model.safetensors"
        save_file(change(load_file(str(path))), str(path))
        return lambda: load_factorized(model, fact)
    return make


def _with(meta: dict, **kw: Any) -> dict:
    return {**meta, **kw}


def _without(key: str) -> Callable[[dict], dict]:
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def _outside_untouched(d: Path) -> None:
    assert (d / "outside.json").read_text() == "keep me", "save_factorized wrote through the symbolic link"


def _save_through_link(d: Path) -> Callable[[], Any]:
    from auditor.factorize import factorize, save_factorized

    model = _low_rank_model()
    (d / "fact").mkdir()
    _text(d, "outside.json", "keep me")
    os.symlink(d / "outside.json", d / "fact" / "plan.json")
    return lambda: save_factorized(factorize(model, {"0": 8}), {"0": 8}, d / "fact")


def lib_cases() -> list[LibCase]:
    import torch

    L = "load_factorized on a tampered output"
    c = [LibCase(f"load-plan-json-{label}", L, _tamper_plan(content), frag) for label, content, frag in (
        ("list", "[1, 2]", "holds a list"),
        ("null", "null", "holds null"),
        ("string", '"eight"', "holds a string"),
        ("rank-eight", lambda m: _with(m, plan={"0": "eight"}), "is eight, not a positive integer"),
        ("rank-nan", '{"format": "lowrank-auditor factorized", "format_version": 1, "plan": {"0": NaN}}',
         "NaN is not a number JSON allows"),
        ("rank-1e400", '{"format": "lowrank-auditor factorized", "format_version": 1, "plan": {"0": 1e400}}',
         "out of range"),
        ("rank-float", lambda m: _with(m, plan={"0": 8.0, "2": 8}), "not a positive integer"),
        ("rank-true", lambda m: _with(m, plan={"0": True}), "not a positive integer"),
        ("invalid-utf8", b'{"format": "\xc3\x28"}', "not UTF-8"),
        ("deeply-nested", "[" * 100000 + "]" * 100000, "nested too deeply"),
        ("missing-format", _without("format"), "it has no format"),
        ("missing-plan", _without("plan"), "has no plan"),
        ("missing-version", _without("format_version"), "format_version None"),
        ("duplicate-key", '{"format": "lowrank-auditor factorized", "format": 1}', "duplicate key"),
        ("unknown-layer", lambda m: _with(m, plan={"9": 8}), "not a factorizable layer"),
        ("ranks-not-the-tensors", lambda m: _with(m, plan={"0": 4, "2": 8}), "(plan.json gives 0 rank 4)"),
    )]
    W = "load_factorized on tampered weights"
    c += [LibCase(f"load-weights-{label}", W, _tamper_weights(change), frag) for label, change, frag in (
        ("nan", lambda t: {**t, "0.0.weight": torch.full_like(t["0.0.weight"], float("nan"))},
         "0.0.weight holds NaN or infinite values"),
        ("float64", lambda t: {**t, "0.0.weight": t["0.0.weight"].double()}, "0.0.weight is float64"),
        ("missing-tensor", lambda t: {k: v for k, v in t.items() if k != "4.weight"}, "lacks 4.weight"),
        ("extra-tensor", lambda t: {**t, "stowaway": torch.zeros(2)}, "tensors the plan does not build: stowaway"),
        ("wrong-shape", lambda t: {**t, "4.bias": torch.zeros(5)}, "4.bias is [5] but the plan builds [4]"),
    )]
    c.append(LibCase("load-weights-not-safetensors", W, _garbage_weights, "is not a readable safetensors file"))
    from round4_io import lib_cases as round4_io  # issue 32, part B: exports that never unpickle

    c += round4_io()
    c.append(LibCase("save-factorized-through-a-symlinked-plan-json", "save_factorized", _save_through_link,
                     "is a symbolic link; refusing to write through it", check=_outside_untouched))
    return c


def _garbage_weights(d: Path) -> Callable[[], Any]:
    from auditor.factorize import load_factorized

    model, fact = _factorized(d)
    (fact / "model.safetensors").write_bytes(b"\xff" * 64)
    return lambda: load_factorized(model, fact)


CASES_BY_NAME: dict[str, Case] = {}


def cases() -> list[Case]:
    """Every case (built once; ``make`` writes its inputs when called)."""
    if not CASES_BY_NAME:
        from round4_io import cases as round4_io  # issue 32, part B: what the tool writes and prints
        from round4_stats import cases as round4_stats  # issue 32, part A

        CASES_BY_NAME.update((k.name, k) for k in [*_cases(), *_factorize_cases(), *round4_io(), *round4_stats()])
    return list(CASES_BY_NAME.values())


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "corpus")
    root.mkdir(parents=True, exist_ok=True)
    for case in cases():
        d = root / case.name
        d.mkdir()
        argv_ = case.make(d)
        (d / "case.json").write_text(json.dumps({"kind": case.kind, "argv": argv_, "codes": case.codes,
                                                 "fragment": case.fragment, "owner": case.owner}, indent=1))
    for lib in lib_cases():  # the Python API's cases: the folder only (the call is in test_corpus.py)
        d = root / lib.name
        d.mkdir()
        lib.make(d)
        (d / "case.json").write_text(json.dumps({"kind": lib.kind, "api": True, "fragment": lib.fragment}, indent=1))
    print(f"{len(cases())} command-line cases and {len(lib_cases())} API cases in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
