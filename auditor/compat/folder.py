"""Moved: the factorized model's output folder (write, check, load) is :mod:`auditor.artifacts.folder`. This module
keeps the documented path ``auditor.folder.load_factorized`` working for users; nothing inside the package imports
it."""

from auditor.artifacts.folder import EXPORT_FILES  # noqa: F401
from auditor.artifacts.folder import FORMAT  # noqa: F401
from auditor.artifacts.folder import FORMAT_VERSION  # noqa: F401
from auditor.artifacts.folder import load_factorized  # noqa: F401
from auditor.artifacts.folder import MARKER  # noqa: F401
from auditor.artifacts.folder import MAX_PLAN_BYTES  # noqa: F401
from auditor.artifacts.folder import MODEL_FILE  # noqa: F401
from auditor.artifacts.folder import OUTPUT_FILES  # noqa: F401
from auditor.artifacts.folder import PLAN_FILE  # noqa: F401
from auditor.artifacts.folder import previous_output  # noqa: F401
from auditor.artifacts.folder import read_meta  # noqa: F401
from auditor.artifacts.folder import read_plan  # noqa: F401
from auditor.artifacts.folder import save_factorized  # noqa: F401
from auditor.artifacts.folder import TOOL  # noqa: F401
from auditor.artifacts.folder import write_factorized  # noqa: F401
