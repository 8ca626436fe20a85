"""Measuring a model on the held-out rows: the metric and its evaluator (:mod:`.metric`, the kinds in
:mod:`..metrics`), the cached-prefix evaluator (:mod:`.staged`) and the verification interval (:mod:`.verify`).
Reads :mod:`..data` and :mod:`..metrics`."""
