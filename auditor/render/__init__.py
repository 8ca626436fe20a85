"""Renderers: each reads an Audit (plain data) and a RenderContext and returns one format. None touches torch.

``REPORTERS`` maps each ``--format`` word to its reporter, in the order the command line lists them; a new format
is a class with ``name``, ``suffix``, ``binary`` and ``render(audit, context)`` passed to :func:`register`.

>>> list(REPORTERS)
['text', 'json', 'md', 'html', 'pdf', 'sarif', 'github']
>>> REPORTERS["pdf"].suffix, REPORTERS["pdf"].binary
('.pdf', True)
"""

from __future__ import annotations

from .base import RenderContext, Reporter, atomic_write
from .html import HtmlReporter
from .jsonout import JsonReporter
from .markdown import MarkdownReporter
from .pdf import PdfReporter
from .sarif import GithubReporter, SarifReporter
from .terminal import TextReporter

__all__ = ["REPORTERS", "RenderContext", "Reporter", "atomic_write", "register"]

REPORTERS: dict[str, Reporter] = {}


def register(reporter: Reporter) -> Reporter:
    """Add (or replace) the reporter for ``reporter.name``."""
    if not isinstance(reporter, Reporter):
        raise TypeError(f"{reporter!r} lacks name, suffix, binary or render(audit, context)")
    REPORTERS[reporter.name] = reporter
    return reporter


for _r in (TextReporter(), JsonReporter(), MarkdownReporter(), HtmlReporter(), PdfReporter(), SarifReporter(),
           GithubReporter()):
    register(_r)
