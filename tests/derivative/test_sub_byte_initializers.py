"""Packed sub-byte initializers (int2/uint2: four values a byte, int4/uint4: two) are read:
``y = x * DequantizeLinear(q, s)`` has ``dy/dx = (q - 0) s``, with ``q`` unpacked here by
numpy from the bytes, low bits first (the ONNX packing)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative

BITS = {TensorProto.INT2: 2, TensorProto.UINT2: 2, TensorProto.INT4: 4, TensorProto.UINT4: 4}
SIGNED = {TensorProto.INT2, TensorProto.INT4}


def _packed(codes: np.ndarray, bits: int) -> bytes:
    """``codes`` packed low bits first, ``8 / bits`` to a byte (the last byte padded)."""
    per_byte = 8 // bits
    unsigned = (codes.astype(np.int64) & ((1 << bits) - 1)).tolist()
    unsigned += [0] * (-len(unsigned) % per_byte)
    return bytes(
        sum(v << (bits * k) for k, v in enumerate(unsigned[i : i + per_byte]))
        for i in range(0, len(unsigned), per_byte)
    )


def _model(data_type: int, codes: np.ndarray, raw: bool):
    bits = BITS[data_type]
    if raw:
        q = TensorProto(name="q", data_type=data_type, dims=[codes.size])
        q.raw_data = _packed(codes, bits)
    else:
        q = helper.make_tensor("q", data_type, [codes.size], codes.tolist())
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "s"], ["w"]),
        helper.make_node("Mul", ["x", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [codes.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [codes.size])],
        [q, numpy_helper.from_array(np.array(0.5, np.float32), "s")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=12)


@pytest.mark.parametrize("raw", [True, False], ids=["raw-data", "int32-data"])
@pytest.mark.parametrize("data_type", sorted(BITS), ids=lambda t: TensorProto.DataType.Name(t))
def test_packed_initializer_is_read(data_type, raw):
    bits = BITS[data_type]
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if data_type in SIGNED else (0, 3)
    codes = np.random.default_rng(bits).integers(low, high + 1, size=7)  # 7: a padded last byte
    gradient = onnx_derivative(_model(data_type, codes, raw), weights=[])
    feeds = {"x": np.ones(7, np.float32), "y_grad": np.ones(7, np.float32)}
    (got,) = ReferenceEvaluator(gradient).run(None, feeds)
    np.testing.assert_array_equal(got, codes.astype(np.float32) * 0.5)
