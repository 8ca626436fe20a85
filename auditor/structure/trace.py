"""Trace a model into an fx graph: torch.fx.symbolic_trace, then torch.export, then a module walk.

The result records which method was used and why each earlier one failed, so the report can say it in one line.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..results import TraceMethod

from ..errors import AuditError, first_line


# How the model was read: the results module owns the enum (plain data, no torch); the old name stays.
Method = TraceMethod



@dataclass
class ExampleInputs:
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @classmethod
    def of(cls, value: Any) -> "ExampleInputs | None":
        """Accepts None, a tensor, a tuple/list of positional inputs, a dict of keyword inputs, or (args, kwargs)."""
        if value is None or isinstance(value, ExampleInputs):
            return value
        if isinstance(value, torch.Tensor):
            args, kwargs = (value,), {}
        elif isinstance(value, dict):
            args, kwargs = (), dict(value)
        elif isinstance(value, (tuple, list)):
            if len(value) == 2 and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict):
                args, kwargs = tuple(value[0]), dict(value[1])
            else:
                args, kwargs = tuple(value), {}
        else:
            raise AuditError(
                f"example inputs of type {type(value).__name__} are not supported",
                "Give a tensor, a tuple of tensors, a dict of keyword tensors, or (args, kwargs)",
            )
        return cls(args, kwargs, describe(args, kwargs))


def describe(args: tuple, kwargs: dict) -> str:
    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}[{', '.join(str(s) for s in x.shape)}]"
        return type(x).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


@dataclass
class TraceResult:
    method: Method
    graph: torch.fx.Graph | None = None
    placeholder_params: dict[str, str] = field(default_factory=dict)  # export: placeholder name -> parameter FQN
    placeholder_buffers: dict[str, str] = field(default_factory=dict)  # export: placeholder name -> buffer FQN
    failures: list[str] = field(default_factory=list)  # "method: reason" for each method that failed first
    has_shapes: bool = False
    module_calls: list[tuple[str, list, Any]] = field(default_factory=list)  # walk: (path, in shapes, out shape)


def _positional(model: nn.Module, gm: torch.fx.GraphModule, ex: ExampleInputs) -> list[Any]:
    """Inputs in the order of the traced graph's placeholders (the forward's parameters)."""
    if not ex.kwargs:
        return list(ex.args)
    sig = inspect.signature(model.forward)
    bound = sig.bind_partial(*ex.args, **ex.kwargs)
    bound.apply_defaults()
    values = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values.append(bound.arguments.get(node.target.lstrip("*")))
    return values


def _run_plain(model: nn.Module, ex: ExampleInputs) -> None:
    """Run the model once on its example inputs; a failure here is the user's input, not the tracer."""
    try:
        with torch.no_grad():
            model(*ex.args, **ex.kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's model on the user's inputs
        raise AuditError(
            f"the example inputs ({ex.description}) do not fit the model: {first_line(exc)}",
            "Pass inputs the model accepts, e.g. --input-shape matching its first layer, or return example inputs "
            "from the factory",
        ) from None


TRACERS = ("auto", "symbolic", "export", "walk")


class _Tracer(torch.fx.Tracer):
    """symbolic_trace's tracer, with module types registered by users (``register_layer_spec``) kept as leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        from ..kinds.registry import is_user_leaf

        return is_user_leaf(m) or super().is_leaf_module(m, module_qualified_name)


def _symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def trace(model: nn.Module, ex: ExampleInputs | None, tracer: str = "auto") -> TraceResult:
    """``tracer="auto"`` tries symbolic_trace, then torch.export, then the module walk; a named tracer starts
    there (and still falls back to the walk if it fails)."""
    if tracer not in TRACERS:
        raise AuditError(f"unknown tracer {tracer!r}", f"Choose from {', '.join(TRACERS)}")
    failures: list[str] = []
    if tracer == "walk":
        return walk(model, ex, ["module walk chosen with --tracer walk"])
    if tracer in ("auto", "symbolic"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = _symbolic_trace(model)
        except Exception as exc:  # noqa: BLE001 - any tracer failure moves on to the next method
            failures.append(f"{Method.SYMBOLIC} failed: {first_line(exc)}")
        else:
            if ex is None:
                return TraceResult(Method.SYMBOLIC, gm.graph, failures=failures)
            try:
                from torch.fx.passes.shape_prop import ShapeProp

                with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints tracebacks
                    ShapeProp(gm).propagate(*_positional(model, gm, ex))
                return TraceResult(Method.SYMBOLIC, gm.graph, failures=failures, has_shapes=True)
            except Exception as exc:  # noqa: BLE001
                _run_plain(model, ex)
                failures.append(f"{Method.SYMBOLIC} shape propagation failed: {first_line(exc)}")
    else:
        failures.append(f"{Method.SYMBOLIC} not tried: --tracer {tracer}")

    if ex is not None and tracer != "symbolic":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, tuple(ex.args), kwargs=dict(ex.kwargs), strict=False)
            return TraceResult(
                Method.EXPORT,
                ep.graph,
                placeholder_params=dict(ep.graph_signature.inputs_to_parameters),
                placeholder_buffers=dict(ep.graph_signature.inputs_to_buffers),
                failures=failures,
                has_shapes=True,
            )
        except Exception as exc:  # noqa: BLE001
            _run_plain(model, ex)
            failures.append(f"{Method.EXPORT} failed: {first_line(exc)}")
    elif ex is None:
        failures.append(f"{Method.EXPORT} not tried: no example inputs")

    return walk(model, ex, failures)


def walk(model: nn.Module, ex: ExampleInputs | None, failures: list[str]) -> TraceResult:
    """The last resort: modules in registration order; with inputs, one forward with hooks records call shapes."""
    result = TraceResult(Method.WALK, failures=failures)
    if ex is None:
        return result
    names = {m: n for n, m in model.named_modules()}
    calls: list[tuple[str, list, Any]] = []

    def shape(x: Any) -> Any:
        return tuple(x.shape) if isinstance(x, torch.Tensor) else None

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        ins = [shape(a) for a in args] + [shape(v) for v in kwargs.values()]
        o = out[0] if isinstance(out, (tuple, list)) and out else out
        calls.append((names[mod], ins, shape(o)))

    handles = [
        m.register_forward_hook(hook, with_kwargs=True)
        for m in model.modules()
        if not list(m.children()) or any(True for _ in m.parameters(recurse=False))
    ]
    try:
        _run_plain(model, ex)
    finally:
        for h in handles:
            h.remove()
    result.module_calls = calls
    result.has_shapes = True
    return result
