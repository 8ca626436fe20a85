"""Findings for code review tools: SARIF 2.1.0 (``--format sarif``, for GitHub code scanning and any SARIF viewer)
and GitHub Actions workflow commands (``--format github``, annotations in a plain Actions log).

Each finding is placed where a reviewer would change something:

* a plan finding (a rule of scope ``plan``) of a plan file: the line of the layer's pattern in the plan (``"fc2" =
  300``), of ``finetune`` for the missing fine-tune budget, of ``[ranks]`` for the plan as a whole;
* any other finding about a layer: the statement in the model's code that creates the layer
  (:attr:`auditor.results.Layer.defined_at`, such as ``self.fc2 = nn.Linear(512, 512)``);
* otherwise the model's source file (the factory's ``def`` line for ``file.py:factory``).

Paths under the working directory (the repository root in CI) are written relative to it (``uriBaseId``
``%SRCROOT%``), others as absolute ``file://`` URIs. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .base import RenderContext, Stdout
from .parts.safe import escape, visible

if TYPE_CHECKING:
    from ..results import AuditResult, Finding
    from ..rules import Rule

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
SRCROOT = "%SRCROOT%"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}  # finding severity -> SARIF level
GITHUB_LEVELS = {"error": "error", "warning": "warning", "info": "notice"}


@dataclass(frozen=True)
class Where:
    """A finding's place: a file (absolute) and a 1-based line."""

    path: Path
    line: int


def _rule(code: str) -> "Rule | None":
    from ..errors import AuditError
    from ..rules import find_rule

    try:
        return find_rule(code)
    except AuditError:
        return None


# ---- where each finding goes ---------------------------------------------------------------------------------
def plan_lines(path: str | Path) -> dict[str, int]:
    """Line numbers (1-based) in a plan file: each ``[ranks]`` pattern, ``finetune`` and the ``[ranks]`` header (key
    ``"[ranks]"``). A TOML line is read with tomllib on its own, so quoted keys with escapes come back exactly; a JSON
    plan is searched for each key's JSON spelling. {} when the file cannot be read."""
    from ..config import tomllib

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    out: dict[str, int] = {}
    lines = text.splitlines()
    if Path(path).suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError:
            return {}
        ranks = data.get("ranks") if isinstance(data, dict) else None
        keys = [*(ranks if isinstance(ranks, dict) else {}), "finetune"]
        for key in keys:
            spelled = json.dumps(key) + ":"
            for n, line in enumerate(lines, 1):
                if spelled in line.replace('": ', '":'):
                    out.setdefault(key, n)
                    break
        for n, line in enumerate(lines, 1):
            if '"ranks"' in line:
                out.setdefault("[ranks]", n)
                break
        return out
    table = ""
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = re.match(r"^\[\s*([^\[\]]+?)\s*\]", stripped)
        if m:
            table = m.group(1).strip().strip('"')
            if table == "ranks":
                out.setdefault("[ranks]", n)
            continue
        try:
            parsed = tomllib.loads(line)
        except tomllib.TOMLDecodeError:
            continue
        if len(parsed) != 1:
            continue
        key, value = next(iter(parsed.items()))
        if table == "ranks" and not isinstance(value, dict):
            out.setdefault(key, n)
        elif table == "" and key == "finetune":
            out.setdefault("finetune", n)
    return out


def _factory_line(path: Path, name: str) -> int:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return 1
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node.lineno
    return 1


def model_source(audit: "AuditResult") -> Where | None:
    """The file the model came from: ``file.py:factory`` (at the factory), a checkpoint, a config file, or a Hugging
    Face folder's config.json; None for a Python object, ``torchvision:NAME`` and the like."""
    src = audit.source
    m = re.match(r"^(.*\.py):([A-Za-z_][A-Za-z0-9_.]*)$", src)
    if m and Path(m.group(1)).is_file():
        path = Path(m.group(1)).resolve()
        return Where(path, _factory_line(path, m.group(2).split(".")[0]))
    p = Path(src)
    try:
        if p.is_dir() and (p / "config.json").is_file():
            return Where((p / "config.json").resolve(), 1)
        if p.is_file():
            return Where(p.resolve(), 1)
    except OSError:
        return None
    return None


