"""docs/registries.md: every layer kind and every metric kind, read from their registries (``make docs`` writes it;
tests/test_registries_doc.py checks that it is current). What a kind or a metric says of itself is the one place
the tool learns it: this page lists those answers, so a new member appears here without anyone editing a table."""

from __future__ import annotations

from ...calibration.metrics.base import MetricKind
from ...calibration.metrics.registry import for_kind, kinds as metric_kinds
from ...kinds.registry import kinds as layer_kinds

HEADER = """# Layer kinds and metrics

Generated from the registries (`make docs`); do not edit by hand. A layer kind is registered in `auditor/kinds/`
(docs/design.md, "Layer kinds"), a metric kind in `auditor/calibration/metrics/` (docs/calibration.md, "Metrics").
"""


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def layer_table() -> list[str]:
    rows = ["## Layer kinds", "",
            "| kind | factorize rewrites it | tier-2 sweep | gradient sensitivity | input statistics | timed alone |",
            "| --- | --- | --- | --- | --- | --- |"]
    for k in layer_kinds():
        rewrite = f"yes ({k.label})" if k.label else (f"no: {k.cannot_factorize}" if k.cannot_factorize else "no")
        stats = "id counts (diagonal Gram)" if k.lookup_counts else "X^T X"
        rows.append(f"| `{k.kind}` | {rewrite} | {_yes(k.swept)} | "
                    f"{_yes(k.gradient_sensitivity)} | {stats} | {_yes(k.timed)} |")
    return rows


def _direction(m: MetricKind) -> str:
    return "lower (zero on the dense model)" if m.zero_on_dense else m.better()


def _display(m: MetricKind) -> str:
    """How a metric of the kind is written when it declares no direction of its own (the kind's, if it has one)."""
    return "percent" if m.display(m.direction(None)) == "percent" else "its own units"


def metric_table() -> list[str]:
    rows = ["## Metrics", "",
            "| kind | `--metric` names | reported as | better | shown as | gradient sensitivity | verified by rows |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in metric_kinds():
        m = for_kind(name)
        names = ", ".join(f"`{n}`" for n in m.names) or ("`module:fn`" if m.takes_function else "")
        rows.append(f"| `{m.kind}` | {names} | {m.label or m.units} | {_direction(m)} | {_display(m)} | "
                    f"{m.gradient or ''} | {_yes(m.verified_by_rows)} |")
    return rows


def registries_markdown() -> str:
    """The page, from the registries as they stand (a user's registered kinds included)."""
    return "\n".join([HEADER, *layer_table(), "", *metric_table(), ""])


__all__ = ["layer_table", "metric_table", "registries_markdown"]
