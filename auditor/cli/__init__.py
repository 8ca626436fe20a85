"""The command line, one module per command: ``lowrank-audit MODEL [options]`` (:mod:`.audit_command`, which also
dispatches the subcommands), ``lowrank-audit factorize`` (:mod:`.factorize_command`), ``lowrank-audit check-plan``
(:mod:`.plan_command`); the flags both the audit and ``factorize`` take are defined once (:mod:`.shared_flags`,
:mod:`.recovery_flags`), and every command parses with :mod:`.argparser` (a usage error is one line, exit 2).

``python -m auditor`` and the ``lowrank-audit`` entry point both run :func:`main`."""

from __future__ import annotations

from .audit_command import main

__all__ = ["main"]
