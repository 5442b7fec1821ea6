"""onnxgrad.onnx_helper: opsets and types under onnxcustom's names."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgrad.onnx_helper import dtype_to_var_type, get_onnx_opset, proto_type_to_dtype
from tests.models import seed004_model


def test_get_onnx_opset_by_domain():
    model = seed004_model(opset=14)
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    assert get_onnx_opset(model) == get_onnx_opset(model, "ai.onnx") == 14
    assert get_onnx_opset(model, "ai.onnx.ml") == 3
    with pytest.raises(ValueError, match="does not import domain 'H'"):
        get_onnx_opset(model, "H")


@pytest.mark.parametrize(
    ("given", "dtype"),
    [
        (TensorProto.FLOAT, np.float32),
        (TensorProto.DOUBLE, np.float64),
        (TensorProto.INT64, np.int64),
        ("tensor(double)", np.float64),
        ("tensor(float)", np.float32),
        ("tensor(float16)", np.float16),
    ],
)
def test_proto_type_to_dtype(given, dtype):
    assert proto_type_to_dtype(given) == dtype


@pytest.mark.parametrize("given", [TensorProto.BOOL, TensorProto.STRING, "tensor(nope)"])
def test_proto_type_to_dtype_refuses_other_types(given):
    with pytest.raises(ValueError):
        proto_type_to_dtype(given)


def test_dtype_to_var_type():
    data_types = pytest.importorskip("skl2onnx.common.data_types")
    assert dtype_to_var_type(np.float32) is data_types.FloatTensorType
    assert dtype_to_var_type(np.float64) is data_types.DoubleTensorType
    assert dtype_to_var_type(np.int64) is data_types.Int64TensorType
    assert dtype_to_var_type(np.int32) is data_types.Int32TensorType
    with pytest.raises(ValueError, match="int8"):
        dtype_to_var_type(np.int8)
