"""What a rule sees: the audit, the plan, and the lookups rules share, each built once per run (a name -> layer
dict, the planned layers, the data-flow facts)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from ..results import Layer, PlanItem, Spectrum, Suggestion

if TYPE_CHECKING:
    from ..config import Setting, Settings
    from ..planning.plan import Plan
    from ..results import AuditResult


class LayerInfo(NamedTuple):
    """One layer with what the audit knows about it."""

    layer: Layer
    spectrum: Spectrum | None
    suggestion: Suggestion | None
    planned: bool


def _data_flow_and_chains(audit: "AuditResult") -> tuple[bool, list[tuple[str, str]]]:
    """Whether the audit's graph follows data flow, and its chained linear pairs (empty without data flow)."""
    g = audit.graph
    if g is None or not g.data_flow:
        return False, []
    return True, list(g.chains)


@dataclass
class Context:
    """The audit under review and the plan (None when the suggested ranks are reviewed)."""

    audit: "AuditResult"
    plan: "Plan | None" = None

    @property
    def settings(self) -> "Settings":
        return self.audit.settings

    def setting(self, setting: "Setting") -> Any:
        """The value of a setting a rule declares (``settings=[...]`` in ``@rule``): what the config file, the plan
        or the command line set, else its default."""
        return self.audit.settings.value(setting)

    @property
    def items(self) -> list[PlanItem]:
        """The reviewed plan items: the plan's, or the suggested ranks' when there is no plan."""
        return self.audit.review.items if self.audit.review else []

    @cached_property
    def _by_name(self) -> dict[str, Layer]:
        out: dict[str, Layer] = {}
        for layer in self.audit.layers:  # first match wins, as in a scan by name or tensor name
            out.setdefault(layer.name, layer)
            out.setdefault(layer.param, layer)
        return out

    @cached_property
    def _by_site(self) -> dict[str, Layer]:
        out: dict[str, Layer] = {}
        for layer in self.audit.layers:
            for u in layer.uses:
                out.setdefault(u.site, layer)
        return out

    @cached_property
    def planned(self) -> frozenset[str]:
        """Names of the layers the reviewed plan factorizes."""
        return frozenset(it.layer for it in self.items)

    def layer(self, name: str) -> Layer:
        """The layer with this name or tensor name, in O(1); KeyError if none."""
        return self._by_name[name]

    def layer_at(self, site: str) -> Layer:
        """The layer used at a graph site (a module or op name); falls back to the layer's own name."""
        return self._by_site.get(site) or self._by_name[site]

    def plan_items(self) -> Iterator[tuple[PlanItem, Layer]]:
        """Each reviewed plan item with its layer."""
        for it in self.items:
            yield it, self.layer(it.layer)

    def each_layer(self) -> Iterator[LayerInfo]:
        """Each layer, largest first, with its spectrum, suggestion and whether the plan factorizes it."""
        spectra, suggestions, planned = self.audit.spectra, self.audit.suggestions, self.planned
        for layer in self.audit.layers:
            yield LayerInfo(layer, spectra.get(layer.name), suggestions.get(layer.name), layer.name in planned)

    @cached_property
    def _flow(self) -> tuple[bool, list[tuple[str, str]]]:
        return _data_flow_and_chains(self.audit)

    @property
    def data_flow(self) -> bool:
        """Whether the graph's edges follow data flow (not module call order)."""
        return self._flow[0]

    @property
    def chains(self) -> list[tuple[str, str]]:
        """Pairs of graph sites (a, b): a linear map feeding only b, b reading only a, nothing nonlinear between."""
        return self._flow[1]

    @property
    def has_spectra(self) -> bool:
        """Whether singular values were computed (each layer has a spectrum, possibly a skipped one)."""
        return bool(self.audit.spectra)
