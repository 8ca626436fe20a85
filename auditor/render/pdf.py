"""PDF with WeasyPrint from the same templates and the print CSS. WeasyPrint fetches nothing but inline data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import AuditError
from .base import RenderContext, Stdout

if TYPE_CHECKING:
    from ..results import Audit


def _weasyprint():  # type: ignore[no-untyped-def]
    try:
        import weasyprint
    except (ImportError, OSError) as exc:  # OSError: Pango/HarfBuzz shared libraries missing
        raise AuditError(
            f"PDF output needs WeasyPrint, which cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
            "pip install weasyprint, and install Pango (Debian/Ubuntu: apt-get install libpango-1.0-0 "
            "libpangoft2-1.0-0; macOS: brew install pango); HTML output works without it",
        ) from None
    return weasyprint


def _refuse(url: str) -> None:
    if not url.startswith("data:"):
        raise ValueError(f"lowrank-auditor refuses to fetch {url!r}: reports are self-contained")


def url_fetcher(wp: Any) -> Any:
    """A fetcher for only inline data: URIs (the report's own charts); anything else, local or remote, is refused."""
    urls = wp.urls
    if hasattr(urls, "URLFetcher"):  # WeasyPrint >= 68: a class with a fetch method

        class ReportFetcher(urls.URLFetcher):  # type: ignore[misc, name-defined]
            def fetch(self, url: str, headers: Any = None) -> Any:
                _refuse(url)
                return super().fetch(url, headers)

        return ReportFetcher(allowed_protocols={"data"})

    def fetch(url: str, *args: Any, **kwargs: Any) -> Any:  # older WeasyPrint: a function
        _refuse(url)
        return urls.default_url_fetcher(url, *args, **kwargs)

    return fetch


def render_pdf(audit: "Audit", ctx: RenderContext = RenderContext()) -> bytes:
    """The HTML report (with the same context) printed by WeasyPrint."""
    from .html import render

    wp = _weasyprint()
    html = render(audit, ctx, pdf=True)
    return wp.HTML(string=html, url_fetcher=url_fetcher(wp), base_url=None).write_pdf()


class PdfReporter:
    name = "pdf"
    suffix = ".pdf"
    binary = True
    stdout = Stdout.NEVER

    def render(self, audit: "Audit", context: RenderContext) -> bytes:
        return render_pdf(audit, context)
