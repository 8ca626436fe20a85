"""Issue 32, part B (hardening round 4): what the tool writes and prints. Outputs that would replace an input of the
run, workflow commands and escape sequences from file names, a closed pipe, numbers JSON cannot hold, the emitted
recovery command, plans that silence their own review, settings of the wrong type, and exports that never unpickle.

Registered in ``make_corpus.cases()``; each case is built on the helpers of ``make_corpus``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from make_corpus import OUT, Case, LibCase, _factorized, _mlp, _py, _safetensors, _text  # noqa: F401

IO = "outputs that are inputs"


def _rows(n: int = 32, width: int = 48, seed: int = 1) -> Any:
    import torch

    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def _calibration(d: Path, name: str = "cal.safetensors", seed: int = 1) -> Path:
    return _safetensors(d / name, {"input": _rows(seed=seed)})


def _unchanged(*names: str) -> Callable:
    """The inputs named are as they were before the run (their bytes, recorded by ``make``)."""
    def check(d: Path, res: Any, run: Callable) -> None:
        for n in names:
            before = (d / (n + ".before")).read_bytes()
            assert (d / n).read_bytes() == before, f"{n} was replaced"
    return check


def _keep(d: Path, *names: str) -> None:
    for n in names:
        (d / (n + ".before")).write_bytes((d / n).read_bytes())


def _output_is_input_cases() -> list[Case]:
    def source(d: Path) -> list[str]:
        spec = _mlp(d)
        _keep(d, Path(spec.rpartition(":")[0]).name)
        return [spec, "-q", "--no-spectra", "--emit-plan", spec.rpartition(":")[0]]

    def calibration(which: str) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            _calibration(d)
            _calibration(d, "held.safetensors", seed=2)
            _keep(d, "cal.safetensors", "held.safetensors")
            return [_mlp(d), "-q", "--no-spectra", "--calibration", str(d / "cal.safetensors"), "--holdout",
                    str(d / "held.safetensors"), "--emit-plan", str(d / which)]
        return make

    def pyproject(d: Path) -> list[str]:
        _text(d, "pyproject.toml", "[tool.lowrank-auditor]\nalign = 8\n")
        _keep(d, "pyproject.toml")
        return [_mlp(d), "-q", "--no-spectra", "--emit-plan", "pyproject.toml"]

    def baseline_first(d: Path, run: Callable) -> None:
        r = run(_spec(d), "-q", "--no-spectra", "--format", "json", "-o", str(d / "reports"))
        assert r.returncode == 0, r.stderr
        _keep(d, "reports/lowrank-audit.json")

    def baseline(emit: bool) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            spec = _mlp(d)
            base = str(d / "reports" / "lowrank-audit.json")
            if emit:
                return [spec, "-q", "--no-spectra", "--baseline", base, "--emit-plan", base]
            return [spec, "-q", "--no-spectra", "--baseline", base, "--format", "json", "-o", str(d / "reports")]
        return make

    def hard_link(d: Path) -> list[str]:
        spec = _mlp(d)
        _keep(d, Path(spec.rpartition(":")[0]).name)
        os.link(spec.rpartition(":")[0], d / "linked.py")
        return [spec, "-q", "--no-spectra", "--emit-plan", str(d / "linked.py")]

    def weights_file(d: Path) -> list[str]:
        import torch

        _safetensors(d / "w.safetensors", {"fc.weight": torch.randn(64, 48)})
        _keep(d, "w.safetensors")
        return [str(d / "w.safetensors"), "-q", "--no-spectra", "--emit-plan", str(d / "w.safetensors")]

    def report_in_input_folder(d: Path) -> list[str]:
        import torch

        (d / "shards").mkdir()
        _safetensors(d / "shards" / "lowrank-audit.json", {"fc.weight": torch.randn(64, 48)})
        _keep(d, "shards/lowrank-audit.json")
        return [str(d / "shards" / "lowrank-audit.json"), "-q", "--no-spectra", "--format", "json", "-o",
                str(d / "shards")]

    def metric_file(d: Path) -> list[str]:
        _calibration(d)
        metric = _text(d, "metric.py", "def score(model, batches):\n    return 1.0\n")
        _keep(d, "metric.py")
        return [_mlp(d), "-q", "--no-spectra", "--calibration", str(d / "cal.safetensors"), "--metric",
                f"{metric}:score", "--emit-plan", str(metric)]

    frag = "an input of this run; writing it would replace the input"
    return [
        Case("emit-plan-is-the-factory-source", IO, source, 2, "--emit-plan", absent=("Traceback",),
             check=_checked(frag)),
        Case("emit-plan-is-the-calibration-file", IO, calibration("cal.safetensors"), 2,
             "is --calibration", check=_unchanged("cal.safetensors")),
        Case("emit-plan-is-the-held-out-file", IO, calibration("held.safetensors"), 2,
             "is --holdout", check=_unchanged("held.safetensors")),
        Case("emit-plan-is-pyproject-toml", IO, pyproject, 2, "is the settings file",
             check=_unchanged("pyproject.toml")),
        Case("emit-plan-is-the-baseline", IO, baseline(True), 2, "is --baseline", prepare=baseline_first,
             check=_unchanged("reports/lowrank-audit.json")),
        Case("json-report-advances-the-baseline", IO, baseline(False), 0, None, prepare=baseline_first,
             check=_advanced),  # the one exception: a ratchet (test_hardening_cli's good baseline)
        Case("emit-plan-is-a-hard-link-to-the-source", IO, hard_link, 2, "is the model source"),
        Case("emit-plan-is-the-checkpoint", IO, weights_file, 2, "is the model source",
             check=_unchanged("w.safetensors")),
        Case("report-replaces-the-checkpoint-in-its-folder", IO, report_in_input_folder, 2,
             "an input of this run", check=_unchanged("shards/lowrank-audit.json")),
        Case("emit-plan-is-the-metric-file", IO, metric_file, 2, "is --metric", check=_unchanged("metric.py")),
        Case("emit-plan-dash-is-not-stdout", IO, lambda d: [_mlp(d), "-q", "--no-spectra", "--emit-plan", "-"], 2,
             "would write a file named '-'"),
    ]


def _advanced(d: Path, res: Any, run: Callable) -> None:
    report = json.loads((d / "reports" / "lowrank-audit.json").read_text())
    assert report["baseline"]["new_findings"] == [], report["baseline"]


def _spec(d: Path) -> str:
    return f"{d / (d.name.replace('-', '_') + '.py')}:model"


def _checked(fragment: str) -> Callable:
    def check(d: Path, res: Any, run: Callable) -> None:
        assert fragment in res.stderr, res.stderr
        name = _spec(d).rpartition(":")[0]
        assert Path(name).read_bytes() == (d / (Path(name).name + ".before")).read_bytes()
    return check


# -- workflow commands and escape sequences from names --------------------------------------------------------------

ESC = "escaping of names"
HOSTILE = "p\n::error::owned\x1b[2J\u202e.toml"  # a new line that starts a workflow command, a screen clear, RLO
OVER = 'finetune = "x"\n[ranks]\n"fc2" = 300\n'  # LR001 on the sample MLP: an error finding placed in the plan


def _digits() -> str:
    return f"{Path(__file__).resolve().parents[2] / 'sample_models' / 'digits.py'}:mlp"


def _inert(d: Path, res: Any, run: Callable) -> None:
    """No raw control character reaches stdout or stderr, and every stdout line is one workflow command (or one
    check-plan line) of this run: none starts with what the file name carried."""
    import re

    text = res.stdout + res.stderr
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", text), repr(text[-400:])
    for line in res.stdout.splitlines():
        assert not line.startswith("::error::owned"), line
        assert re.match(r"^(::(error|warning|notice) |p\\n::error::owned)", line) or not line.startswith("::"), line


def _escape_cases() -> list[Case]:
    def plan(fmt: str | None, content: str = OVER, audit: bool = False) -> Callable[[Path], list[str]]:
        def make(d: Path) -> list[str]:
            path = _text(d, HOSTILE, content)
            if audit:
                return [_digits(), "--no-spectra", "--plan", str(path), "--format", fmt or "text", "-q"]
            return ["check-plan", "--model", _digits(), *(["--format", fmt] if fmt else []), str(path)]
        return make

    def written(d: Path) -> list[str]:
        return [_mlp(d), "-q", "--no-spectra", "--format", "json", "-o", OUT + "/r\x1b[2J\u202e"]

    def report_in_named_folder(d: Path, res: Any, run: Callable) -> None:
        _inert(d, res, run)
        assert (d / OUT / "r\x1b[2J\u202e" / "lowrank-audit.json").is_file()

    return [
        Case("check-plan-github-newline-in-plan-name", ESC, plan("github"), 1, "::error file=p%0A%3A%3Aerror",
             check=_inert),
        Case("check-plan-text-escape-in-plan-name", ESC, plan(None), 1, "p\\n::error::owned\\x1b[2J\\u202e.toml:3: error",
             check=_inert),
        Case("check-plan-bad-plan-escape-in-name", ESC, plan(None, '[ranks]\n"fc2" = "bad"\n'), 2,
             "cannot read rank 'bad'", check=_inert),
        Case("audit-github-newline-in-plan-name", ESC, plan("github", audit=True), 1,
             "title=LR001 rank-at-or-above-break-even", check=_inert),
        Case("audit-sarif-newline-in-plan-name", ESC, plan("sarif", audit=True), 1, '"ruleId": "LR001"',
             check=_inert),
        Case("wrote-line-escape-in-output-folder", ESC, written, 0, "wrote ", check=report_in_named_folder),
    ]


# -- a reader that stops early -----------------------------------------------------------------------------------

PIPE = "closed pipe"


def _quiet(d: Path, res: Any, run: Callable) -> None:
    assert res.stderr.strip() == "" or "error" not in res.stderr.lower(), res.stderr[-500:]


def _pipe_cases() -> list[Case]:
    def plans(d: Path) -> list[str]:
        return ["check-plan", "--model", _digits(), *[str(_text(d, f"plan{i:02d}.toml", OVER)) for i in range(12)]]

    def rules(*more: str) -> Callable[[Path], list[str]]:
        return lambda d: ["rules", *more]

    def table(d: Path) -> list[str]:
        return [_mlp(d), "--no-spectra", "--format", "text,json", "-o", OUT]

    return [
        Case("rules-into-a-closed-pipe", PIPE, rules(), 0, None, check=_quiet, child=True, stdout="EPIPE",
             timeout=120),
        Case("rules-markdown-into-a-closed-pipe", PIPE, rules("--markdown"), 0, None, check=_quiet, child=True,
             stdout="EPIPE", timeout=120),
        Case("check-plan-12-plans-into-a-closed-pipe", PIPE, plans, 1, None, check=_quiet, child=True,
             stdout="EPIPE", timeout=600),
        Case("audit-table-into-a-closed-pipe", PIPE, table, 0, None, check=_reports_kept, child=True,
             stdout="EPIPE", timeout=300),
    ]


def _reports_kept(d: Path, res: Any, run: Callable) -> None:
    """The reader of the table stopped; the files are the run's outputs all the same."""
    _quiet(d, res, run)
    json.loads((d / OUT / "lowrank-audit.json").read_text())


