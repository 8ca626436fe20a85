"""Moved: model sources live in :mod:`auditor.sources` (dispatch), ``auditor.sources.factory``, ``.hf``,
``.checkpoint`` and ``.tensorref``. This module keeps the earlier public path ``auditor.load.load_source`` working
for users; nothing inside the package imports it."""

from auditor.sources import Loaded  # noqa: F401
from auditor.sources import WeightsOnly  # noqa: F401
from auditor.sources import load_source  # noqa: F401
from auditor.sources import parse_shape  # noqa: F401
