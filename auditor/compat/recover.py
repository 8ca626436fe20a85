"""Moved: recovery lives in :mod:`auditor.calibration.recovery` (beside the plan search whose frontier it measures
again), its command-line flags in :mod:`auditor.cli.recovery_flags`. This module keeps the documented path
``auditor.recover.recover`` working for users; nothing inside the package imports it."""

from auditor.calibration.recovery import DEFAULT_LR  # noqa: F401
from auditor.calibration.recovery import OBJECTIVES  # noqa: F401
from auditor.calibration.recovery import TRAINABLE  # noqa: F401
from auditor.calibration.recovery import Recovery  # noqa: F401
from auditor.calibration.recovery import RecoveryPoint  # noqa: F401
from auditor.calibration.recovery import RecoverySettings  # noqa: F401
from auditor.calibration.recovery import distill_loss  # noqa: F401
from auditor.calibration.recovery import factor_modules  # noqa: F401
from auditor.calibration.recovery import recover  # noqa: F401
from auditor.calibration.recovery import summary  # noqa: F401
