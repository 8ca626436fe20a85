"""A factorized model that loads without this tool: a ``torch.export`` program (``model.pt2``), optionally an ONNX
file, and a README that says how to load them with plain torch.

``export(model, example, directory, formats)`` traces the (factorized) module with ``torch.export.export`` on the
example inputs (the model's own, from its factory, so the program is called as the model is: its positional and
keyword inputs; the first calibration batch only when there are none; integer ids as int64, the dtype the model
casts them to, and an ``attention_mask`` beside ``input_ids`` where the forward takes one, so a tokenizer's output
can be passed), the batch and the sequence dimension (dim 1 of token ids and masks) dynamic where the model allows it,
else the batch alone, else the example's static shapes (said in the README and on stderr), saves ``model.pt2``, loads
it back and checks that it reproduces the module's outputs to 1e-5 relative (``||y_pt2 - y|| / ||y||`` over every
output tensor) at the example, another batch size and several lengths; it returns the entry that goes into
plan.json under ``"export"`` (file, sha256, size, inputs, every check, the sizes the program refuses). ``onnx`` needs the ``onnx`` and ``onnxscript``
packages (``torch.onnx.export(..., dynamo=True)``) and is checked with onnxruntime when that is installed; without
them it is refused with one line. ``readme(...)`` writes the README.

``load_program(directory)`` is the tool's own loader: it reads plan.json strictly, refuses a ``model.pt2`` whose
size or sha256 differs from what plan.json records, refuses (:func:`check_archive`, whatever the checksums say) an
archive holding a member that torch would unpickle beyond plain tensors, and checks that the program's factors have the planned ranks
and its parameter count is the recorded one, each with one line; then it returns the ``ExportedProgram``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AuditError, first_line, no_duplicate_keys
from .outputs import strict_json

PT2 = "model.pt2"
ONNX = "model.onnx"
README = "README.md"
FORMATS = ("pt2", "onnx")
TOLERANCE = 1e-5  # relative output error allowed between the exported program and the module
ONNX_TOLERANCE = 1e-4  # onnxruntime's kernels differ from torch's in rounding
MAX_PLAN_BYTES = 16 << 20


def parse_formats(spec: str) -> tuple[str, ...]:
    """``pt2``, ``onnx`` or ``pt2,onnx`` (``--export``); pt2 is always written (ONNX is exported from it)."""
    names = [s.strip().lower() for s in str(spec).split(",") if s.strip()]
    bad = [n for n in names if n not in FORMATS]
    if not names or bad:
        raise AuditError(f"--export {spec!r} names {', '.join(map(repr, bad)) or 'no format'}",
                         "Give --export pt2, onnx or pt2,onnx")
    if "onnx" in names:
        check_onnx_available()
    return tuple(f for f in FORMATS if f == "pt2" or f in names)


def check_onnx_available() -> None:
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise AuditError(f"--export onnx needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}, "
                         "which this Python does not have",
                         "pip install onnx onnxscript (and onnxruntime to check the file), or use --export pt2")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in an output (tensor, tuple, list, dict, or an object pytree knows), in order."""
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def relative_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| over every output tensor (float64); inf when the structures differ."""
    a, b = _leaves(got), _leaves(want)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b) if y.is_floating_point())
    den = sum(float(y.double().pow(2).sum()) for y in b if y.is_floating_point())
    if any(not y.is_floating_point() and not torch.equal(x, y) for x, y in zip(a, b)):
        return math.inf
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


class _Plain(nn.Module):
    """Returns a Hugging Face ``ModelOutput`` (or another output class) as a plain dict of its tensors, so the
    program loads with torch alone. ``keywords``: the forward's signature names them (torch.export marks a keyword
    input's dimensions dynamic only by its name; under ``**kwargs`` it cannot)."""

    def __init__(self, model: nn.Module, keywords: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        if keywords:
            import inspect

            def forward(*args: Any, **kwargs: Any) -> Any:
                return _Plain._call(self, *args, **kwargs)

            P = inspect.Parameter
            forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [P("args", P.VAR_POSITIONAL)] + [P(k, P.KEYWORD_ONLY) for k in keywords])
            self.forward = forward  # type: ignore[method-assign]

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _plain_output(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    if type(out) in (tuple, list):
        return all(_plain_output(o) for o in out)
    if type(out) is dict:
        return all(isinstance(k, str) and _plain_output(v) for k, v in out.items())
    return out is None or isinstance(out, (int, float, bool))


def _example(example: Any) -> tuple[tuple, dict]:
    from ..calibration.data.inputs import Batch
    from ..structure.trace import ExampleInputs

    if isinstance(example, Batch):
        return tuple(example.args), dict(example.kwargs)
    ex = ExampleInputs.of(example)
    if ex is None:
        raise AuditError("there are no example inputs to export the model with",
                         "Give --calibration, or a factory that returns (model, example_inputs)")
    return tuple(ex.args), dict(ex.kwargs)


def _dynamic_spec(t: Any, seq: bool) -> Any:
    """The dynamic dimensions of one input: the batch (dim 0) of every tensor; with ``seq`` also the sequence (dim 1)
    of integer and bool tensors of two dimensions or more (token ids, attention masks). None for anything else."""
    from torch.export import Dim

    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    spec = {0: Dim.DYNAMIC}
    if seq and t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
        spec[1] = Dim.DYNAMIC
    return spec


def _shapes_for(model: nn.Module, args: tuple, kwargs: dict, seq: bool) -> dict[str, Any]:
    """``dynamic_shapes`` keyed by the forward's argument names, as torch.export wants them (``*args`` a tuple,
    the entries of ``**kwargs`` by their keywords)."""
    import inspect

    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    spec: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple(_dynamic_spec(v, seq) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:  # torch.export names **kwargs' entries by their own keys
            spec.update({k: _dynamic_spec(v, seq) for k, v in value.items()})
        else:
            spec[name] = _dynamic_spec(value, seq)
    return spec


def _has_sequence(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()
               for t in list(args) + list(kwargs.values()))


def _export_program(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, str, list[str]]:
    """torch.export with the batch (dim 0 of every tensor input) and the sequence (dim 1 of token ids and masks)
    dynamic where the model allows it, else the batch alone, else the example's static shapes; returns (program,
    what is dynamic: "batch+seq", "batch" or "", why each dynamic try failed). Traced on two rows (a one-row example
    given twice) and, for a sequence, on at most half its length (a length equal to a bound is specialized)."""
    import torch.fx.experimental._config as fx_config

    from ..progress import quiet_torch_logging

    dyn_args, dyn_kwargs = args, kwargs
    if _rows(args, kwargs) == 1:  # the factory's one example row: traced on two copies, so the batch can stay dynamic
        dyn_args, dyn_kwargs = _repeat_rows(args, kwargs)
    tries = (["batch+seq"] if _has_sequence(args, kwargs) else []) + ["batch", ""]
    errors: list[str] = []
    for what in tries:
        a, kw = dyn_args, dyn_kwargs
        if what == "batch+seq":
            a, kw = _at_length(a, kw, max(2, _length(a, kw) // 2))
        try:  # size-oblivious: a length is not specialized for equalling a buffer's size (a causal mask, positions)
            with quiet_torch_logging(), fx_config.patch(backed_size_oblivious=True):
                if what:
                    prog = torch.export.export(model, a, kw, dynamic_shapes=_shapes_for(model, a, kw, what != "batch"))
                else:
                    prog = torch.export.export(model, args, kwargs)
            _plain_samples(prog)
            return prog, what, errors
        except Exception as exc:  # noqa: BLE001 - a model torch.export cannot trace (dynamically)
            errors.append(f"{what or 'static'}: {first_line(exc)}")
    raise AuditError(f"torch.export could not export the factorized model: {errors[-1]}",
                     "Export the model by hand, or use model.safetensors with auditor.folder.load_factorized")


def _plain_samples(prog: Any) -> None:
    """The program's stored sample inputs as plain tensors: marking dimensions dynamic leaves attributes on the
    example tensors, which torch.save would pickle through ``_rebuild_from_type_v2``, a global the tool's loader
    refuses (:func:`check_archive`)."""
    from torch.utils._pytree import tree_map

    samples = prog.example_inputs
    if samples is not None:
        prog.example_inputs = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, samples)


def _length(args: tuple, kwargs: dict) -> int:
    """The sequence length (dim 1) of the first token-id tensor; 0 without one."""
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
            return int(t.shape[1])
    return 0


def _at_length(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """The inputs with their token ids and masks cut to ``n`` positions, or repeated up to ``n`` (the ids tiled, a
    mask of ones kept ones)."""
    def fit(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.is_floating_point() or x.is_complex():
            return x
        if n <= x.shape[1]:
            return x[:, :n]
        reps = [1] * x.dim()
        reps[1] = -(-n // int(x.shape[1]))
        return x.repeat(*reps)[:, :n]

    return tuple(fit(a) for a in args), {k: fit(v) for k, v in kwargs.items()}


def _int64_ids(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Integer inputs (token ids: the shipped uint8 windows, int32) as int64, the dtype a model casts ids to before
    its embedding, when the model gives the same outputs that way: the program then takes what a tokenizer returns."""
    def wide(x: Any) -> Any:
        integer = isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() \
            and x.dtype not in (torch.bool, torch.int64)
        return x.long() if integer else x

    new_args, new_kwargs = tuple(wide(a) for a in args), {k: wide(v) for k, v in kwargs.items()}
    if all(a is b for a, b in zip(new_args + tuple(new_kwargs.values()), args + tuple(kwargs.values()))):
        return args, kwargs
    try:
        with torch.no_grad():
            same = relative_error(model(*new_args, **new_kwargs), model(*args, **kwargs)) == 0
    except Exception:  # noqa: BLE001 - a model that refuses int64 ids keeps its own dtype
        same = False
    return (new_args, new_kwargs) if same else (args, kwargs)


def _with_mask(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An ``attention_mask`` of ones beside ``input_ids`` when the forward takes one and the example has none: the
    program then takes a tokenizer's output (``input_ids`` and ``attention_mask``, padding included)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return args, kwargs
    ids = kwargs.get("input_ids")
    if ids is None and len(args) == 1 and "input_ids" in params and list(params).index("input_ids") == 0:
        ids, args, kwargs = args[0], args[1:], {"input_ids": args[0], **kwargs}
    if "attention_mask" not in params or "attention_mask" in kwargs or not isinstance(ids, torch.Tensor) or args:
        return args, kwargs
    return args, {**kwargs, "attention_mask": torch.ones_like(ids, dtype=torch.int64)}


def export(model: nn.Module, example: Any, directory: str | Path, formats: tuple[str, ...] = ("pt2",)) -> dict[str, Any]:
    """Write ``model.pt2`` (and ``model.onnx`` with "onnx" in ``formats``) into ``directory`` and return the
    plan.json ``"export"`` entry; see the module docstring."""
    out = Path(directory)
    args, kwargs = _example(example)
    was_training = model.training
    model.eval()
    try:
        args, kwargs = _with_mask(model, *_int64_ids(model, args, kwargs))
        with torch.no_grad():
            ref = model(*args, **kwargs)
        wrapped = not _plain_output(ref)
        target = _Plain(model, tuple(kwargs)) if wrapped else model
        if wrapped:
            if not hasattr(ref, "items"):
                raise AuditError(f"the model returns a {type(ref).__name__}, which a program loaded with plain torch "
                                 "cannot rebuild", "Return tensors, tuples or dicts of tensors from forward")
            with torch.no_grad():
                ref = target(*args, **kwargs)
        prog, dynamic, why = _export_program(target, args, kwargs)
        _save_program(prog, out / PT2)
        checks = _checks(torch.export.load(str(out / PT2)).module(), target, args, kwargs, dynamic)
        worst = max(c["relative_error"] for c in checks if "relative_error" in c)
        if not worst <= TOLERANCE or "refused" in checks[0]:
            raise AuditError(f"the exported program's outputs differ from the factorized model's by {worst:.3g} "
                             f"relative (allowed {TOLERANCE:g})", "Report this model: the export is not faithful")
        entry: dict[str, Any] = {"pt2": {
            "file": PT2, "sha256": _sha256(out / PT2), "bytes": (out / PT2).stat().st_size,
            "torch": torch.__version__.split("+")[0], "inputs": _inputs(args, kwargs, dynamic),
            "outputs": [_describe(t, dynamic) for t in _leaves(ref)],
            "positional": [f"arg{i}" for i, a in enumerate(args)], "keywords": list(kwargs),
            "dynamic_batch": bool(dynamic), "dynamic_sequence": dynamic == "batch+seq",
            "static_because": why[-1] if why and not dynamic else None,
            "output_dict": wrapped, "prefix": "model." if wrapped else "", "checks": checks, "tolerance": TOLERANCE}}
        if "onnx" in formats:
            entry["onnx"] = _onnx(prog, args, kwargs, ref, out, bool(dynamic))
        return entry
    finally:
        model.train(was_training)


def _inputs(args: tuple, kwargs: dict, dynamic: str) -> list[dict[str, Any]]:
    named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [dict(name=n, **_describe(t, dynamic)) for n, t in named if isinstance(t, torch.Tensor)]


def _describe(t: torch.Tensor, dynamic: str | bool) -> dict[str, Any]:
    shape: list[Any] = list(t.shape)
    if dynamic and shape:
        shape[0] = "batch"
    if dynamic == "batch+seq" and len(shape) >= 2 and not t.is_floating_point() and not t.is_complex():
        shape[1] = "seq"
    return {"shape": shape, "dtype": str(t.dtype).replace("torch.", "")}


def _checks(loaded: nn.Module, target: nn.Module, args: tuple, kwargs: dict, dynamic: str) -> list[dict[str, Any]]:
    """The loaded program against the module: at the example, then (dynamic) at another batch size, then (a dynamic
    sequence) at 1, 2 and 16 positions, half and twice the example's length. Each entry: rows, length, and the
    relative error, or ``refused`` with the program's one line (a length past the model's positions)."""
    cases = [(args, kwargs)]
    if dynamic:
        cases.append(_other_rows(args, kwargs))
    n = _length(args, kwargs)
    if dynamic == "batch+seq" and n:
        cases += [_at_length(args, kwargs, k) for k in sorted({1, 2, 16, max(1, n // 2), 2 * n} - {n})]
    checks = []
    for a, kw in cases:
        c: dict[str, Any] = {"rows": _rows(a, kw)} | ({"length": _length(a, kw)} if n else {})
        with torch.no_grad():
            try:
                got = loaded(*a, **kw)
            except Exception as exc:  # noqa: BLE001 - a shape the program's guards refuse
                checks.append(c | {"refused": first_line(exc)[:200]})
                continue
            c["relative_error"] = relative_error(got, target(*a, **kw))
        checks.append(c)
    return checks


def _rows(args: tuple, kwargs: dict) -> int:
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def _repeat_rows(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example with its one row given twice (dim 0 of every tensor input)."""
    def two(x: Any) -> Any:
        return torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    return tuple(two(a) for a in args), {k: two(v) for k, v in kwargs.items()}


def _other_rows(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Inputs with another batch size than the example's, to check a dynamic batch: one row fewer (two at least),
    or two copies of a one-row example."""
    n = _rows(args, kwargs)
    return _repeat_rows(args, kwargs) if n == 1 else _first_rows(args, kwargs, max(2, n - 1))


def _first_rows(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    def cut(x: Any) -> Any:
        return x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _save_program(prog: Any, path: Path) -> None:
    """``torch.export.save`` into memory, then the bytes to ``path`` by Python: a full disk or a file-size limit is
    an ``OSError`` (one line), where torch's own zip writer threw a C++ error whose destructor aborted the process
    at exit (exit 134)."""
    import io

    buf = io.BytesIO()
    torch.export.save(prog, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def _onnx(prog: Any, args: tuple, kwargs: dict, ref: Any, out: Path, dynamic: bool) -> dict[str, Any]:
    """The ONNX file translated from the exported program itself (so the batch stays dynamic where the program's is),
    checked with onnxruntime on the example and, with a dynamic batch, on fewer rows."""
    check_onnx_available()
    from ..progress import quiet_torch_logging

    path = out / ONNX
    try:
        with quiet_torch_logging():
            torch.onnx.export(prog, args, str(path), kwargs=kwargs or None, dynamo=True, external_data=False,
                              verbose=False)
        import onnx

        onnx.checker.check_model(str(path))
    except OSError:  # the disk, not the exporter: the output folder says so in one line
        raise
    except Exception as exc:  # noqa: BLE001 - an op ONNX cannot express, or a failing exporter
        raise AuditError(f"the ONNX export failed: {first_line(exc)}", "Use --export pt2") from None
    entry: dict[str, Any] = {"file": ONNX, "sha256": _sha256(path), "bytes": path.stat().st_size,
                             "checked_with": None, "relative_error": None}
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime as ort

        stage = "loaded by onnxruntime"
        try:  # each step says what failed: an exporter or runtime error is not a full disk
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

            def outputs(a: tuple, kw: dict) -> list[torch.Tensor]:
                values = [v for v in list(a) + list(kw.values()) if isinstance(v, torch.Tensor)]
                feed = {i.name: v.detach().cpu().numpy() for i, v in zip(sess.get_inputs(), values)}
                return [torch.from_numpy(o) for o in sess.run(None, feed)]

            stage = "run by onnxruntime on the example"
            err = relative_error(outputs(args, kwargs), _leaves(ref))
            if dynamic:  # another batch size than the example's, against the program (the factorized model's outputs)
                sub_args, sub_kwargs = _other_rows(args, kwargs)
                stage = f"run by onnxruntime on {_rows(sub_args, sub_kwargs)} rows"
                with torch.no_grad():
                    want = _leaves(prog.module()(*sub_args, **sub_kwargs))
                err = max(err, relative_error(outputs(sub_args, sub_kwargs), want))
        except Exception as exc:  # noqa: BLE001 - an op onnxruntime lacks, a shape it refuses
            raise AuditError(f"the ONNX file was written but could not be {stage}: {first_line(exc)}",
                             "Use --export pt2 (the program loads with plain torch)") from None
        if not err <= ONNX_TOLERANCE:
            raise AuditError(f"the ONNX file's outputs (onnxruntime) differ from the factorized model's by {err:.3g} "
                             f"relative (allowed {ONNX_TOLERANCE:g})", "Use --export pt2")
        entry.update(checked_with=f"onnxruntime {ort.__version__}", relative_error=err)
    return entry


def _number(value: Any) -> str:
    """A measured value as the README prints it; null in plan.json is a number that was not finite."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else "not finite"


def _literal(spec: dict[str, Any]) -> str:
    """A torch expression that builds an input of this shape and dtype (a dynamic batch of 2, 16 positions)."""
    shape = ", ".join({"batch": "2", "seq": "16"}.get(str(s), str(s)) for s in spec["shape"])
    dtype = spec["dtype"]
    if dtype.startswith(("float", "bfloat", "complex")):
        return f"torch.randn({shape}, dtype=torch.{dtype})" if shape else f"torch.tensor(0.0, dtype=torch.{dtype})"
    if dtype == "bool" or spec["name"] == "attention_mask":
        return f"torch.ones({shape}, dtype=torch.{dtype})"
    return f"torch.zeros({shape}, dtype=torch.{dtype})"


def _call(e: dict[str, Any]) -> str:
    """The arguments of the README's example call: the recorded inputs, positional then keywords."""
    by_name = {i["name"]: i for i in e["inputs"]}
    pos = [_literal(by_name[n]) for n in e["positional"] if n in by_name]
    kw = [f"{k}={_literal(by_name[k])}" for k in e["keywords"] if k in by_name]
    return ", ".join(pos + kw)


def _counts(values: list[int]) -> str:
    return ", ".join(map(str, sorted(set(values)))) or "none"


def _batch_words(e: dict[str, Any]) -> str:
    """What the program accepts, from its checks: the dynamic dimensions, the sizes it ran at, the ones it refused;
    a static program says so, and why torch.export could not make it dynamic."""
    checks = e.get("checks", [])
    if not e["dynamic_batch"]:
        why = f" (torch.export could not make them dynamic: {e['static_because']})" if e.get("static_because") else ""
        return f"the shapes are fixed to the example's{why}: pass exactly those shapes"
    ran = [c for c in checks if "refused" not in c]
    text = ("the batch (`batch`) is dynamic, checked at " + _counts([c["rows"] for c in ran]) + " rows")
    if e.get("dynamic_sequence"):
        refused = [c["length"] for c in checks if "refused" in c]
        text += ("; the sequence (`seq`) is dynamic, checked at " + _counts([c["length"] for c in ran])
                 + " positions" + (f" and refused at {_counts(refused)} (the program's guards refuse them)" if refused else ""))
    elif any(i["dtype"].startswith(("int", "uint")) and len(i["shape"]) >= 2 for i in e["inputs"]):
        text += "; the sequence length is fixed to the example's (torch.export could not make it dynamic)"
    ids = [i["name"] for i in e["inputs"] if i["dtype"] == "int64"]
    if ids:
        text += (f". Token ids are int64 (what a tokenizer returns); cast other integer ids first, e.g. "
                 f"`ids.long()`: the program checks dtypes")
    return text


def _removed(meta: dict[str, Any]) -> str:
    if not meta.get("params_before"):
        return ""
    return (f" ({meta['params_before']:,} -> {meta['params']:,} parameters, "
            f"{100 * (1 - meta['params'] / meta['params_before']):.1f}% removed)")


def _recovery_line(meta: dict[str, Any]) -> str:
    rec = meta.get("recovery")
    if not (isinstance(rec, dict) and rec.get("after")):
        return ""
    return (f"\nRecovery: {rec['done']} distillation steps ({rec['objective']}, {rec['trainable']}), the state "
            f"after step {rec['kept_step']} kept: held-out {rec['metric']} {_number(rec['before']['metric'])} -> "
            f"{_number(rec['after']['metric'])}.\n")


def _onnx_section(meta: dict[str, Any]) -> str:
    if "onnx" not in meta["export"]:
        return ""
    o = meta["export"]["onnx"]
    checked = f", checked with {o['checked_with']}" if o.get("checked_with") else ""
    return (f"\n`{ONNX}` holds the same graph for ONNX runtimes{checked}:\n\n```python\nimport onnxruntime\n"
            f"session = onnxruntime.InferenceSession(\"{ONNX}\")\n"
            "outputs = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})\n"
            "```\n")


def _fit_words(meta: dict[str, Any]) -> str:
    """" (sequential fit)", " (sequential fit, closed form)" where the block refinement was off, or nothing."""
    if not meta.get("fit"):
        return ""
    return f" ({meta['fit']} fit{', closed form' if meta.get('block_refinement') is False else ''})"


def _refit_line(meta: dict[str, Any]) -> str:
    """The README's line on the dense layers the sequential fit refitted (``--refit-dense``), or nothing."""
    refit = meta.get("refit_dense")
    if not refit:
        return ""
    return (f"{len(refit)} weight(s) the plan keeps dense were refitted (`--refit-dense`) on the inputs the factorized "
            f"layers give them: their shapes are the original's, their values are not (plan.json lists them).\n")


def readme(directory: str | Path, meta: dict[str, Any]) -> Path:
    """Write README.md: what the files are and how to load them with plain torch."""
    e = meta["export"]["pt2"]
    plan = meta.get("plan", {})
    call, batch, removed, rec, rec_line, onnx_line = (
        _call(e), _batch_words(e), _removed(meta), meta.get("recovery"), _recovery_line(meta), _onnx_section(meta))
    shapes = "; ".join(f"{i['name']}: {i['dtype']}[{', '.join(map(str, i['shape']))}]" for i in e["inputs"])
    out_kind = "a dict of tensors" if e["output_dict"] else "what the model's forward returns (tensors)"
    text = f"""# A factorized model

`{meta.get('source') or 'the model'}` with {len(plan)} layer(s) replaced by two low-rank factors{removed},
{meta.get('init', 'svd')}{_fit_words(meta)} initialisation. Made by lowrank-auditor; loading it needs only torch
({e['torch']} wrote it; `torch.export` programs load in that version or later).
{_refit_line(meta)}{rec_line}
## Load it with plain torch

```python
import torch

program = torch.export.load("{PT2}")   # a torch.export.ExportedProgram
model = program.module()                # an nn.Module taking the inputs below
with torch.no_grad():
    outputs = model({call})
```

Inputs: {shapes} ({batch}). Outputs: {out_kind}. The program reproduces the factorized model's outputs to
{e['tolerance']:g} relative (checked when it was written).

To check the file is the one written: `hashlib.sha256(open("{PT2}", "rb").read()).hexdigest()` must be
`{e['sha256']}`; lowrank-auditor's loader does this check and more:
`auditor.export.load_program(DIR)`.
{onnx_line}
## The other files

- `plan.json`: the plan (layer -> rank), parameter counts, the measured metric{' and the recovery' if rec else ''}.
- `model.safetensors`: the same weights, keyed like the factorized module (`layer.0.weight` is the r x n factor,
  `layer.1.weight` the m x r one); rebuilding that module needs the original model and the tool:
  `auditor.folder.load_factorized(original_model, DIR)`.
"""
    path = Path(directory) / README
    path.write_text(text)
    return path


# --- the tool's loader --------------------------------------------------------------------------------------------

MAX_SAMPLE_BYTES = 64 << 20  # the sample inputs' torch.save archive a program carries (read to scan it)
_MEMBERS = ("archive_format", "archive_version", ".data/version", ".data/serialization_id", "byteorder")
_SAFE_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
                 ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict"), ("torch", "Size"),
                 ("torch", "device")}


def _safe_global(module: str, name: str) -> bool:
    if (module, name) in _SAFE_GLOBALS:
        return True
    if module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)):
        return True  # typed storages (torch.FloatStorage) and dtypes (torch.float32)
    return False


def _scan_pickle(data: bytes, where: str) -> None:
    """A static scan of a pickle's opcodes (nothing is unpickled): every global it would import must be a tensor
    rebuild function, a storage type, a dtype or OrderedDict; STACK_GLOBAL, INST and OBJ (names computed at load
    time) are refused, as torch.save never writes them for tensors."""
    import pickletools

    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                module, _sp, name = str(arg).partition(" ")
                if not _safe_global(module, name):
                    raise AuditError(f"{where} imports {module}.{name} when unpickled: code a program does not need",
                                     "Do not load it; export the model again from a trusted copy")
            elif op.name in ("STACK_GLOBAL", "INST", "OBJ"):
                raise AuditError(f"{where} computes what it imports when unpickled ({op.name})",
                                 "Do not load it; export the model again from a trusted copy")
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or malformed pickle
        raise AuditError(f"{where} is not a readable pickle: {first_line(exc)}", "Export the model again") from None


def _refuse(p: Path, member: str, why: str) -> AuditError:
    return AuditError(f"{p} holds {member} {why}; refusing to load it (a pickle there would run code)",
                      "Do not load it; export the model again from a trusted copy")


def _duplicate(names: list[str]) -> str | None:
    """A name the archive holds twice, or two names that differ only in case (torch's zip reader looks names up
    without regard to case, and which of two entries it reads is not the one a check of the other saw)."""
    seen: set[str] = set()
    for n in names:
        k = n.casefold()
        if k in seen:
            return n
        seen.add(k)
    return None


_DIRS = ("", "models/", "data/", "data/weights/", "data/constants/", "data/sample_inputs/", ".data/")
_PAYLOAD = re.compile(r"(weight|tensor)_[0-9]+")  # the names torch.export.save gives a weight or constant file


def _members(p: Path, names: list[str]) -> tuple[str, list[str], list[str], list[str]]:
    """The archive's one top-level folder, its payload configs, its sample-input archives and its payload files
    (weights and constants, each to be named by a config); any member ``torch.export.save`` does not write for a
    plain program, under exactly the name it writes (case included), and any name held twice is refused."""
    dup = _duplicate(names)
    if dup is not None:
        raise _refuse(p, dup, "twice (two entries of one name, or of names that differ only in case)")
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1:
        raise AuditError(f"{p} holds {len(roots)} top-level folders, not one program archive", "Export the model again")
    root = next(iter(roots)) + "/"
    rels = [n[len(root):] for n in names]
    models = [r[len("models/"):-len(".json")] for r in rels if r.startswith("models/") and r.endswith(".json")]
    configs = {f"data/weights/{m}_weights_config.json" for m in models} | {
        f"data/constants/{m}_constants_config.json" for m in models}
    samples = {f"data/sample_inputs/{m}.pt" for m in models}
    known = {*_MEMBERS, *(f"models/{m}.json" for m in models), *_DIRS}
    payload: list[str] = []
    for rel in rels:
        if rel in known or rel in configs or rel in samples:
            continue
        folder, _, file = rel.rpartition("/")
        if folder in ("data/weights", "data/constants") and _PAYLOAD.fullmatch(file):
            payload.append(rel)
            continue
        if rel.startswith(("data/weights/", "data/constants/")) and rel.lower().endswith((".pt", ".pkl", ".pickle")):
            raise _refuse(p, rel, "(a pickled weight or constant file)")
        raise _refuse(p, rel, "(a member torch.export.save does not write for a plain program)")
    present = set(rels)
    return (root, [root + c for c in sorted(configs) if c in present], [root + c for c in sorted(samples) if c in
                                                                       present], payload)


def _check_config(zf: Any, p: Path, rel: str, member: str) -> set[str]:
    """A payload config stores every weight and constant as a plain tensor file, none as a pickle or an object:
    the files it names (``weight_N``, ``tensor_N``, exactly so)."""
    import zipfile

    try:
        cfg = json.loads(zf.read(member).decode("utf-8"), parse_constant=lambda c: None,
                         object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError, OSError, zipfile.BadZipFile) as exc:
        raise _refuse(p, rel, f"(unreadable: {first_line(exc)})") from None
    entries = cfg.get("config") if isinstance(cfg, dict) else None
    if not isinstance(entries, dict):
        raise _refuse(p, rel, "(not a payload config)")
    named: set[str] = set()
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise _refuse(p, rel, "(not a payload config)")
        name = meta.get("path_name")
        if meta.get("use_pickle") is not False or not isinstance(name, str) or not _PAYLOAD.fullmatch(name):
            raise _refuse(p, rel, f"with {str(fqn)[:80]!r} stored as a pickle or an object")
        named.add(name)
    return named


def _check_samples(zf: Any, p: Path, rel: str, member: str) -> None:
    """The sample inputs (a torch.save archive inside the archive): no name twice, and every pickle in it (a
    ``.pkl`` member, whatever the case) imports only what tensors need (:func:`_scan_pickle`), within the size
    limits."""
    import io
    import zipfile

    info = zf.getinfo(member)
    if info.file_size > MAX_SAMPLE_BYTES:
        raise _refuse(p, rel, f"of {info.file_size:,} bytes (sample inputs)")
    try:
        inner = zipfile.ZipFile(io.BytesIO(zf.read(member)))
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise _refuse(p, rel, f"(not a torch.save archive: {first_line(exc)})") from None
    with inner:
        dup = _duplicate(inner.namelist())
        if dup is not None:
            raise _refuse(p, f"{rel}:{dup}", "twice (two entries of one name, or of names that differ only in case)")
        for m in inner.infolist():
            if m.filename.lower().endswith((".pkl", ".pickle")):
                if m.file_size > MAX_SAMPLE_BYTES:
                    raise _refuse(p, f"{rel}:{m.filename}", "(an oversized pickle)")
                _scan_pickle(inner.read(m), f"{p} member {rel}:{m.filename}")


def check_archive(path: str | Path) -> None:
    """Refuse a ``.pt2`` archive that would run pickled code when torch loads it, before anything in it is
    deserialized and whatever checksums stand beside it: only the members ``torch.export.save`` writes for a plain
    program may be present (no AOTInductor code, no extra files); no weight or constant is stored as a pickle, a
    custom or opaque object; and the sample inputs (the one pickle torch writes, and loads with ``weights_only=False``
    when the restricted load fails) import nothing but tensor rebuilders, storages and dtypes."""
    import zipfile

    p = Path(path)
    try:
        zf = zipfile.ZipFile(p)
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        raise AuditError(f"{p} is not a torch.export archive (a zip file): {first_line(exc)}",
                         "Export the model again") from None
    with zf:
        root, configs, samples, payload = _members(p, zf.namelist())
        named: dict[str, set[str]] = {}
        for n in configs:
            rel = n[len(root):]
            named.setdefault(rel.rsplit("/", 1)[0], set()).update(_check_config(zf, p, rel, n))
        for rel in payload:
            folder, _, file = rel.rpartition("/")
            if file not in named.get(folder, set()):
                raise _refuse(p, rel, "(a weight or constant file no payload config names)")
        for n in samples:
            _check_samples(zf, p, n[len(root):], n)


def _read_meta(directory: Path) -> dict[str, Any]:
    path = directory / "plan.json"
    if path.is_symlink() or not path.is_file():
        raise AuditError(f"{path} is not a regular file", "Point to a directory written by lowrank-audit factorize "
                                                          "--export pt2")
    if path.stat().st_size > MAX_PLAN_BYTES:
        raise AuditError(f"{path} is {path.stat().st_size:,} bytes, too large for a plan", "Rewrite it with the tool")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        meta = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicate_keys,
                          parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AuditError(f"{path} is not valid UTF-8 JSON: {first_line(exc)}", "Rewrite it with the tool") from None
    from .folder import FORMAT

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AuditError(f"{path} is not a factorized-model plan", "Point to a directory written by lowrank-audit "
                                                                   "factorize")
    plan = meta.get("plan")
    if not isinstance(plan, dict) or not plan or not all(
            isinstance(k, str) and type(v) is int and v >= 1 for k, v in plan.items()):
        raise AuditError(f"{path} holds no valid plan (layer name -> positive integer rank)", "Rewrite it with the tool")
    ex = meta.get("export")
    e = ex.get("pt2") if isinstance(ex, dict) else None
    if not isinstance(e, dict):
        raise AuditError(f"{path} records no exported program", "Write one with lowrank-audit factorize --export pt2")
    sha, size = e.get("sha256"), e.get("bytes")
    if (e.get("file") != PT2 or not isinstance(sha, str) or len(sha) != 64
            or any(c not in "0123456789abcdef" for c in sha) or type(size) is not int or size < 0
            or not isinstance(e.get("prefix", ""), str) or type(meta.get("params")) is not int):
        raise AuditError(f"{path} has a malformed export entry", "Rewrite it with the tool")
    return meta


def load_program(directory: str | Path) -> Any:
    """The exported program in ``directory``, after checking it against plan.json (see the module docstring)."""
    d = Path(directory)
    path = d / PT2
    if path.is_symlink() or not path.is_file():
        raise AuditError(f"{path} is not a regular file", "Export the model again")
    meta = _read_meta(d)
    e = meta["export"]["pt2"]
    if path.stat().st_size != e["bytes"] or _sha256(path) != e["sha256"]:
        raise AuditError(f"{path} does not match the size and sha256 plan.json records: it was changed or damaged "
                         "after it was written", "Export the model again")
    check_archive(path)  # whatever plan.json says (a forger updates both): no pickle runs, before torch reads it
    try:
        prog = torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged archive
        raise AuditError(f"cannot load {path}: {first_line(exc)}", "Export the model again") from None
    state = prog.state_dict
    prefix = e.get("prefix", "")
    for layer, r in meta["plan"].items():
        second = state.get(f"{prefix}{layer}.1.weight")
        first = state.get(f"{prefix}{layer}.0.weight")
        if first is None or second is None or second.dim() < 2:
            raise AuditError(f"plan.json names {layer!r}, which the program has no factors for",
                             "plan.json and model.pt2 come from different exports: export again")
        if int(second.shape[1]) != r:
            raise AuditError(f"plan.json gives {layer} rank {r}; the program's factors have rank {int(second.shape[1])}",
                             "plan.json and model.pt2 come from different exports: export again")
    seen: set[tuple[int, tuple[int, ...]]] = set()
    params = 0
    for n in prog.graph_signature.parameters:  # tied tensors once, as the tool counts them
        t = state.get(n)
        if t is not None and (t.data_ptr(), tuple(t.shape)) not in seen:
            seen.add((t.data_ptr(), tuple(t.shape)))
            params += int(t.numel())
    if params != meta["params"]:
        raise AuditError(f"plan.json records {meta['params']:,} parameters; the program holds {params:,}",
                         "plan.json and model.pt2 come from different exports: export again")
    return prog


# --- the command line (lowrank-audit factorize ... --export pt2) -----------------------------------------------

def add_cli_arguments(p: Any) -> None:
    p.add_argument("--export", metavar="pt2|onnx", help="also write a torch.export program (model.pt2; onnx adds "
                                                       "model.onnx) and a README saying how to load it with torch")


def cli_formats(args: Any) -> tuple[str, ...]:
    """The formats --export asks for, checked before any work (onnx without its packages is refused here)."""
    return parse_formats(args.export) if getattr(args, "export", None) is not None else ()


def cli_write(directory: str | Path, model: nn.Module, calibration: Any, example_inputs: Any,
              formats: tuple[str, ...]) -> list[str]:
    """Export ``model`` into ``directory`` (written by save_factorized), add the entry to its plan.json and write
    the README; the example inputs are the first calibration batch, else the factory's. Returns the files added."""
    if not formats:
        return []
    d = Path(directory)
    # the model's own example inputs: the program is called as the model is (its signature, its dtypes), not as the
    # calibration file stores its rows (a keyword, uint8 ids); a calibration batch only when there are none
    from ..structure.trace import ExampleInputs

    own = ExampleInputs.of(example_inputs) if example_inputs is not None else None
    example = example_inputs if own is not None else (calibration.fit[0] if calibration is not None and
                                                      calibration.fit else example_inputs)
    entry = export(model, example, d, formats)
    path = d / "plan.json"
    meta = json.loads(path.read_text())
    meta["export"] = entry
    path.write_text(strict_json(meta, indent=2, sort_keys=True) + "\n")
    readme(d, meta)
    print(f"{PT2}: {_batch_words(entry['pt2']).split('. Token ids')[0]}", file=sys.stderr)  # a static fallback is said
    return [PT2] + ([ONNX] if "onnx" in entry else []) + [README]
