"""The dense model measured once: what every later plan is compared against.

:func:`references_of` (the audit's ``references`` pass, :mod:`~auditor.calibration.tiers.passes`) builds, for one
session, the measurers the tiers, the verification, the uniform baseline and the plan check read:

- ``search``: what tier 3 measures plans with. For a built-in metric in a ``split`` session (the audit's) a
  :class:`~auditor.calibration.measure.staged.StagedEvaluator` on the search rows (a subsample first, every search row
  only for plans near the tolerance; the dense per-row sums once), else the plain evaluator (a user metric,
  ``--no-split``, the library's sessions);
- ``verifier``: the held-out rows' verification part, every row measured with a bootstrap interval (``split``
  sessions only; None otherwise);
- ``evaluator``: every search row against the dense reference (the rounding floor, tier 2's floors, the recovery and
  the plan check of an unsplit session read it). Where ``search`` is that evaluator it is measured with the others;
  beside a staged search it is measured when first read, once (its dense forward is otherwise not paid for), and
  without a second repeat check: the staged search ran it on the first search rows.

The result is frozen: no measurement changes which measurers there are, and the session is never written. What
measuring the dense model found (a forward that does not repeat, too few verification documents) is in
``warnings``, for the report.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .measure.metric import Evaluator

if TYPE_CHECKING:
    from .measure.metric import PlanMeasurer
    from .measure.verify import Verifier
    from .session import CalibrationSession


@dataclass(frozen=True)
class References:
    """The measurers of one session's dense model (module docstring). ``search_rows``: the rows of the search part
    (what a verification's ``search_rows`` says)."""

    search: "PlanMeasurer"
    verifier: "Verifier | None"
    search_rows: int
    notes: tuple[str, ...]  # what the verification's documents warn of
    whole: Callable[[], Evaluator]  # the evaluator on every search row, measured on first call, once
    seconds: dict[str, float] = field(default_factory=dict)  # the references pass's time

    @property
    def evaluator(self) -> Evaluator:
        """Every search row against the dense reference (measured on first use when ``search`` is staged)."""
        return self.whole()

    @property
    def warnings(self) -> tuple[str, ...]:
        """What measuring the dense model found: the evaluator's checks (when it was measured) and the verification
        documents' note, each once."""
        info = self.whole.cache_info() if hasattr(self.whole, "cache_info") else None
        built = list(self.evaluator.warnings) if info is None or info.currsize else []
        return tuple(dict.fromkeys([*built, *self.notes]))


def evaluator_of(session: "CalibrationSession", repeats_checked: bool = False) -> Evaluator:
    """An evaluator on the session's search rows (every held-out row when unsplit): the dense reference measured and
    the forward checked to repeat (unless ``repeats_checked``: the staged search checked it on the first of these
    rows), in eval mode. The audit's is its references' :attr:`References.evaluator`; a library call without them
    measures its own."""
    with session.measuring():
        return Evaluator(session.model, session.search_calibration, session.metric, repeats_checked)


def _whole(session: "CalibrationSession", repeats_checked: bool = False) -> Callable[[], Evaluator]:
    """:func:`evaluator_of` on first call, kept (2026-12-07: beside a staged search it ran the repeat check again,
    one more dense forward of the first batch: about 5 min of a 7B audit)."""
    return functools.lru_cache(maxsize=1)(functools.partial(evaluator_of, session, repeats_checked))


def _verifier(session: "CalibrationSession") -> "tuple[Verifier | None, tuple[str, ...]]":
    """The verifier on the verification rows (``split`` sessions only) and the note when they hold too few of the
    calibration's documents to resample whole ones."""
    if not session.split:
        return None, ()
    from .measure.verify import Verifier, verification_documents

    search, verify = session.held_out_parts
    docs = verification_documents(session.calibration, search, verify)
    notes: tuple[str, ...] = ()
    if docs.ids is not None and docs.count < 2:  # said, and blocks of rows resampled instead
        notes = (f"the verification rows hold {docs.count} of the calibration's {docs.unit}, too few to resample "
                 "whole ones: the interval for an unseen document resamples blocks of rows instead; hold out more "
                 "documents (a larger --holdout, or a --holdout source of four or more)",)
    with session.measuring():
        return Verifier(session.model, verify, session.metric, session.confidence, documents=docs), notes


def search_measurer(session: "CalibrationSession",
                    whole: Callable[[], Evaluator] | None = None) -> "PlanMeasurer":
    """What tier 3 measures plans with (module docstring): a staged evaluator on the search rows for a built-in
    metric in a ``split`` session, else ``whole()`` (default: :func:`evaluator_of`)."""
    if session.metric.spec.verified_by_rows and session.split:
        from .measure.staged import StagedEvaluator

        with session.measuring():
            return StagedEvaluator(session.model, session.search_calibration.holdout, session.metric)
    return whole() if whole is not None else evaluator_of(session)


def references_of(session: "CalibrationSession") -> References:
    """The session's dense model measured: the verifier, the search's measurer and (lazily, beside a staged search)
    the plain evaluator (module docstring)."""
    verifier, notes = _verifier(session)
    whole = _whole(session)
    search = search_measurer(session, whole)
    if getattr(search, "repeats_checked", False):  # a staged search ran the dense repeat check on the first rows
        whole = _whole(session, repeats_checked=True)
    rows = sum(b.rows for b in session.search_calibration.holdout)
    return References(search, verifier, rows, notes, whole)


__all__ = ["References", "evaluator_of", "references_of", "search_measurer"]
