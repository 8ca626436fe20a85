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
    import logging

    fonts = logging.getLogger("matplotlib.font_manager")
    if fonts.level == logging.NOTSET:  # "Could not save font_manager cache" (a full disk, a file-size limit) is
        fonts.setLevel(logging.ERROR)  # no second line beside the error that says so: the fonts still work
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


SCRATCH = "lowrank-audit-"  # the temporary folders a run makes in TMPDIR: lowrank-audit-<kind>-<pid>-<random>
STALE_S = 3600.0  # a run's leftovers are removed only once its process is gone and they are this old


def scratch_prefix(kind: str) -> str:
    """The name prefix of a temporary folder of this run (``tempfile.mkdtemp(prefix=...)``): it carries the process
    id, so that :func:`sweep_scratch` can tell a killed run's folder from a live one's."""
    return f"{SCRATCH}{kind}-{os.getpid()}-"


def _gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # another user's process: alive
    return False


def _pid_of(name: str, staged: bool) -> int | None:
    """The process id in a scratch folder's name (``lowrank-audit-<kind>-<pid>-...``) or a staged cache entry's
    (``.<entry>.<pid>.tmp``)."""
    parts = name.split(".")[-2:-1] if staged else name[len(SCRATCH):].split("-")[1:2]
    return int(parts[0]) if parts and parts[0].isdigit() else None


_SWEPT: set[str] = set()


def sweep_scratch(folder: str | Path | None = None) -> None:
    """Remove what killed runs left (no ``finally`` runs on SIGKILL): in TMPDIR (``folder`` None) the scratch
    folders of :func:`scratch_prefix`, in a cache ``folder`` the staged entries ``.<entry>.<pid>.tmp``; only where
    the process named is gone and the leftover is older than :data:`STALE_S`. Once per folder and process; any
    error leaves things as they are."""
    import shutil
    import time

    where = str(folder) if folder is not None else tempfile.gettempdir()
    if where in _SWEPT:
        return
    _SWEPT.add(where)
    staged = folder is not None
    try:
        names = [n for n in os.listdir(where) if (n.startswith(".") and n.endswith(".tmp")) == staged
                 and (staged or n.startswith(SCRATCH))]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        pid = _pid_of(name, staged)
        try:
            if pid is None or not _gone(pid) or time.time() - os.lstat(path).st_mtime < STALE_S:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass


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


_LIBC: Any = None


def trim_heap() -> None:
    """Hand the memory the allocator keeps after it is freed back to the system: glibc's ``malloc_trim(0)``, every
    arena's free pages (nothing elsewhere). It changes no setting of the allocator (unlike ``mallopt``), so a
    library call may do it: the calibrated audit does after each fit batch of the gradient pass and each plan it
    measures, whose freed arrays of a few MiB (of every size: moments, decompositions, factors at each rank) would
    otherwise stay in the heap and the resident size grow with the depth."""
    c = libc()
    if c:
        c.malloc_trim(0)


def libc() -> Any:
    """glibc, loaded once (``ctypes.CDLL``); False on another C library (no ``malloc_trim``)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


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
