"""Structural checks: what onnx's checker and onnxruntime accept, in topological order."""

from __future__ import annotations

from contextlib import contextmanager

from onnx import ModelProto

from onnxgrad._model_checks import check_structure, check_with_onnx
from onnxgrad._onnx_utils import normalize_domain

#: Operators onnxruntime registers in the default domain though onnx defines none of that name
#: (lowered by :mod:`onnxgrad.normalize.contrib`); onnx's checker reads them as the
#: ``com.microsoft`` operators they are.
RUNTIME_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def checked_structure(model: ModelProto) -> ModelProto:
    """``ValueError`` naming a node in a domain the model does not import, a value read but
    never produced, one produced twice, a cycle, or what onnx's checker refuses; the nodes
    of every graph are put in topological order (onnxruntime runs unsorted graphs)."""
    try:
        check_structure(model)
    except UnicodeDecodeError as exc:  # protobuf decodes strings when they are read
        raise ValueError(f"the model holds a name that is not UTF-8 text ({exc})") from None
    with runtime_ops_as_contrib(model):
        check_with_onnx(model)
    return model


@contextmanager
def runtime_ops_as_contrib(model: ModelProto):
    """Within the block, the main graph's :data:`RUNTIME_DEFAULT_DOMAIN_OPS` nodes are in the
    ``com.microsoft`` domain (imported), which onnx's checker leaves to the runtime."""
    moved = [
        node
        for node in model.graph.node
        if not normalize_domain(node.domain) and node.op_type in RUNTIME_DEFAULT_DOMAIN_OPS
    ]
    added = bool(moved) and not any(o.domain == "com.microsoft" for o in model.opset_import)
    for node in moved:
        node.domain = "com.microsoft"
    if added:
        model.opset_import.add(domain="com.microsoft", version=1)
    try:
        yield model
    finally:
        for node in moved:
            node.domain = ""
        if added:
            model.opset_import.pop()
