"""The tiers, one module each: tier 1 (:mod:`.tier1`), the measured floors (:mod:`.sweep`, on a cluster
:mod:`.cluster`), the output-gradient sensitivity (:mod:`.fisher`), the rounding floor (:mod:`.rounding`) and the
plan search (:mod:`.budget`). Each measures with a :class:`~auditor.calibration.session.CalibrationSession`; the
stage (:mod:`auditor.calibration.stage`) composes them."""
