"""The digest of a model's weights: what the calibration caches are keyed by and what a cluster worker checks its
own copy of the model against (one module that both the stage and the cluster read)."""

from __future__ import annotations

import torch
from torch import nn


def weights_hash(model: nn.Module) -> str:
    """BLAKE3 of every parameter's and buffer's name, shape, dtype and bytes.

    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> _ = b.load_state_dict(a.state_dict())
    >>> weights_hash(a) == weights_hash(b), len(weights_hash(a))
    (True, 64)
    """
    from blake3 import blake3

    h = blake3()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        c = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(c.shape)}:{c.dtype};".encode())
        if c.numel():
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_SIMPLE = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 6  # functions reached from a forward through globals, followed this deep


HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by Python code (``class`` or ``type(...)``), not by C


def _external(obj: object) -> bool:
    """torch's own code (pinned by its version in the key) and builtins are not walked. A class that only says it
    is of ``builtins`` is walked: one defined by code run with ``exec`` in a namespace without ``__name__`` (a
    factory's source) is named so, and its forward is the model's code."""
    mod = getattr(obj, "__module__", None) or ""
    if mod == "builtins":
        return not (isinstance(obj, type) and obj.__flags__ & HEAP_TYPE)
    return mod.split(".")[0] in ("torch", "numpy", "typing", "functools", "collections")


def _const_repr(c: object) -> str:
    """A code constant in words that do not depend on the process (a frozenset's order follows the hash seed)."""
    if isinstance(c, (frozenset, set)):
        return "{" + ",".join(sorted(_const_repr(x) for x in c)) + "}"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_repr(x) for x in c) + ")"
    return repr(c)


