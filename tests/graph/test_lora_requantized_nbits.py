"""``runtime_adapter_model(apply="weights")`` over ``MatMulNBits``: the 4-bit blocks of
``W + s A B`` quantized and packed again at run time are the codes, scales and zero points
``merge_lora(quantized="requantize")`` writes with numpy, and onnxruntime runs the deployed
``MatMulNBits`` over them (no branch beside)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from tests.graph.test_lora_runtime import _outputs, _trained, _with_adapters

N, BLOCK = 6, 16
RNG = np.random.default_rng(3)


def _nbits(k: int, zero_points: bool) -> onnx.ModelProto:
    """``y = x W`` with ``W^T`` as 4-bit codes in blocks of ``BLOCK`` along ``k`` (padded to
    whole blocks), one scale a block, and packed zero points where ``zero_points``."""
    blocks = -(-k // BLOCK)
    codes = RNG.integers(0, 16, (N, blocks * BLOCK)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(N, blocks, BLOCK // 2)
    initializers = [
        numpy_helper.from_array(packed, "q"),
        numpy_helper.from_array((RNG.random(N * blocks) * 0.1 + 0.01).astype(np.float32), "s"),
    ]
    inputs = ["x", "q", "s"]
    if zero_points:
        width = -(-blocks // 2) * 2
        zeros = RNG.integers(0, 16, (N, width)).astype(np.uint8)
        initializers.append(numpy_helper.from_array(zeros[:, 0::2] | (zeros[:, 1::2] << 4), "z"))
        inputs.append("z")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["y"],
        "product",
        domain="com.microsoft",
        K=k,
        N=N,
        bits=4,
        block_size=BLOCK,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize(("k", "zero_points"), [(32, False), (40, True), (40, False)])
def test_four_bit_weights_requantized_per_run_match_the_merge(k, zero_points):
    deployed = _nbits(k, zero_points)
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    adapters = _trained(adapted)
    base = runtime_adapter_model(deployed, adapted, apply="weights")
    (product,) = [n for n in base.graph.node if n.op_type == "MatMulNBits"]
    assert [n.op_type for n in base.graph.node if "x" in n.input] == ["MatMulNBits"]
    x = RNG.standard_normal((5, k)).astype(np.float32)
    got = _outputs(base, {"x": x, **adapters}, [*product.input[1:], "y"])
    merged = merge_lora(_with_adapters(adapted, adapters), quantized="requantize")
    want = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    np.testing.assert_array_equal(got[0], want["q"])
    assert not np.array_equal(got[0], numpy_helper.to_array(deployed.graph.initializer[0]))
    np.testing.assert_allclose(got[1], want["s"], rtol=1e-6)
    if zero_points:
        np.testing.assert_array_equal(got[2], want["z"])
    y = _outputs(merged, {"x": x}, ["y"])[0]
    np.testing.assert_allclose(got[-1], y, rtol=1e-5, atol=1e-5)


def test_four_bit_weights_stay_one_kernel(tmp_path):
    """onnxruntime's optimized graph keeps one ``MatMulNBits`` reading codes computed per
    run, and no float product of ``x`` beside it."""
    deployed = _nbits(32, True)
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply="weights")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(base.SerializeToString(), options, providers=["CPUExecutionProvider"])
    nodes = onnx.load(options.optimized_model_filepath).graph.node
    (product,) = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert product.input[1] != "q"
    assert [n.op_type for n in nodes if "x" in n.input] == ["MatMulNBits"]


def test_four_bit_codes_another_node_reads_keep_the_branch():
    """Codes read by two ``MatMulNBits`` are not re-quantized per product: a branch each."""
    deployed = _nbits(32, False)
    twin = onnx.helper.make_node(
        "MatMulNBits",
        ["x", "q", "s"],
        ["y2"],
        "twin",
        domain="com.microsoft",
        K=32,
        N=N,
        bits=4,
        block_size=BLOCK,
    )
    deployed.graph.node.append(twin)
    deployed.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [None, N]))
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply="weights")
    assert sum(n.op_type == "MatMulNBits" and n.input[1] == "q" for n in base.graph.node) == 2
