"""The process environment the tool sets up for the libraries it drives, before they are imported."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


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
