"""Issue 32, part A (hardening round 4): calibration statistics, their cache and the calibration boundary, as
command-line cases for ``make_corpus.cases()``: code between repeated blocks, a cache keyed by everything that
shapes it (an edited forward, another held-out split), ids and labels, NaN produced by the forward, degenerate
models, cache files that are not files, and the compute dtype ``factorize`` reads statistics in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from make_corpus import OUT, Case, _json_report, _py

W = "wrong audits that exit 0"
CR = "crashes, hangs, blow-ups"
LV = "loose validation"

OUTPUT_INF = '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x))) / (x[:, :1] != 7).float()  # infinite where x[:, 0] == 7


def model():
    torch.manual_seed(0)
    return Net(), (torch.ones(1, 8),)


def cal():
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(8, 8, generator=g) for _ in range(4)]
    out[-1][2, 0] = 7.0  # the held-out batch
    return out
'''

# -- models and data ---------------------------------------------------------------------------------------------

BLOCKS = '''
OPS = {{"none": lambda h: h, "relu": torch.relu, "scale": lambda h: 0.5 * h, "flip": lambda h: h.flip(-1),
        "permute": lambda h: h[..., torch.arange(15, -1, -1)].roll(3, -1)}}


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, listed):
        super().__init__()
        blocks = [Blk() for _ in range(3)]
        # a ModuleList is streamed block by block; a ModuleDict of the same blocks (same names) is read in one pass
        self.blocks = nn.ModuleList(blocks) if listed else nn.ModuleDict({{str(i): b for i, b in enumerate(blocks)}})
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in (self.blocks if isinstance(self.blocks, nn.ModuleList) else self.blocks.values()):
            x = OPS["{op}"](b(x))
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Net(True), (torch.zeros(1, 16),)


def plain():
    torch.manual_seed(0)
    return Net(False), (torch.zeros(1, 16),)


def cal():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 16, generator=g) for _ in range(4)]
'''

LM = '''
class LM(nn.Module):
    def __init__(self, rows=50):
        super().__init__()
        self.emb = nn.Embedding(rows, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids, labels=None):  # takes labels= and ignores them
        return self.head(torch.relu(self.fc(self.emb(input_ids))))


def model():
    torch.manual_seed(0)
    return LM(), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}


def wide():  # 60 embedding rows, 50 logits: ids 50..59 are valid inputs but no target the head scores
    torch.manual_seed(0)
    return LM(60), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}


def _ids(labels=False):
    g = torch.Generator().manual_seed(0)
    out = [{"input_ids": torch.randint(0, 50, (4, 8), generator=g)} for _ in range(8)]
    if labels:
        for b in out:
            b["labels"] = b["input_ids"].clone()
    return out


def ids_past_logits():
    b = _ids()
    b[-1]["input_ids"][0, 3] = 55  # a held-out batch
    return b


def label(value):
    b = _ids(labels=True)
    b[-1]["labels"][1, 2] = value
    return b


def label_minus_1():
    return label(-1)


def label_minus_5():
    return label(-5)


def label_ignored():
    return label(-100)
'''

NAN = '''
class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(Blk() for _ in range(3))
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.log(self.inp(x).abs())  # -inf where a row is all zeros
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def model():
    torch.manual_seed(0)
    return Net(), (torch.ones(1, 8),)


def cal():
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(8, 8, generator=g) for _ in range(6)]
    out[2][3] = 0.0
    return out
'''

DEGENERATE = '''
def identity():
    return nn.Identity(), (torch.zeros(1, 8),)


def norms():
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.ReLU()), (torch.zeros(1, 8),)


def cal():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 8, generator=g) for _ in range(4)]
'''

SIMPLE = '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(48, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def model():
    torch.manual_seed(0)
    return Net(), (torch.zeros(1, 48),)


def cal():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 48, generator=g) for _ in range(8)]
'''

BF16 = '''
def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48))
    return m.to(torch.bfloat16), (torch.zeros(1, 48, dtype=torch.bfloat16),)


def cal():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 48, generator=g).to(torch.bfloat16) for _ in range(4)]
'''


def _src(d: Path, body: str) -> str:
    return _py(d, body).rpartition(":")[0]


def _cal_json(d: Path, out: str = OUT) -> dict:
    return _json_report(d / out)["calibration"]


def _layers(cal: dict) -> dict:
    return {k: {f: v[f] for f in ("ranks_for", "curve", "rows", "damping")} for k, v in cal["layers"].items()}


# -- checks --------------------------------------------------------------------------------------------------------

def _equals_one_pass(d: Path, res: Any, run: Callable) -> None:
    """The streamed model's tier-1 numbers are the one-pass model's (the same blocks in a ModuleDict) exactly."""
    src = next(d.glob("*.py"))
    again = run(f"{src}:plain", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o",
                str(d / "plain"))
    assert again.returncode == 0, again.stderr
    assert _layers(_cal_json(d)) == _layers(_cal_json(d, "plain"))


def _recomputed(d: Path, res: Any, run: Callable) -> None:
    assert _cal_json(d)["statistics_cached"] is False


def _recomputed_as_fresh(d: Path, res: Any, run: Callable) -> None:
    """Recomputed, and equal to a run without any cache (not the old forward's statistics)."""
    cal = _cal_json(d)
    assert cal["statistics_cached"] is False
    src = next(d.glob("*.py"))
    fresh = run(f"{src}:model", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o",
                str(d / "fresh"))
    assert fresh.returncode == 0, fresh.stderr
    assert _layers(cal) == _layers(_cal_json(d, "fresh"))


def _from_cache(d: Path, res: Any, run: Callable) -> None:
    assert _cal_json(d)["statistics_cached"] is True


def _nothing_to_plan(d: Path, res: Any, run: Callable) -> None:
    b = _cal_json(d)["budget"]
    assert b["plan"] == {} and b["ok"] is True and b["removed"] == 0


def _plan_records_float32(d: Path, res: Any, run: Callable) -> None:
    from auditor.config import tomllib

    plan = tomllib.loads((d / OUT / "plan.toml").read_text())
    assert plan["compute_dtype"] == "float32", plan


def _first_run(*flags: str, fn: str = "cal") -> Callable[[Path, Callable], None]:
    """A first audit with a cache in the case's folder (``cache``), before the case's own run."""
    def prepare(d: Path, run: Callable) -> None:
        src = next(d.glob("*.py"))
        res = run(f"{src}:model", "-q", "--calibration", f"{src}:{fn}", "--cache-dir", str(d / "cache"),
                  "--format", "json", "-o", str(d / "first"), *flags)
        assert res.returncode == 0, res.stderr
        assert _cal_json(d, "first")["statistics_cached"] is False
    return prepare


def _edit_forward(d: Path, run: Callable) -> None:
    _first_run()(d, run)
    src = next(d.glob("*.py"))
    text = src.read_text()
    src.write_text(text.replace("return self.out(torch.relu(self.fc(x)))",
                                "return self.out(torch.relu(self.fc(x)) * 2.0)"))  # same weights, another forward


def _fifo(victim: str) -> Callable[[Path, Callable], None]:
    """After a first run, something that is not a regular file where ``victim`` was: a FIFO for the Gram file,
    the metadata or the whole entry, a link to /dev/zero for the Gram file."""
    def prepare(d: Path, run: Callable) -> None:
        import shutil

        _first_run()(d, run)
        [entry] = [p for p in (d / "cache" / "calibration").iterdir() if p.is_dir()]
        if victim == "entry":
            shutil.rmtree(entry)
            os.mkfifo(entry)
            return
        target = entry / ("meta.json" if victim == "meta" else "g0.npy")
        target.unlink()
        if victim == "gram-link":
            os.symlink("/dev/zero", target)
        else:
            os.mkfifo(target)
    return prepare


# -- the cases -----------------------------------------------------------------------------------------------------

def cases() -> list[Case]:
    c: list[Case] = []
    add = c.append

    # code between repeated blocks: streaming must not skip it (the one pass's numbers, exit 0)
    for op in ("relu", "scale", "flip", "permute"):
        def between(d: Path, op: str = op) -> list[str]:
            src = _src(d, BLOCKS.format(op=op))
            return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o", OUT]
        add(Case(f"stream-{op}-between-blocks", W, between, 0, check=_equals_one_pass))

    # the statistics cache: an edited forward, another held-out split, the same run in another process
    def simple(*flags: str, fn: str = "cal") -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            src = _src(d, SIMPLE)
            return [f"{src}:model", "-q", "--calibration", f"{src}:{fn}", "--cache-dir", str(d / "cache"),
                    "--format", "json", "-o", OUT, *flags]
        return make
    add(Case("cache-forward-edited-same-weights", W, simple(), 0, prepare=_edit_forward, check=_recomputed_as_fresh))
    for share in ("0.5", "0.75"):
        add(Case(f"cache-holdout-{share}-after-0.25", W, simple("--holdout", share), 0,
                 prepare=_first_run("--holdout", "0.25"), check=_recomputed))
    add(Case("cache-compute-dtype-after-model", W, simple("--compute-dtype", "float32"), 0, prepare=_first_run(),
             check=_recomputed))
    add(Case("cache-same-run-hits-in-another-process", W, simple(), 0, prepare=_first_run(), check=_from_cache,
             child=True))

    # cache files that are not files (a hang before): refused at once, recomputed
    labels = {"gram": "gram-file-is-a-fifo", "meta": "meta-file-is-a-fifo", "entry": "entry-is-a-fifo",
              "gram-link": "gram-file-links-to-dev-zero"}
    for victim, label in labels.items():
        add(Case(f"cache-{label}", CR, simple(), 0, prepare=_fifo(victim), check=_recomputed,
                 child=True, timeout=120))

    # --cache-dir naming a file: refused at once (was accepted, every cache silently off)
    def cache_is_file(d: Path) -> list[str]:
        (d / "cache").write_text("not a folder")
        return [*simple()(d)]
    add(Case("cache-dir-is-a-file", CR, cache_is_file, 2, "--cache-dir", absent=("Traceback",)))

    # ids and labels at the calibration boundary
    def lm(fn: str, metric: str, model: str = "model") -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            src = _src(d, LM)
            return [f"{src}:{model}", "-q", "--calibration", f"{src}:{fn}", "--metric", metric, "--no-cache",
                    "--format", "json", "-o", OUT]
        return make
    for metric in ("perplexity", "masked-perplexity"):
        add(Case(f"ids-past-the-logits-{metric}", LV, lm("ids_past_logits", metric, "wide"), 2,
                 "holds token id 55 at row 0, position 3, outside the logits (0 to 49)"))
        for value in ("1", "5"):
            add(Case(f"labels-minus-{value}-{metric}", LV, lm(f"label_minus_{value}", metric), 2,
                     f"holds -{value} at row 1, position 2: a label is a token id (0 to 49) or -100, the ignore index"))
        add(Case(f"labels-minus-100-{metric}", LV, lm("label_ignored", metric), 0))

    # NaN or infinities produced by the forward: one line naming the layer and the batch
    def nan(d: Path) -> list[str]:
        src = _src(d, NAN)
        return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o", OUT]
    add(Case("forward-makes-infinities-on-a-batch", LV, nan, 2,
             "the forward produced NaN or infinite values on calibration batch 2: the input of layer blocks.0.fc"))

    def output_inf(d: Path) -> list[str]:
        src = _src(d, OUTPUT_INF)
        return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o", OUT]
    add(Case("forward-output-infinite-on-held-out-batch", LV, output_inf, 2,
             "the dense model's output on held-out batch 0 holds NaN or infinite values",
             absent=("does not repeat",)))

    # degenerate models: nothing factorizable
    def degenerate(fn: str, *flags: str) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            src = _src(d, DEGENERATE)
            return [f"{src}:{fn}", "-q", "--calibration", f"{src}:cal", "--no-cache", "--format", "json", "-o",
                    OUT, *flags]
        return make
    for fn in ("identity", "norms"):
        add(Case(f"{fn}-with-calibration", CR, degenerate(fn), 0))
        add(Case(f"{fn}-with-budget", CR, degenerate(fn, "--budget", "0.5"), 0, check=_nothing_to_plan))

    def factorize_empty(fn: str, *flags: str) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            src = _src(d, DEGENERATE)
            (d / "plan.toml").write_text("[ranks]\n")
            return ["factorize", f"{src}:{fn}", "--plan", str(d / "plan.toml"), "--calibration", f"{src}:cal",
                    "--no-cache", "-o", OUT, *flags]
        return make
    for flags in (("--recover", "5"), ("--export", "pt2"), ("--recover", "5", "--export", "onnx")):
        add(Case(f"factorize-identity-empty-plan{''.join(flags).replace('--', '-')}", CR,
                 factorize_empty("identity", *flags), 2, "the model has no weight matrix factorize can rewrite"))

    # the compute dtype: recorded by the emitted plan, followed (and not contradicted) by factorize
    def bf16_emit(d: Path) -> list[str]:
        src = _src(d, BF16)
        return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--no-cache", "--compute-dtype", "float32",
                "--emit-plan", f"{OUT}/plan.toml", "--format", "json", "-o", OUT]
    add(Case("bf16-emitted-plan-records-compute-dtype", W, bf16_emit, 0, check=_plan_records_float32))

    def bf16_contradicts(d: Path) -> list[str]:
        src = _src(d, BF16)
        (d / "plan.toml").write_text('compute_dtype = "float32"\n[ranks]\n"2" = 8\n')
        return ["factorize", f"{src}:model", "--plan", str(d / "plan.toml"), "--calibration", f"{src}:cal",
                "--no-cache", "--compute-dtype", "model", "--allow-no-saving", "-o", OUT]
    add(Case("factorize-compute-dtype-contradicts-plan", LV, bf16_contradicts, 2,
             "--compute-dtype model contradicts plan"))

    def bf16_review(d: Path) -> list[str]:
        src = _src(d, BF16)
        (d / "plan.toml").write_text('finetune = "1 epoch"\ncompute_dtype = "float32"\n[ranks]\n"2" = 8\n')
        return [f"{src}:model", "-q", "--calibration", f"{src}:cal", "--cache-dir", str(d / "cache"), "--plan",
                str(d / "plan.toml"), "--format", "json", "-o", OUT]
    add(Case("plan-review-reads-statistics-in-the-plans-dtype", W, bf16_review, (0, 1),
             prepare=_first_run("--compute-dtype", "float32"), check=_from_cache))

    def bad_plan_dtype(d: Path) -> list[str]:
        src = _src(d, BF16)
        (d / "plan.toml").write_text('compute_dtype = "float16"\n[ranks]\n"2" = 8\n')
        return ["factorize", f"{src}:model", "--plan", str(d / "plan.toml"), "-o", OUT]
    add(Case("plan-compute-dtype-float16", LV, bad_plan_dtype, 2, "'compute_dtype' is"))

    def dtype_without_calibration(d: Path) -> list[str]:
        src = _src(d, BF16)
        (d / "plan.toml").write_text('[ranks]\n"2" = 8\n')
        return ["factorize", f"{src}:model", "--plan", str(d / "plan.toml"), "--compute-dtype", "float32", "-o", OUT]
    add(Case("factorize-compute-dtype-without-calibration", LV, dtype_without_calibration, 2,
             "--compute-dtype needs --calibration"))
    return c


__all__ = ["cases"]
