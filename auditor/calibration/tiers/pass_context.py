"""What the passes (:mod:`~auditor.calibration.tiers.passes`) share without importing one another: the context every
pass runs in and the scope of layers the later passes consider."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...results import Layer, TieGroup
from ..session import CalibrationSession

if TYPE_CHECKING:
    from torch import nn

    from ...progress import Progress


@dataclass(frozen=True)
class PassContext:
    """What every pass runs in: the model, the session of inputs it measures with (its batches, statistics, metric,
    split), and the progress its phases are drawn on."""

    model: "nn.Module"
    session: CalibrationSession
    progress: "Progress"

    def __post_init__(self) -> None:
        assert self.session.model is self.model, "the session belongs to another model"


@dataclass(frozen=True)
class Scope:
    """The layers tiers 2 and 3 consider (``swept``: with a spectrum, not narrow, inputs spanned) and those tier 3 plans
    (swept, untied, rewritable by factorize). Nothing else is in any plan the search measures: a layer calibration
    cannot rank stays dense in the suggested plan."""

    swept: list[Layer]
    planned: list[Layer]
    ties: tuple[TieGroup, ...] = ()  # --tie: groups whose members every plan gives one rank

    @property
    def sensitive(self) -> list[Layer]:
        """The layers a sensitivity is measured for, decomposed and cut by the search: the planned ones."""
        return self.planned


__all__ = ["PassContext", "Scope"]