class Locator:
    """Places findings (see the module docstring); reads the plan file once."""

    def __init__(self, audit: "AuditResult") -> None:
        self.audit = audit
        rv = audit.review
        self.plan: Path | None = None
        self.plan_lines: dict[str, int] = {}
        self.pattern_of: dict[str, str] = {}
        if rv is not None and not rv.suggested and Path(rv.source).is_file():
            self.plan = Path(rv.source).resolve()
            self.plan_lines = plan_lines(self.plan)
            self.pattern_of = {it.layer: it.pattern for it in rv.items}
        self.model = model_source(audit)

    def _layer_site(self, name: str) -> Where | None:
        try:
            layer = self.audit.layer(name)
        except KeyError:
            return None
        if layer.defined_at is None:
            return None
        return Where(Path(layer.defined_at[0]), layer.defined_at[1])

    def where(self, f: "Finding") -> Where | None:
        rule = _rule(f.code)
        if self.plan is not None and rule is not None and str(rule.scope) == "plan":
            for name in f.layers:
                line = self.plan_lines.get(self.pattern_of.get(name, ""))
                if line:
                    return Where(self.plan, line)
            key = "finetune" if "finetune" in self.plan_lines and ("finetune" in f.message or f.code == "LR005") \
                else "[ranks]"
            return Where(self.plan, self.plan_lines.get(key, 1))
        for name in f.layers:
            site = self._layer_site(name)
            if site is not None:
                return site
        if self.plan is not None and rule is not None and str(rule.scope) == "plan":
            return Where(self.plan, 1)
        return self.model


def relative_uri(path: Path, root: Path | None = None) -> tuple[str, str | None]:
    """(uri, uriBaseId): relative to ``root`` (default the working directory) under ``%SRCROOT%``, else an absolute
    file URI with no base."""
    root = (root or Path.cwd()).resolve()
    try:
        rel = path.resolve().relative_to(root)
    except ValueError:
        return path.resolve().as_uri(), None
    return quote(rel.as_posix(), safe="/"), SRCROOT


def _relative_path(path: Path) -> str:
    """The path as an Actions annotation names it: relative to the working directory (the checkout) when inside."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _message(f: "Finding") -> str:
    text = visible(f.message)
    return text + (f" Fix: {visible(f.fix)}" if f.fix else "")


# ---- SARIF ---------------------------------------------------------------------------------------------------
def _absolute(url: str) -> bool:
    """Whether ``url`` is an absolute URI (a scheme, then ``:``), as SARIF's ``format: uri`` fields require."""
    import re

    return re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", url) is not None


def _descriptor(r: "Rule") -> dict[str, Any]:
    from ..rules.docs import rule_doc, rule_url

    what = r.sections.get("What it flags", r.summary)
    d: dict[str, Any] = {
        "id": r.code,
        "name": "".join(w.capitalize() for w in r.slug.split("-")),
        "shortDescription": {"text": r.summary},
        "fullDescription": {"text": " ".join(what.split())},
        "help": {"text": rule_doc(r), "markdown": rule_doc(r)},
        "defaultConfiguration": {"level": LEVELS.get(str(r.severity), "warning")},
        "properties": {"tags": ["low-rank", str(r.scope)], "slug": r.slug},
    }
    url = rule_url(r)
    if url and _absolute(url):  # SARIF's helpUri is an absolute URI; the help text above carries the rule's docs
        d["helpUri"] = url
    return d


