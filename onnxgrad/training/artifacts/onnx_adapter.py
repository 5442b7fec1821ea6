"""Adapters in onnxruntime's ``.onnx_adapter`` format, the files onnxruntime's
``LoraAdapter`` and onnxruntime-genai's ``Adapters.load`` read.

The file maps names to tensors; an active adapter feeds them to a model that reads them as
graph inputs (:func:`onnxgrad.graph.lora_runtime.runtime_adapter_model` writes such a base).
onnxruntime's ``AdapterFormat`` writes and reads them (onnxruntime 1.20 and later).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxgrad._files import write_atomically
from onnxgrad.training.artifacts.checkpoint import Checkpoint


def _adapter_format():
    import onnxruntime

    found = getattr(onnxruntime, "AdapterFormat", None)
    if found is None:
        raise RuntimeError(
            f"onnxruntime {onnxruntime.__version__} has no AdapterFormat (onnxruntime 1.20 "
            "and later write .onnx_adapter files)"
        )
    return onnxruntime, found


def save_onnx_adapter(
    weights: Checkpoint | Mapping[str, np.ndarray],
    path: str | os.PathLike,
    *,
    adapter_version: int = 1,
    model_version: int = 1,
) -> Path:
    """Write ``weights`` (a trained checkpoint's, or a dict) to ``path`` as an
    ``.onnx_adapter`` file; the names must be those the base model reads."""
    onnxruntime, adapter_format = _adapter_format()
    values = weights.weights if isinstance(weights, Checkpoint) else dict(weights)
    if not values:
        raise ValueError("no tensor to write in the adapter")
    adapter = adapter_format()
    adapter.set_adapter_version(int(adapter_version))
    adapter.set_model_version(int(model_version))
    adapter.set_parameters(
        {
            name: onnxruntime.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))
            for name, value in values.items()
        }
    )
    path = Path(path)
    write_atomically(path, adapter.export_adapter)  # never a partial file at ``path``
    return path


def load_onnx_adapter(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of the ``.onnx_adapter`` file ``path``, by name."""
    _, adapter_format = _adapter_format()
    adapter = adapter_format.read_adapter(str(path))
    return {name: value.numpy() for name, value in adapter.get_parameters().items()}
