"""Small helpers on ONNX models and types, under the names of onnxcustom's ``onnx_helper``.

* :func:`get_onnx_opset`: the version a model imports for one domain;
* :func:`proto_type_to_dtype`: numpy dtype of an ONNX element type (``1`` or
  ``'tensor(float)'``);
* :func:`dtype_to_var_type`: the skl2onnx variable type of a numpy dtype (skl2onnx imported
  on the call, it is no dependency of onnxgrad);
* :func:`onnx_rename_weights` is :func:`onnxgrad.graph.onnx_rename_weights`.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper

from onnxgrad._onnx_utils import load_model
from onnxgrad.graph.names import onnx_rename_weights

#: the element types onnxcustom's helpers converted (onnxruntime's type strings included)
_SUPPORTED_ELEM_TYPES = (
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.INT64,
    TensorProto.INT32,
)
_VAR_TYPES = {
    np.dtype(np.float32): "FloatTensorType",
    np.dtype(np.float64): "DoubleTensorType",
    np.dtype(np.int64): "Int64TensorType",
    np.dtype(np.int32): "Int32TensorType",
}


def get_onnx_opset(model: ModelProto | str, domain: str = "") -> int:
    """The opset version ``model`` imports for ``domain`` (``''`` and ``'ai.onnx'`` are the
    same domain); ``ValueError`` naming the domain when the model does not import it."""
    model = load_model(model)
    wanted = "" if domain == "ai.onnx" else domain
    for opset in model.opset_import:
        if ("" if opset.domain == "ai.onnx" else opset.domain) == wanted:
            return opset.version
    imported = [op.domain or "ai.onnx" for op in model.opset_import]
    raise ValueError(f"the model does not import domain {domain!r} (it imports {imported})")


def proto_type_to_dtype(proto_type: int | str) -> np.dtype:
    """numpy dtype of an ONNX element type given as ``TensorProto.FLOAT``-like integer or as
    onnxruntime's type string (``'tensor(double)'``); ``ValueError`` for other types."""
    elem_type = _elem_type_from_string(proto_type) if isinstance(proto_type, str) else proto_type
    if elem_type not in _SUPPORTED_ELEM_TYPES:
        raise ValueError(
            f"unsupported element type {proto_type!r}, expected one of "
            f"{[TensorProto.DataType.Name(t) for t in _SUPPORTED_ELEM_TYPES]}"
        )
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _elem_type_from_string(type_string: str) -> int:
    """``'tensor(float)'`` -> ``TensorProto.FLOAT``."""
    inner = type_string.removeprefix("tensor(").removesuffix(")")
    name = {"float": "FLOAT", "double": "DOUBLE", "float16": "FLOAT16"}.get(inner, inner.upper())
    try:
        return TensorProto.DataType.Value(name)
    except ValueError as exc:
        raise ValueError(f"unknown ONNX type string {type_string!r}") from exc


def dtype_to_var_type(dtype) -> type:
    """skl2onnx's variable type for a numpy dtype (``FloatTensorType`` for float32,
    ``DoubleTensorType``, ``Int64TensorType``, ``Int32TensorType``); ``ValueError`` for other
    dtypes. Needs skl2onnx."""
    name = _VAR_TYPES.get(np.dtype(dtype))
    if name is None:
        raise ValueError(
            f"no skl2onnx variable type for dtype {np.dtype(dtype)}, "
            f"expected one of {[str(d) for d in _VAR_TYPES]}"
        )
    from skl2onnx.common import data_types

    return getattr(data_types, name)


__all__ = ["dtype_to_var_type", "get_onnx_opset", "onnx_rename_weights", "proto_type_to_dtype"]