def _fingerprint(f: "Finding") -> str:
    """Stable across runs and line moves: the rule and the layers (or the message when there are none)."""
    key = "\x00".join([f.code, *f.layers] if f.layers else [f.code, f.message])
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def to_sarif(audit: "AuditResult", root: Path | None = None) -> dict[str, Any]:
    """The SARIF 2.1.0 log as a dict: one run, the rules of the findings, one result per finding."""
    from .._version import __version__
    from ..rules import RULES
    import os

    from ..rules.docs import DOCS_URL

    docs = os.environ.get("LOWRANK_AUDITOR_DOCS_URL") or DOCS_URL
    root = (root or Path.cwd()).resolve()
    codes = list(dict.fromkeys(f.code for f in audit.findings))
    rules = [r for r in RULES.values() if r.code in codes]
    index = {r.code: i for i, r in enumerate(rules)}
    locate = Locator(audit)
    results = []
    for f in audit.findings:
        res: dict[str, Any] = {
            "ruleId": f.code,
            "level": LEVELS.get(str(f.severity), "warning"),
            "message": {"text": _message(f)},
            "partialFingerprints": {"lowrankAuditFinding/v1": _fingerprint(f)},
            "properties": {"slug": f.slug, "layers": [escape(name, "sarif") for name in f.layers]},
        }
        if f.code in index:
            res["ruleIndex"] = index[f.code]
        where = locate.where(f)
        if where is not None:
            uri, base = relative_uri(where.path, root)
            art: dict[str, Any] = {"uri": uri}
            if base:
                art["uriBaseId"] = base
            loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": art,
                                                        "region": {"startLine": max(1, where.line)}}}
            if f.layers:
                loc["logicalLocations"] = [{"fullyQualifiedName": escape(name, "sarif"), "kind": "member"}
                                           for name in f.layers[:8]]
            res["locations"] = [loc]
        results.append(res)
    run: dict[str, Any] = {
        "tool": {"driver": {
            "name": "lowrank-audit", "fullName": f"lowrank-auditor {__version__}", "version": __version__,
            "semanticVersion": __version__,
            **({"informationUri": docs.rsplit("/docs/", 1)[0]} if _absolute(docs) and "/docs/" in docs else {}),
            "rules": [_descriptor(r) for r in rules],
        }},
        "originalUriBaseIds": {SRCROOT: {"uri": root.as_uri() + "/"}},
        "automationDetails": {"id": f"lowrank-audit/{visible(audit.model_name)}/"},
        "columnKind": "unicodeCodePoints",
        "results": results,
        "properties": {"model": visible(audit.model_name), "source": visible(audit.source),
                       **_verification(audit)},
    }
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


class SarifReporter:
    name = "sarif"
    suffix = ".sarif"
    binary = False
    stdout = Stdout.DOCUMENT

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        return json.dumps(to_sarif(audit), indent=2, ensure_ascii=False) + "\n"


# ---- GitHub Actions workflow commands ------------------------------------------------------------------------
def escape_data(text: str) -> str:
    """A workflow command's message (:func:`auditor.render.parts.safe.escape` to ``github``).

    >>> escape_data("50% of\\nit")
    '50%25 of%0Ait'
    """
    return escape(text, "github")


def escape_property(text: str) -> str:
    """A workflow command's property value (file, title): also ``:`` and ``,``.

    >>> escape_property("a,b: c")
    'a%2Cb%3A c'
    """
    return escape(text, "github-property")


def _verification(audit: "AuditResult") -> dict[str, Any]:
    """The plan check's verification on rows the search never read, with its interval (calibration only)."""
    cal = audit.calibration
    pc = cal.plan_check if cal is not None else None
    v = pc.verification if pc is not None else None
    if v is None:
        return {}
    return {"verification": {"metric": cal.metric, "value": v.value, "low": v.low, "high": v.high,
                             "confidence": v.confidence, "rows": v.rows, "tolerance": cal.tolerance, "holds": v.ok,
                             "straddles": v.straddles, "text": v.words(cal.tolerance, cal.metric)}}


def github_annotations(audit: "AuditResult") -> str:
    """One ``::error file=...,line=...,title=...::message`` line per finding (``::warning``, ``::notice`` by
    severity); a finding without a file carries no file or line."""
    locate = Locator(audit)
    out = []
    for f in audit.findings:
        props = []
        where = locate.where(f)
        if where is not None:
            props += [f"file={escape_property(_relative_path(where.path))}", f"line={max(1, where.line)}"]
        props.append(f"title={escape_property(f'{f.code} {f.slug}')}")
        out.append(f"::{GITHUB_LEVELS.get(str(f.severity), 'warning')} {','.join(props)}::"
                   f"{escape_data(_message(f))}")
    ver = _verification(audit).get("verification")
    if ver is not None:  # the plan measured all at once on the verification rows, with its interval
        out.append(f"::notice title={escape_property('plan verification')}::"
                   f"{escape_data('measured all at once: ' + ver['text'])}")
    return "".join(line + "\n" for line in out)


class GithubReporter:
    name = "github"
    suffix = ".github.txt"
    binary = False
    stdout = Stdout.LOG

    def render(self, audit: "AuditResult", context: RenderContext) -> str:
        return github_annotations(audit)
