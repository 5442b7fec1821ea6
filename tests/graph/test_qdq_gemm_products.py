"""A QDQ ``Gemm`` (what ``quantize_static`` makes of a ``Gemm``, onnxruntime's ``QGemm``) whose
weight is stored ``N x K`` (``transB``), quantized per output channel, with ``alpha``: its
codes get an adapter beside the product, and every model that comes back computes
``Q(alpha x_q W + c + alpha s x A B)`` as numpy does from the ONNX specification."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.graph.lora_runtime import runtime_adapter_model

K, N, M, ALPHA = 16, 6, 5, 0.5
X_SCALE, Y_SCALE, ZERO = 0.02, 0.05, 128
RNG = np.random.default_rng(0)
CODES = RNG.integers(-127, 128, (N, K)).astype(np.int8)
SCALES = (RNG.random(N) * 0.02 + 0.01).astype(np.float32)
BIAS = RNG.standard_normal(N).astype(np.float32)


def _qdq_gemm():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Gemm", ["xd", "wd", "b"], ["g"], transB=1, alpha=ALPHA),
        helper.make_node("QuantizeLinear", ["g", "ys", "yz"], ["gq"]),
        helper.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["y"]),
    ]
    inits = {
        "xs": np.float32(X_SCALE),
        "xz": np.uint8(ZERO),
        "w": CODES,
        "ws": SCALES,
        "wz": np.zeros(N, np.int8),
        "b": BIAS,
        "ys": np.float32(Y_SCALE),
        "yz": np.uint8(ZERO),
    }
    graph = helper.make_graph(
        nodes,
        "qgemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _uint8(v: np.ndarray, scale: float) -> np.ndarray:
    """``DequantizeLinear(QuantizeLinear(v))``, uint8 with zero point 128."""
    return (np.clip(np.rint(v / scale) + ZERO, 0, 255) - ZERO) * scale


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_qdq_gemm_with_transposed_weight_comes_back_adapted():
    model = _qdq_gemm()
    adapted = add_lora(model, rank=2)
    assert [(a["weight"], a["shape"]) for a in lora_adapters(adapted)] == [("w", [K, N])]
    b = RNG.standard_normal((2, N)).astype(np.float32)
    adapted = replace_initializers_into_onnx(adapted, {"w_lora_B": b})
    a = numpy_helper.to_array(next(i for i in adapted.graph.initializer if i.name == "w_lora_A"))
    x = (RNG.standard_normal((M, K)) * 0.5).astype(np.float32)
    weight = (CODES.astype(np.float64) * SCALES[:, None]).T  # K x N
    product = ALPHA * _uint8(x, X_SCALE) @ weight + BIAS
    effect = np.abs(_uint8(product + ALPHA * x @ a @ b, Y_SCALE) - _uint8(product, Y_SCALE))
    assert effect.max() > 10 * Y_SCALE
    # the branch reads x before its rounding and is added before the output's
    want = _uint8(product + ALPHA * x @ a @ b, Y_SCALE)
    for result in (adapted, merge_lora(adapted), runtime_adapter_model(model, adapted)):
        np.testing.assert_allclose(_run(result, x), want, rtol=0, atol=Y_SCALE * 1.01)
    # folded and quantized again per channel: within one output step and the codes' rounding
    folded = merge_lora(adapted, quantized="requantize")
    assert [n.op_type for n in folded.graph.node] == [n.op_type for n in model.graph.node]
    merged = _uint8(ALPHA * _uint8(x, X_SCALE) @ (weight + a @ b) + BIAS, Y_SCALE)
    np.testing.assert_allclose(_run(folded, x), merged, rtol=0, atol=2 * Y_SCALE)
