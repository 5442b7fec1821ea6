"""A QDQ weight read by a second product through ``Identity`` -> ``QuantizeLinear`` ->
``DequantizeLinear`` (what ``quantize_static`` makes of ALBERT's layer weights, shared by its
layers): ``add_lora`` adapts the first product only, so ``merge_lora(quantized="requantize")``
refuses, naming the weight and the other reader, instead of writing ``W + s A B`` into codes
the second product reads too; ``keep`` predicts what the training graph does."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from tests.normalize.kernels import run

RNG = np.random.default_rng(5)
K = 8


def _shared_weight_model():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["h"], name="first"),
        helper.make_node("Identity", ["wd"], ["again"]),
        helper.make_node("QuantizeLinear", ["again", "ws2", "wz2"], ["wq2"], name="weight_q"),
        helper.make_node("DequantizeLinear", ["wq2", "ws2", "wz2"], ["wd2"]),
        helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"]),
        helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["hd"]),
        helper.make_node("MatMul", ["hd", "wd2"], ["y"], name="second"),
    ]
    inits = {
        "s": np.float32(0.02),
        "z": np.uint8(128),
        "w": RNG.integers(-127, 128, (K, K)).astype(np.int8),
        "ws": np.float32(0.01),
        "wz": np.int8(0),
        "ws2": np.float32(0.011),
        "wz2": np.int8(-1),
    }
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, K])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def test_a_weight_read_by_an_unadapted_product_is_not_requantized():
    model = _shared_weight_model()
    adapted = add_lora(model, rank=2)
    adapters = lora_adapters(adapted)
    assert [a["weight"] for a in adapters] == ["w"]
    shapes = {i.name: tuple(i.dims) for i in adapted.graph.initializer}
    values = {a["b"]: RNG.standard_normal(shapes[a["b"]]).astype(np.float32) for a in adapters}
    trained = replace_initializers_into_onnx(adapted, values)
    with pytest.raises(ValueError, match=r"weight 'w'.*read by node 'weight_q'.*no adapter"):
        merge_lora(trained, quantized="requantize")
    x = RNG.standard_normal((2, K)).astype(np.float32)
    np.testing.assert_array_equal(run(merge_lora(trained), {"x": x})[0], run(trained, {"x": x})[0])