class _CodeHasher:
    """The code a model runs, as bytes: every module class's methods (their bytecode, constants and names, not line
    numbers), the functions and classes those reach through their globals, and every module's own non-tensor
    attributes (hyperparameters, a config, an activation function held in an attribute)."""

    def __init__(self) -> None:
        import hashlib

        self.h = hashlib.sha256()
        self.seen: set[int] = set()

    def code(self, co: object, depth: int) -> None:
        import types

        if not isinstance(co, types.CodeType):
            return
        self.h.update(f"code:{co.co_qualname if hasattr(co, 'co_qualname') else co.co_name};".encode())
        self.h.update(co.co_code)
        self.h.update(repr((co.co_names, co.co_varnames, co.co_freevars, co.co_argcount,
                            co.co_kwonlyargcount)).encode())
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c, depth)
            else:
                self.h.update(_const_repr(c).encode())

    def _names(self, co: object) -> list[str]:
        import types

        if not isinstance(co, types.CodeType):
            return []
        out = list(co.co_names)
        for c in co.co_consts:
            out += self._names(c)
        return out

    def function(self, fn: object, depth: int = 0) -> None:
        import inspect

        fn = inspect.unwrap(fn) if callable(fn) else fn  # type: ignore[arg-type]
        fn = getattr(fn, "__func__", fn)
        co = getattr(fn, "__code__", None)
        if co is None or id(co) in self.seen or _external(fn):
            return
        self.seen.add(id(co))
        self.code(co, depth)
        for d in (getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)):
            if d:
                self.value(d, depth + 1)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                self.value(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        if depth >= _MAX_DEPTH:
            return
        g = getattr(fn, "__globals__", {})
        for name in dict.fromkeys(self._names(co)):
            if name in g:
                v = g[name]
                if isinstance(v, _SIMPLE) or callable(v):
                    self.h.update(f"global:{name};".encode())
                    self.value(v, depth + 1)

    def cls(self, c: type, depth: int = 0) -> None:
        if id(c) in self.seen or _external(c):
            return
        self.seen.add(id(c))
        self.h.update(f"class:{c.__qualname__};".encode())  # not the module: a factory file's is named at random
        for k in c.__mro__:
            if _external(k) or k is object:
                continue
            for name, v in sorted(vars(k).items()):
                if isinstance(v, property):
                    for f in (v.fget, v.fset):
                        if f is not None:
                            self.function(f, depth)
                elif isinstance(v, (staticmethod, classmethod)) or callable(v):
                    self.function(v, depth)
                elif isinstance(v, _SIMPLE) and not name.startswith("__"):
                    self.h.update(f"{name}={v!r};".encode())

    def value(self, v: object, depth: int = 0) -> None:
        import types

        if isinstance(v, _SIMPLE):
            self.h.update(f"{type(v).__name__}:{v!r};".encode())
        elif isinstance(v, (torch.dtype, torch.device)):
            self.h.update(f"{v};".encode())
        elif isinstance(v, torch.Tensor):  # a plain tensor attribute (not a parameter or buffer): its bytes
            c = v.detach().contiguous().cpu()
            self.h.update(f"tensor:{tuple(c.shape)}:{c.dtype};".encode())
            if c.numel():
                self.h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, (list, tuple, set, frozenset)) and depth < _MAX_DEPTH:
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            self.h.update(f"{type(v).__name__}[{len(items)}];".encode())
            for x in items:
                self.value(x, depth + 1)
        elif isinstance(v, dict) and depth < _MAX_DEPTH:
            self.h.update(f"dict[{len(v)}];".encode())
            for k in sorted(v, key=repr):
                self.h.update(f"{k!r}:".encode())
                self.value(v[k], depth + 1)
        elif isinstance(v, nn.Module):
            self.h.update(f"module:{type(v).__qualname__};".encode())  # its own state is hashed as a module
        elif isinstance(v, type):
            self.cls(v, depth)
        elif isinstance(v, (types.FunctionType, types.MethodType, staticmethod, classmethod)):
            self.function(v, depth)
        elif callable(getattr(v, "to_dict", None)) and depth < _MAX_DEPTH:  # a transformers config
            try:
                d = v.to_dict()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - an object whose to_dict fails is named by its type
                d = None
            self.h.update(f"obj:{type(v).__qualname__};".encode())
            if isinstance(d, dict):
                self.value(d, depth + 1)
        else:
            self.h.update(f"obj:{type(v).__qualname__};".encode())
            if not _external(type(v)):
                self.cls(type(v), depth)
                state = getattr(v, "__dict__", None)
                if isinstance(state, dict) and depth < _MAX_DEPTH:
                    self.value({k: x for k, x in state.items() if not callable(x) or isinstance(x, type)},
                               depth + 1)


_MODULE_STATE = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def code_hash(model: nn.Module) -> str:
    """SHA-256 of the code ``model`` runs and the state its forward reads besides its weights: every submodule's
    class (methods' bytecode and constants, the functions and classes they reach through their globals, to a depth
    of six), its own attributes (hyperparameters, a config, a function held in an attribute) and its forward hooks;
    plus torch's version (torch's own code is not walked). Editing a forward, a helper it calls, a constant or a
    hyperparameter changes it; line numbers and comments do not.

    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> code_hash(a) == code_hash(b), code_hash(a) == code_hash(torch.nn.Sequential(a, torch.nn.ReLU()))
    (True, False)
    """
    c = _CodeHasher()
    c.h.update(f"torch:{torch.__version__};".encode())
    for name, mod in model.named_modules():
        c.h.update(f"module:{name}:{type(mod).__qualname__};".encode())
        c.cls(type(mod))
        for k, v in sorted(vars(mod).items()):
            if k in _MODULE_STATE:
                continue
            if k.endswith("hooks") and isinstance(v, dict):  # hooks change what runs: their code is hashed
                c.h.update(f"{k}[{len(v)}];".encode())
                for hook in v.values():
                    c.value(hook, 1)
                continue
            if k.startswith("_"):
                continue
            c.h.update(f"attr:{k};".encode())
            c.value(v, 1)
    return c.h.hexdigest()