# -- numbers JSON cannot hold -------------------------------------------------------------------------------------

NUM = "numbers the tool cannot read back"
BLOWUP = '''

class Blowup(nn.Module):
    """exp(1000 * (fc(x) - the same product from a frozen copy)): ones on the dense model, infinite once fc is cut,
    so the measured output error of any plan is infinite."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(48, 64, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(64, 48, generator=g))
        self.register_buffer("frozen", self.fc.weight.detach().clone())

    def forward(self, x):
        return torch.exp(1000.0 * (self.fc(x) - torch.nn.functional.linear(x, self.frozen)))


def model():
    return Blowup().eval(), (torch.zeros(1, 48),)


def cal():
    return [torch.randn(16, 48, generator=torch.Generator().manual_seed(s)) for s in range(4)]
'''


def _strict(path: Path) -> dict:
    def bare(c: str) -> Any:
        raise AssertionError(f"bare {c} in {path.name}")

    return json.loads(path.read_text(), parse_constant=bare)


def _infinite_audit(d: Path) -> list[str]:
    spec = _py(d, BLOWUP)
    plan = _text(d, "plan.toml", 'finetune = "x"\n[ranks]\n"fc" = 4\n')
    return [spec, "--calibration", spec.replace(":model", ":cal"), "--plan", str(plan), "--format", "json", "-o",
            OUT, "-q", "--no-cache"]


