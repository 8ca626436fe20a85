"""The command line's argument parser: a usage error is one line (``error: ... See PROG --help.``) and exit 2, for
``lowrank-audit`` and each of its subcommands alike; and the check, shared by the commands, that the cache folder can
be used."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn


class UsageError(Exception):
    """A command line argparse refuses, as the one line the command prints (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line (``error: ... See lowrank-audit --help.``), exit 2, not the usage; a
    description that asks a registry (``description_from``) gets it when the help is shown, so building the parser
    imports no torch."""

    def __init__(self, *args: Any, description_from: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.description_from = description_from

    def format_help(self) -> str:
        if self.description_from is not None:
            self.description = self.description_from()
        return super().format_help()

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        from ..errors import visible

        line = visible(" ".join(message.split()).rstrip("."))  # an argument's escape sequences shown, not run
        raise UsageError(f"error: {line}. See {self.prog} --help.")


def cache_usable(given: Path | None) -> bool:
    """Whether the cache folder (``--cache-dir``, else the default) can be made, read and written. Where it cannot
    (read-only, under a file, a folder above it not searchable), one warning line: the run goes on uncached."""
    from ..errors import escape
    from ..spectra import default_cache_dir

    path = given if given is not None else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", str(path))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        print(f"warning: the cache folder {escape(str(path))} cannot be used ({why}): running without a cache "
              "(give --cache-dir a folder you can write, or --no-cache)", file=sys.stderr)
        return False
    return True
