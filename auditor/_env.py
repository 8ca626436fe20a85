"""The process environment the tool sets up for the libraries it drives, before they are imported."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar


def cache_root() -> Path:
    """The tool's cache folder: ``$LOWRANK_AUDITOR_CACHE`` if set, else ``$XDG_CACHE_HOME/lowrank-auditor``
    (``~/.cache/lowrank-auditor``)."""
    env = os.environ.get("LOWRANK_AUDITOR_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowrank-auditor"


def configure_matplotlib() -> str | None:
    """Give matplotlib a config and font-cache folder of the tool's own (``MPLCONFIGDIR``), so that rendering
    writes nothing to ``~/.config/matplotlib`` or ``~/.cache/matplotlib``. A value the user set is kept.

    Call it before the first ``import matplotlib``; after that matplotlib has chosen its folder and this returns
    None. Otherwise returns the folder in use: ``<cache_root()>/matplotlib``, or a fresh temporary folder where
    that cannot be written.
    """
    if os.environ.get("MPLCONFIGDIR"):
        return os.environ["MPLCONFIGDIR"]
    if "matplotlib" in sys.modules:
        return None
    folder = cache_root() / "matplotlib"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
            raise PermissionError(str(folder))
        chosen = str(folder)
    except OSError:
        chosen = tempfile.mkdtemp(prefix="lowrank-auditor-matplotlib-")
    os.environ["MPLCONFIGDIR"] = chosen
    return chosen


# ---- the host process: what a library call may change, and what only the command line may ----------------------

_OWNS_PROCESS = False


def own_process() -> None:
    """Called by the command line (``lowrank-audit``), whose process is the tool's own: process-wide tuning (glibc's
    mmap threshold, :func:`auditor.calibration.session.map_large_arrays`) is then allowed. A library call
    (``auditor.audit`` in a notebook) never calls it, and never makes such a change."""
    global _OWNS_PROCESS
    _OWNS_PROCESS = True


def owns_process() -> bool:
    """Whether the process is the tool's own (the command line): see :func:`own_process`."""
    return _OWNS_PROCESS


@contextlib.contextmanager
def host_scope() -> Iterator[None]:
    """Leave torch's process-wide state as it was found: the CPU random state (with it :func:`torch.initial_seed`),
    each initialised CUDA device's random state, and the intra-op thread count. Loading a factory model
    (``torch.manual_seed(0)``) and recovery (``torch.manual_seed(seed)``) seed the global generator; a library
    call (:func:`auditor.audit`, :func:`auditor.factorize`, ``recover``) runs inside this scope so that the host's
    random stream goes on as if the call had not happened."""
    import torch

    cpu, threads = torch.get_rng_state(), torch.get_num_threads()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


F = TypeVar("F", bound=Callable[..., Any])


def scoped(fn: F) -> F:
    """``fn`` run inside :func:`host_scope` (a library entry point)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with host_scope():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
