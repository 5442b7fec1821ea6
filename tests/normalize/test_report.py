"""``info``'s account of onnxruntime's deployed operators: lowered and trained, frozen,
straight-through, or refused."""

from __future__ import annotations

import numpy as np

from onnxgrad.normalize import normalized_model
from onnxgrad.normalize.report import deployed_operator_lines, deployed_operators
from tests.normalize.kernels import one_node_model


def _lines(model):
    counts = deployed_operators(model)
    return deployed_operator_lines(counts, normalized_model(model))


def test_fused_operator_is_lowered_and_trained():
    x = np.zeros((1, 2, 4), np.float32)
    model, _ = one_node_model("FastGelu", [("x", x)])
    assert _lines(model)[1:] == [
        "  com.microsoft::FastGelu x1: lowered to standard ONNX and trained"
    ]


def test_quantized_weight_is_frozen():
    packed = np.zeros((3, 1, 8), np.uint8)
    scales = np.ones(3, np.float32)
    model, _ = one_node_model(
        "MatMulNBits",
        [("a", np.zeros((2, 16), np.float32)), ("b", packed), ("s", scales)],
        initializers=("b", "s"),
        K=16,
        N=3,
        bits=4,
        block_size=16,
    )
    (line,) = _lines(model)[1:]
    assert "MatMulNBits x1: lowered over its dequantized weight" in line and "frozen" in line


def test_operator_without_lowering_is_refused():
    model, _ = one_node_model("Inverse", [("x", np.eye(3, dtype=np.float32))])
    (line,) = _lines(model)[1:]
    assert line.startswith("  com.microsoft::Inverse x1: refused")


def test_standard_model_has_no_such_lines():
    model, _ = one_node_model("Relu", [("x", np.zeros(3, np.float32))], domain="")
    assert _lines(model) == []
