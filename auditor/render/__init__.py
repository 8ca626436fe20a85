"""Renderers: each reads an Audit (plain data) and a RenderContext and returns one format. None touches torch.

``REPORTERS`` is the one table of output formats: each ``--format`` word to its reporter, in the order the command
line lists them, each knowing its file suffix and whether it may go to stdout (:class:`Stdout`); the command line
reads nothing else. A new format is a class with ``name``, ``suffix``, ``binary``, ``stdout`` and
``render(audit, context)`` passed to :func:`register`.

>>> list(REPORTERS)
['text', 'json', 'md', 'html', 'pdf', 'sarif', 'github']
>>> REPORTERS["pdf"].suffix, REPORTERS["pdf"].binary, str(REPORTERS["pdf"].stdout.value)
('.pdf', True, 'never')
>>> [f for f in REPORTERS if stdout_of(f) is Stdout.DOCUMENT]
['json', 'md', 'sarif']
"""

from __future__ import annotations

from .base import RenderContext, Reporter, Stdout, atomic_write
from .html import HtmlReporter
from .jsonout import JsonReporter
from .markdown import MarkdownReporter
from .pdf import PdfReporter
from .sarif import GithubReporter, SarifReporter
from .terminal import TextReporter

__all__ = ["REPORTERS", "RenderContext", "Reporter", "Stdout", "atomic_write", "register", "stdout_of"]

REPORTERS: dict[str, Reporter] = {}


def register(reporter: Reporter) -> Reporter:
    """Add (or replace) the reporter for ``reporter.name``."""
    if not isinstance(reporter, Reporter):
        raise TypeError(f"{reporter!r} lacks name, suffix, binary, stdout or render(audit, context)")
    REPORTERS[reporter.name] = reporter
    return reporter


def stdout_of(fmt: str) -> Stdout:
    """Where ``fmt`` may go besides its file; an unknown word is file-only (the command line rejects it later)."""
    r = REPORTERS.get(fmt)
    return Stdout(r.stdout) if r is not None else Stdout.NEVER


for _r in (TextReporter(), JsonReporter(), MarkdownReporter(), HtmlReporter(), PdfReporter(), SarifReporter(),
           GithubReporter()):
    register(_r)
