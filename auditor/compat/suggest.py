"""Moved: the suggested ranks are :mod:`auditor.planning.suggest`. This module keeps the documented path
``auditor.suggest.suggest`` working for users; nothing inside the package imports it."""

from auditor.planning.suggest import suggest  # noqa: F401
from auditor.planning.suggest import target_key  # noqa: F401
