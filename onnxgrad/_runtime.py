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
