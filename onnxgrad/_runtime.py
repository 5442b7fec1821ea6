"""Import onnxruntime without the training wheel's import-time side effects.

``import onnxruntime`` from onnxruntime-training 1.19.2 validates its build by importing
``onnxruntime.training.ortmodule``, which imports PyTorch when it is installed (seconds,
and the design notes forbid importing ``onnxruntime.training``). onnxgrad only needs the
inference API and the ``_pybind_state`` gradient builders, so the first import is done
with ``onnxruntime.training`` masked; the mask is lifted right after, so a user who wants
``onnxruntime.training`` can still import it.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

#: The onnxruntime wheels that install the ``onnxruntime`` package: one per environment.
FLAVOURS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-training",
    "onnxruntime-training-cpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-webgpu",
)
#: The flavours that carry onnxruntime-training's gradient builder (``backend="ort"``).
TRAINING_FLAVOURS = ("onnxruntime-training", "onnxruntime-training-cpu")
TRAINING_PYTHONS = "Python 3.10 and 3.11"
INSTALL_CPU = 'pip install "onnxgrad[cpu]"'
INSTALL_TRAINING = 'pip install "onnxgrad[training]"'


def installed_flavours() -> list[tuple[str, str]]:
    """``(distribution, version)`` of every onnxruntime flavour installed, sorted by name."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in FLAVOURS:
            found[name] = dist.version
    return sorted(found.items())


def flavour_description() -> str:
    """``'onnxruntime-training-cpu 1.19.2'``, the installed flavours joined, or ``'none'``."""
    flavours = installed_flavours()
    return ", ".join(f"{name} {version}" for name, version in flavours) or "none"


def _mixed_install_error(flavours: list[tuple[str, str]]) -> ImportError:
    names = " and ".join(f"{name} {version}" for name, version in flavours)
    return ImportError(
        f"{names} are installed over one 'onnxruntime' folder, which breaks both; keep one: "
        f"pip uninstall -y {' '.join(name for name, _ in flavours)}, then reinstall the one "
        f"you want (for example {INSTALL_CPU}); in the .venv of onnxgrad's dev.py, "
        "python3 dev.py demo does both"
    )


def import_onnxruntime() -> ModuleType:
    """``onnxruntime``, imported (once) without importing ``onnxruntime.training``.

    Raises ``ImportError`` whose message is the command to run when no flavour is installed,
    or names the flavours when several were installed over each other.
    """
    if "onnxruntime" in sys.modules and sys.modules["onnxruntime"] is not None:
        return sys.modules["onnxruntime"]
    flavours = installed_flavours()
    if len(flavours) > 1:
        raise _mixed_install_error(flavours)
    try:
        return _import_masked()
    except ImportError as exc:
        if not flavours:
            raise ImportError(
                f"this needs onnxruntime, which is not installed: {INSTALL_CPU} "
                '(or "onnxgrad[gpu]" for CUDA 12, "onnxgrad[training]" for backend=\'ort\')'
            ) from exc
        raise ImportError(
            f"{flavours[0][0]} {flavours[0][1]} is installed but does not import ({exc}); "
            f"reinstall it: pip install --force-reinstall {flavours[0][0]}=={flavours[0][1]}"
        ) from exc


@functools.cache
def has_training_builder() -> bool:
    """Whether the active onnxruntime carries onnxruntime-training's gradient builder."""
    try:
        import_onnxruntime()
        from onnxruntime.capi import _pybind_state
    except ImportError:
        return False
    return hasattr(_pybind_state, "OrtModuleGraphBuilder")


def require_training_builder() -> None:
    """Raise ``ImportError`` naming the wheel ``backend='ort'`` needs and the active one."""
    if has_training_builder():
        return
    raise ImportError(
        "backend='ort' needs onnxruntime-training's gradient builder (onnxruntime-training-cpu "
        f"1.19.2, wheels for {TRAINING_PYTHONS} only: {INSTALL_TRAINING}); the active "
        f"onnxruntime is {flavour_description()}. The native backend (backend='onnx') needs "
        "no training build"
    )


def _import_masked() -> ModuleType:
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