def _infinite_read_back(d: Path, res: Any, run: Callable) -> None:
    report = _strict(d / OUT / "lowrank-audit.json")
    assert report["calibration"]["plan_check"]["measured"] is None, report["calibration"]["plan_check"]
    assert report["non_finite"]["/calibration/plan_check/measured"] == "inf", report.get("non_finite")
    spec = _spec(d)
    again = run(spec, "--calibration", spec.replace(":model", ":cal"), "--plan", str(d / "plan.toml"), "-q",
                "--no-cache", "--baseline", str(d / OUT / "lowrank-audit.json"), "--format", "json", "-o",
                str(d / OUT / "again"))
    assert again.returncode == 1, again.stderr  # the baseline the tool wrote is one it reads
    assert _strict(d / OUT / "again" / "lowrank-audit.json")["baseline"]["new_findings"] == []


def _infinite_factorize(d: Path) -> list[str]:
    argv = _infinite_audit(d)
    return ["factorize", argv[0], "--plan", argv[4], "--calibration", argv[2], "-o", OUT, "--no-cache"]


def _factorized_loads(d: Path, res: Any, run: Callable) -> None:
    import importlib.util

    from auditor.factorize import load_factorized

    meta = _strict(d / OUT / "plan.json")
    assert meta["measured"]["value"] is None and meta["non_finite"] == {"/measured/value": "inf"}, meta
    spec = importlib.util.spec_from_file_location(d.name.replace("-", "_"), _spec(d).rpartition(":")[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    load_factorized(mod.model()[0], d / OUT)  # the model it just wrote loads


def _number_cases() -> list[Case]:
    return [
        Case("audit-infinite-measured-metric-reads-back", NUM, _infinite_audit, 1, None,
             absent=("Infinity",), check=_infinite_read_back),
        Case("factorize-infinite-measured-metric-loads", NUM, _infinite_factorize, 1, "measured infinite (on 8 verification rows",  # a miss
             check=_factorized_loads),
    ]


# -- plans that silence their own review; settings of the wrong type --------------------------------------------

REVIEW = "settings and plans that silence their own review"
SILENCERS = {
    "ignore-every-rule": 'ignore = ["LR"]',
    "ignore-the-error": 'ignore = ["LR001"]',
    "fail-on-never": 'fail_on = "never"',
    "select-nothing-relevant": 'select = ["LR011"]',
    "ignore-by-slug": 'ignore = ["rank-at-or-above-break-even"]',
    "ignore-by-prefix": 'ignore = ["LR00"]',
}


def _silencing_plan(body: str, hook: bool, allow: str | None = None) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        if allow is not None:
            _text(d, "pyproject.toml", f"[tool.lowrank-auditor]\n{allow}\n")
        plan = _text(d, "plan.toml", OVER + f"[thresholds]\n{body}\n")
        if hook:  # the pre-commit hook's command, with and without the model
            return ["check-plan", str(plan)]
        return [_digits(), "-q", "--no-spectra", "--plan", str(plan)]
    return make


def _pyproject(body: str, hook: bool = False) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        _text(d, "pyproject.toml", f"[tool.lowrank-auditor]\n{body}\n")
        plan = _text(d, "plan.toml", OVER)
        return ["check-plan", "--model", _digits(), str(plan)] if hook else [_digits(), "-q", "--no-spectra"]
    return make


def _review_cases() -> list[Case]:
    out = []
    for label, body in SILENCERS.items():
        out.append(Case(f"plan-thresholds-{label}", REVIEW, _silencing_plan(body, False), 2,
                        "which would silence the review of this very plan"))
        out.append(Case(f"check-plan-thresholds-{label}", REVIEW, _silencing_plan(body, True), 2,
                        "plan_may_relax_review = true"))
    out += [
        Case("plan-thresholds-tighten-is-fine", REVIEW, _silencing_plan('fail_on = "warning"', False), 1, None),
        Case("plan-thresholds-select-every-rule-is-fine", REVIEW, _silencing_plan('select = ["LR"]', False), 1,
             None),
        Case("plan-thresholds-relax-allowed-by-pyproject", REVIEW,
             _silencing_plan('ignore = ["LR001"]', False, "plan_may_relax_review = true"), 0, None),
        Case("pyproject-relax-flag-not-a-boolean", REVIEW,
             _silencing_plan('ignore = ["LR001"]', False, 'plan_may_relax_review = "yes"'), 2,
             "plan_may_relax_review' in "),
    ]
    for label, key, value, frag in (("align-text", "align", '"16"', "is text '16', not a whole number"),
                                    ("floor-text", "energy_floor", '"0.5"', "is text '0.5', not a number"),
                                    ("select-text", "select", '"LR001"', "is text 'LR001', not a list"),
                                    ("targets-number", "energy_targets", "0.9", "is a number 0.9, not a list"),
                                    ("align-list", "align", "[8]", "has a bad value [8]"),
                                    ("fail-on-number", "fail_on", "1", "has a bad value 1")):
        for hook in (False, True):
            out.append(Case(f"{'check-plan-' if hook else ''}pyproject-{label}", REVIEW,
                            _pyproject(f"{key} = {value}", hook), 2, frag, check=_names_the_file))
    return out


def _names_the_file(d: Path, res: Any, run: Callable) -> None:
    assert " in pyproject.toml [tool.lowrank-auditor] " in res.stderr, res.stderr  # the file, from its folder


# -- the exported program is called like the model -----------------------------------------------------------------

EXPORTS = "factorize --export"
CHAR = '''

class Char(nn.Module):
    """Called as model(idx) with int64 ids, like the char transformer; its calibration file stores uint8 ids."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(64, 48)
        self.fc = nn.Linear(48, 64)
        self.head = nn.Linear(64, 64)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g))

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx.long()))))


def model():
    torch.manual_seed(0)
    return Char().eval(), (torch.zeros(1, 8, dtype=torch.long),)
'''


def _char_export(d: Path) -> list[str]:
    import torch

    spec = _py(d, CHAR)
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1), dtype=torch.long)
    _safetensors(d / "ids.safetensors", {"idx": ids.to(torch.uint8)})
    plan = _text(d, "plan.toml", '[ranks]\n"fc" = 4\n')
    return ["factorize", spec, "--plan", str(plan), "--calibration", str(d / "ids.safetensors"), "--export", "pt2",
            "-o", OUT, "--no-cache"]


