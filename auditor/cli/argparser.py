"""The command line's argument parser: a usage error is one line (``error: ... See PROG --help.``) and exit 2, for
``lowrank-audit`` and each of its subcommands alike."""

from __future__ import annotations

import argparse
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
