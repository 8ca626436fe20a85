"""Moved: the exported program (``model.pt2``, ONNX) is :mod:`auditor.artifacts.export`. This module keeps the
documented paths ``auditor.export.export`` and ``auditor.export.load_program`` working for users; nothing inside the
package imports it."""

from auditor.artifacts.export import add_cli_arguments  # noqa: F401
from auditor.artifacts.export import check_archive  # noqa: F401
from auditor.artifacts.export import check_onnx_available  # noqa: F401
from auditor.artifacts.export import cli_formats  # noqa: F401
from auditor.artifacts.export import cli_write  # noqa: F401
from auditor.artifacts.export import export  # noqa: F401
from auditor.artifacts.export import FORMATS  # noqa: F401
from auditor.artifacts.export import load_program  # noqa: F401
from auditor.artifacts.export import MAX_PLAN_BYTES  # noqa: F401
from auditor.artifacts.export import MAX_SAMPLE_BYTES  # noqa: F401
from auditor.artifacts.export import ONNX  # noqa: F401
from auditor.artifacts.export import ONNX_TOLERANCE  # noqa: F401
from auditor.artifacts.export import parse_formats  # noqa: F401
from auditor.artifacts.export import PT2  # noqa: F401
from auditor.artifacts.export import README  # noqa: F401
from auditor.artifacts.export import readme  # noqa: F401
from auditor.artifacts.export import relative_error  # noqa: F401
from auditor.artifacts.export import TOLERANCE  # noqa: F401
