"""Structural checks: what onnx's checker and onnxruntime accept, in topological order."""

from __future__ import annotations

from onnx import ModelProto

from onnxgrad._model_checks import check_structure, check_with_onnx


def checked_structure(model: ModelProto) -> ModelProto:
    """``ValueError`` naming a node in a domain the model does not import, a value read but
    never produced, one produced twice, a cycle, or what onnx's checker refuses; the nodes
    of every graph are put in topological order (onnxruntime runs unsorted graphs)."""
    try:
        check_structure(model)
    except UnicodeDecodeError as exc:  # protobuf decodes strings when they are read
        raise ValueError(f"the model holds a name that is not UTF-8 text ({exc})") from None
    check_with_onnx(model)
    return model
