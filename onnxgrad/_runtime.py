"""Import onnxruntime without the training wheel's import-time side effects.

``import onnxruntime`` from onnxruntime-training 1.19.2 validates its build by importing
``onnxruntime.training.ortmodule``, which imports PyTorch when it is installed (seconds,
and the design notes forbid importing ``onnxruntime.training``). onnxgrad only needs the
inference API and the ``_pybind_state`` gradient builders, so the first import is done
with ``onnxruntime.training`` masked; the mask is lifted right after, so a user who wants
``onnxruntime.training`` can still import it.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_onnxruntime() -> ModuleType:
    """``onnxruntime``, imported (once) without importing ``onnxruntime.training``."""
    if "onnxruntime" in sys.modules:
        return sys.modules["onnxruntime"]
    masked = "onnxruntime.training" not in sys.modules
    if masked:
        sys.modules["onnxruntime.training"] = None  # makes that import raise ImportError
    try:
        import onnxruntime
    finally:
        if masked and sys.modules.get("onnxruntime.training", False) is None:
            del sys.modules["onnxruntime.training"]
    return onnxruntime


#: onnxruntime's own default logger severity: warnings and above.
DEFAULT_LOGGER_SEVERITY = 2
_LOGGER_SEVERITIES = range(5)
_recorded_severity = DEFAULT_LOGGER_SEVERITY


def set_logger_severity(level: int) -> int:
    """Set onnxruntime's default logger severity and record it; return the level it replaces.

    Levels are onnxruntime's: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal. Code that
    silences onnxruntime for a moment calls :func:`restore_logger_severity` afterwards, so the
    level chosen here (by the command line, say) survives it.
    """
    global _recorded_severity
    if isinstance(level, bool) or not isinstance(level, int) or level not in _LOGGER_SEVERITIES:
        raise ValueError(f"logger severity must be an integer from 0 to 4, got {level!r}")
    import_onnxruntime().set_default_logger_severity(level)
    previous, _recorded_severity = _recorded_severity, level
    return previous


def logger_severity() -> int:
    """The level last set by :func:`set_logger_severity` (onnxruntime's default before)."""
    return _recorded_severity


def restore_logger_severity() -> None:
    """Set onnxruntime's default logger back to the recorded level after a temporary change."""
    import_onnxruntime().set_default_logger_severity(_recorded_severity)
