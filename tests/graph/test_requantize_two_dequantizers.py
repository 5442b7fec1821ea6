"""One set of int8 codes read by two ``DequantizeLinear`` nodes (a tied weight, a quantized
table read twice): ``merge_lora(quantized="requantize")`` quantizes ``W + s A B`` once and
both read the new codes (before: refused, "also read by node 'dq_b'"); the runtime adapter
model's once-per-run update quantizes it once and rewires both (before: twice)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model

K = 8
SCALE = 0.01


def _tied(rng):
    """``y = relu(x W) W``, each product reading ``W`` through its own
    ``DequantizeLinear`` of the same codes, scale and zero point."""
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wa"], name="dq_a"),
        helper.make_node("MatMul", ["x", "wa"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wb"], name="dq_b"),
        helper.make_node("MatMul", ["r", "wb"], ["y"], name="second"),
    ]
    inits = {
        "w": rng.integers(-127, 128, (K, K)).astype(np.int8),
        "ws": np.float32(SCALE),
        "wz": np.int8(0),
    }
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, K])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _adapted(model, rng):
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    assert adapter["weight"] == "w" and len(adapter["sums"]) == 2
    shapes = {i.name: tuple(i.dims) for i in adapted.graph.initializer}
    trained = (rng.standard_normal(shapes[adapter["b"]]) * 0.05).astype(np.float32)
    return replace_initializers_into_onnx(adapted, {adapter["b"]: trained}), adapter


def _values(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_codes_read_by_two_dequantizers_are_requantized_once_for_both():
    rng = np.random.default_rng(0)
    model = _tied(rng)
    adapted, adapter = _adapted(model, rng)
    merged = merge_lora(adapted, quantized="requantize")
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    assert [n.input[0] for n in merged.graph.node if n.op_type == "DequantizeLinear"] == ["w"] * 2
    old, new = _values(adapted), _values(merged)
    a, b = old[adapter["a"]].astype(np.float64), old[adapter["b"]].astype(np.float64)
    float_merge = old["w"].astype(np.float64) * SCALE + adapter["scale"] * (a @ b)
    step = float(new["ws"])
    read = (new["w"].astype(np.float64) - float(new["wz"])) * step
    assert np.abs(read - float_merge).max() <= step / 2 + 1e-9
    assert np.abs(read - old["w"] * SCALE).max() > step  # the codes moved
    x = rng.standard_normal((2, K)).astype(np.float32)
    np.testing.assert_allclose(_run(merged, x), _run(adapted, x), rtol=0, atol=0.05)


def test_the_runtime_update_quantizes_shared_codes_once_and_both_read_them():
    rng = np.random.default_rng(1)
    model = _tied(rng)
    adapted, _ = _adapted(model, rng)
    served = runtime_adapter_model(model, adapted, apply="weights")
    assert [n.op_type for n in served.graph.node].count("QuantizeLinear") == 1
    readers = [n for n in served.graph.node if n.name in ("dq_a", "dq_b")]
    assert readers[0].input == readers[1].input and readers[0].input[0] != "w"
    x = rng.standard_normal((2, K)).astype(np.float32)
    merged = merge_lora(adapted, quantized="requantize")
    np.testing.assert_allclose(_run(served, x), _run(merged, x), rtol=0, atol=1e-4)
