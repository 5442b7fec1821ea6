"""Run a model with onnxruntime (CPU) or onnx's ReferenceEvaluator and name the outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnxruntime
from onnx.reference import ReferenceEvaluator

Feeds = Mapping[str, np.ndarray]


def run_onnxruntime(model: onnx.ModelProto, feeds: Feeds) -> dict[str, np.ndarray]:
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, dict(feeds))))


def onnxruntime_max_opset() -> int:
    """The newest default-domain opset the installed onnxruntime loads (21 for the training
    build 1.19.2; the current wheels follow onnx)."""
    version = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2])
    return 21 if version < (1, 20) else onnx.defs.onnx_opset_version()


def run_reference(model: onnx.ModelProto, feeds: Feeds) -> dict[str, np.ndarray]:
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(None, dict(feeds))))


RUNTIMES: dict[str, Callable[[onnx.ModelProto, Feeds], dict[str, np.ndarray]]] = {
    "onnxruntime": run_onnxruntime,
    "reference": run_reference,
}


def tolerance(dtype) -> dict[str, float]:
    """assert_allclose tolerances for sums of a few dozen terms in ``dtype``."""
    if np.dtype(dtype) == np.float32:
        return {"rtol": 2e-5, "atol": 1e-5}
    return {"rtol": 1e-12, "atol": 1e-12}