def _called_like_the_model(d: Path, res: Any, run: Callable) -> None:
    """Plain torch, as the README says: positional int64 ids of the model's own kind, one row and three."""
    import torch

    from auditor.artifacts.export import load_program

    program = torch.export.load(str(d / OUT / "model.pt2")).module()
    for rows in (1, 3):
        ids = torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(rows))
        assert program(ids).shape == (rows, 8, 64)
    meta = json.loads((d / OUT / "plan.json").read_text())["export"]["pt2"]
    assert meta["positional"] == ["arg0"] and meta["keywords"] == [] and meta["inputs"][0]["dtype"] == "int64", meta
    load_program(d / OUT)  # and the tool's own loader accepts what it wrote


def _export_cases() -> list[Case]:
    return [Case("factorize-export-called-like-the-model", EXPORTS, _char_export, 0, "model.pt2",
                 check=_called_like_the_model)]


def cases() -> list[Case]:
    return [*_output_is_input_cases(), *_escape_cases(), *_pipe_cases(), *_number_cases(), *_review_cases(),
            *_export_cases()]


# -- exports that never unpickle (the Python API: auditor.artifacts.export.load_program) ------------------------------------

EXPORT = "load_program on a forged archive"
RAN = "ran.txt"  # what the planted code would create


class _Payload:
    """A pickle that runs code when loaded: creates a file (the case checks it never appears)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _exported(d: Path) -> Path:
    """A factorized low-rank MLP with its program exported, as lowrank-audit factorize --export pt2 writes it."""
    import torch

    from auditor.artifacts.export import cli_write
    from auditor.factorize import factorize

    model, fact = _factorized(d)
    cli_write(fact, factorize(model, {"0": 8, "2": 8}), None, (torch.zeros(1, 48),), ("pt2",))
    return fact


def _forge(d: Path, change: Callable[[dict[str, bytes], str], None]) -> Callable[[], Any]:
    """Rewrite model.pt2's members with ``change(members, root)``, then update plan.json's size and sha256 as a
    forger would; returns the load."""
    import hashlib
    import zipfile

    from auditor.artifacts.export import load_program

    fact = _exported(d)
    pt2 = fact / "model.pt2"
    with zipfile.ZipFile(pt2) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    root = next(iter(members)).split("/", 1)[0] + "/"
    change(members, root)
    with zipfile.ZipFile(pt2, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    meta = json.loads((fact / "plan.json").read_text())
    meta["export"]["pt2"].update(sha256=hashlib.sha256(pt2.read_bytes()).hexdigest(), bytes=pt2.stat().st_size)
    (fact / "plan.json").write_text(json.dumps(meta))
    return lambda: load_program(fact)


def _torch_save(obj: Any, protocol: int = 2) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def _sample_inputs(d: Path, obj: Callable[[Path], Any], protocol: int = 2) -> Callable[[], Any]:
    def change(m: dict[str, bytes], root: str) -> None:
        name = next(n for n in m if n.startswith(root + "data/sample_inputs/"))
        m[name] = _torch_save(obj(d), protocol)
    return _forge(d, change)


def _pickled_weight(d: Path) -> Callable[[], Any]:
    def change(m: dict[str, bytes], root: str) -> None:
        cfg_name = next(n for n in m if n.endswith("_weights_config.json"))
        cfg = json.loads(m[cfg_name])
        first = next(iter(cfg["config"].values()))
        first["use_pickle"] = True
        m[root + "data/weights/" + first["path_name"]] = _torch_save(_Payload(str(d / RAN)))
        m[cfg_name] = json.dumps(cfg).encode()
    return _forge(d, change)


def _opaque_constant(d: Path) -> Callable[[], Any]:
    import pickle

    def change(m: dict[str, bytes], root: str) -> None:
        cfg_name = next(n for n in m if n.endswith("_constants_config.json"))
        m[cfg_name] = json.dumps({"config": {"c": {"path_name": "opaque_obj_0", "is_param": False,
                                                    "use_pickle": False, "tensor_meta": None}}}).encode()
        m[root + "data/constants/opaque_obj_0"] = pickle.dumps(_Payload(str(d / RAN)))
    return _forge(d, change)


def _extra_member(path: str, data: bytes = b"") -> Callable[[Path], Callable[[], Any]]:
    def make(d: Path) -> Callable[[], Any]:
        def change(m: dict[str, bytes], root: str) -> None:
            m[root + path] = data or _torch_save(_Payload(str(d / RAN)))
        return _forge(d, change)
    return make


def _not_a_zip(d: Path) -> Callable[[], Any]:
    import hashlib

    from auditor.artifacts.export import load_program

    fact = _exported(d)
    (fact / "model.pt2").write_bytes(_torch_save(_Payload(str(d / RAN)))[:0] + b"\x80\x02cos\nsystem\n.")
    meta = json.loads((fact / "plan.json").read_text())
    data = (fact / "model.pt2").read_bytes()
    meta["export"]["pt2"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (fact / "plan.json").write_text(json.dumps(meta))
    return lambda: load_program(fact)


def _never_ran(d: Path) -> None:
    assert not (d / RAN).exists(), "the planted pickle ran"


def lib_cases() -> list[LibCase]:
    return [
        LibCase("load-program-pickle-in-sample-inputs", EXPORT,
                lambda d: _sample_inputs(d, lambda d: ((_Payload(str(d / RAN)),), {})),
                ".exec when unpickled", check=_never_ran),
        LibCase("load-program-stack-global-in-sample-inputs", EXPORT,
                lambda d: _sample_inputs(d, lambda d: ((_Payload(str(d / RAN)),), {}), protocol=4),
                "computes what it imports when unpickled", check=_never_ran),
        LibCase("load-program-pickled-weight", EXPORT, _pickled_weight, "stored as a pickle or an object",
                check=_never_ran),
        LibCase("load-program-opaque-constant", EXPORT, _opaque_constant,
                "a member torch.export.save does not write for a plain program",  # refused by name, before its bytes
                check=_never_ran),
        LibCase("load-program-legacy-constants-file", EXPORT, _extra_member("data/constants/model.pt"),
                "a pickled weight or constant file", check=_never_ran),
        LibCase("load-program-aoti-member", EXPORT, _extra_member("data/aotinductor/model/model.so", b"ELF"),
                "a member torch.export.save does not write", check=_never_ran),
        LibCase("load-program-extra-file", EXPORT, _extra_member("extra/evil.pkl"),
                "a member torch.export.save does not write", check=_never_ran),
        LibCase("load-program-not-a-zip", EXPORT, _not_a_zip, "is not a torch.export archive", check=_never_ran),
    ]
