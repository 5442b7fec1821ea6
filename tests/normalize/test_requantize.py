"""merge_lora(quantized="requantize"): a trained QLoRA adapter folded into its base and the
base quantized again in its own format. The new weight is read back with numpy's own
unpacking (independent of the code under test) and by onnxruntime's kernels."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.lora import lora_adapters
from tests.normalize.kernels import run

RNG = np.random.default_rng(11)
MS = "com.microsoft"


def _model(nodes, inits, k, n, imports):
    graph = helper.make_graph(
        nodes,
        "base",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(v, name) for name, v in inits.items()],
    )
    opsets = [helper.make_opsetid(domain, version) for domain, version in imports]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _nbits(k, n, block, zero_points):
    """MatMulNBits, 4 bits: ``(weight(codes, scales, zeros) -> W [K, N], model)``."""
    blocks = -(-k // block)
    codes = RNG.integers(0, 16, (n, blocks * block))
    scales = (RNG.random((n, blocks)) * 0.1 + 0.01).astype(np.float32)
    inits = {"w": _packed(codes).reshape(n, blocks, block // 2), "s": scales.reshape(-1)}
    inputs = ["x", "w", "s"]
    zeros = np.full((n, blocks), 8)
    if zero_points:
        zeros = RNG.integers(0, 16, (n, blocks))
        padded = np.zeros((n, -(-blocks // 2) * 2), dtype=np.int64)
        padded[:, :blocks] = zeros
        inits["z"] = _packed(padded).reshape(n, -1)
        inputs.append("z")
    node = helper.make_node(
        "MatMulNBits", inputs, ["y"], domain=MS, K=k, N=n, bits=4, block_size=block
    )
    model = _model([node], inits, k, n, [("", 17), (MS, 1)])
    return model


def _packed(codes):
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8)


def _nbits_weight(model):
    """``(W [K, N], per-element step [K, N])`` of the model's MatMulNBits, in numpy."""
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: a.i for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    blocks = -(-k // block)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    packed = inits[node.input[1]].reshape(-1).astype(np.int64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block)
    scales = inits[node.input[2]].reshape(n, blocks, 1).astype(np.float64)
    zeros = np.full((n, blocks), 8)
    if len(node.input) > 3:
        raw = inits[node.input[3]].reshape(-1).astype(np.int64)
        zeros = np.stack([raw & 15, raw >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    weight = ((codes - zeros[..., None]) * scales).reshape(n, -1)[:, :k].T
    step = np.broadcast_to(scales, codes.shape).reshape(n, -1)[:, :k].T
    return weight, step


def _dequantize_linear(k, n, per_axis, signed):
    """``DequantizeLinear(q [K, N]) -> MatMul``: per tensor or per output column, int8
    symmetric (zero points 0) or uint8 asymmetric."""
    dtype = np.int8 if signed else np.uint8
    info = np.iinfo(dtype)
    size = n if per_axis else 1
    shape = (n,) if per_axis else ()
    scale = (RNG.random(size) * 0.02 + 0.005).astype(np.float32).reshape(shape)
    zero = np.zeros(shape, dtype) if signed else RNG.integers(90, 160, shape).astype(dtype)
    inits = {
        "q": RNG.integers(info.min, info.max + 1, (k, n)).astype(dtype),
        "qs": scale,
        "qz": zero,
    }
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "qs", "qz"], ["w"], axis=1),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    return _model(nodes, inits, k, n, [("", 17)])


def _dequantized(model):
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    scale = inits["qs"].astype(np.float64)
    weight = (inits["q"].astype(np.float64) - inits["qz"]) * scale
    return weight, np.broadcast_to(scale, weight.shape), inits


def _trained(model):
    """``model`` with a rank-2 adapter whose B is random: ``(adapted, update s A B)``."""
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    inits = {i.name: i for i in adapted.graph.initializer}
    a = numpy_helper.to_array(inits[adapter["a"]]).astype(np.float64)
    b = (RNG.standard_normal(tuple(inits[adapter["b"]].dims)) * 0.1).astype(np.float32)
    inits[adapter["b"]].CopyFrom(numpy_helper.from_array(b, adapter["b"]))
    return adapted, adapter["scale"] * a @ b.astype(np.float64)


@pytest.mark.parametrize(
    ("k", "block", "zero_points"), [(32, 16, False), (40, 16, True), (64, 32, True)]
)
def test_matmul_nbits_requantized_in_its_own_blocks(k, block, zero_points):
    n = 6
    model = _nbits(k, n, block, zero_points)
    base, _ = _nbits_weight(model)
    adapted, update = _trained(model)
    merged = merge_lora(adapted, quantized="requantize")
    assert [node.op_type for node in merged.graph.node] == ["MatMulNBits"]
    assert lora_adapters(merged) == []
    (node,) = merged.graph.node
    assert list(node.input) == list(model.graph.node[0].input)
    assert {a.name: a.i for a in node.attribute} == {
        a.name: a.i for a in model.graph.node[0].attribute
    }
    weight, step = _nbits_weight(merged)
    assert np.all(np.abs(weight - (base + update)) <= 0.5 * step + 1e-7)
    x = RNG.standard_normal((5, k)).astype(np.float32)
    got = run(merged, {"x": x})[0]  # onnxruntime's MatMulNBits kernel
    np.testing.assert_allclose(got, x @ weight, rtol=1e-4, atol=1e-4)
    separate = run(merge_lora(adapted), {"x": x})[0]
    np.testing.assert_allclose(separate, x @ (base + update), rtol=1e-4, atol=1e-4)
    bound = np.abs(x) @ (0.5 * step)
    assert np.all(np.abs(got - separate) <= bound + 1e-4)


@pytest.mark.parametrize("per_axis", [False, True], ids=["per_tensor", "per_column"])
@pytest.mark.parametrize("signed", [True, False], ids=["int8_symmetric", "uint8_asymmetric"])
def test_dequantize_linear_weight_requantized_in_its_layout(per_axis, signed):
    k, n = 24, 5
    model = _dequantize_linear(k, n, per_axis, signed)
    base, _, before = _dequantized(model)
    adapted, update = _trained(model)
    merged = merge_lora(adapted, quantized="requantize")
    assert lora_adapters(merged) == []
    weight, step, after = _dequantized(merged)
    for name in ("q", "qs", "qz"):
        assert after[name].dtype == before[name].dtype
        assert after[name].shape == before[name].shape
    if signed:
        np.testing.assert_array_equal(after["qz"], 0)
    assert np.all(np.abs(weight - (base + update)) <= 0.5 * step + 1e-7)
    x = RNG.standard_normal((3, k)).astype(np.float32)
    got = run(merged, {"x": x})[0]
    np.testing.assert_allclose(got, x @ weight, rtol=1e-4, atol=1e-4)
    separate = run(merge_lora(adapted), {"x": x})[0]
    assert np.all(np.abs(got - separate) <= np.abs(x) @ (0.5 * step) + 1e-4)


def test_quantized_must_be_keep_or_requantize():
    adapted, _ = _trained(_dequantize_linear(8, 3, False, True))
    with pytest.raises(ValueError, match="'keep' or 'requantize'"):
        merge_lora(adapted, quantized="fold")


def test_a_scale_shared_with_another_weight_is_refused():
    k, n = 8, 3
    inits = {
        "q": RNG.integers(-128, 128, (k, n)).astype(np.int8),
        "p": RNG.integers(-128, 128, (n, n)).astype(np.int8),
        "qs": np.array(0.01, np.float32),
    }
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "qs"], ["w"]),
        helper.make_node("DequantizeLinear", ["p", "qs"], ["v"]),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("MatMul", ["h", "v"], ["y"]),
    ]
    adapted = add_lora(_model(nodes, inits, k, n, [("", 17)]), weights=["q"], rank=1)
    with pytest.raises(ValueError, match=r"weight 'q'.*\['qs'\] are also read by"):
        merge_lora(adapted, quantized="requantize")
    assert lora_adapters(merge_lora(adapted))  # kept separate, as by default


def test_a_matmul_nbits_node_disagreeing_with_its_codes_is_refused():
    adapted, _ = _trained(_nbits(32, 6, 16, False))
    (node,) = [n for n in adapted.graph.node if n.op_type == "MatMulNBits"]
    (bits,) = [a for a in node.attribute if a.name == "bits"]
    bits.i = 2  # the packed codes hold 4-bit values
    with pytest.raises(ValueError, match="MatMulNBits node reading weight 'w' disagrees"):
        merge_lora(adapted, quantized="requantize")


def test_a_weight_stored_transposed_is_requantized_in_its_storage_layout():
    """``DequantizeLinear(q [N, K], axis=0) -> Transpose -> MatMul``: the update, shaped as
    the ``[K, N]`` value, is read back in ``q``'s layout, per row of ``q``."""
    k, n = 12, 4
    scale = (RNG.random(n) * 0.02 + 0.005).astype(np.float32)
    inits = {
        "q": RNG.integers(-128, 128, (n, k)).astype(np.int8),
        "qs": scale,
        "qz": np.zeros(n, np.int8),
    }
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "qs", "qz"], ["wt"], axis=0),
        helper.make_node("Transpose", ["wt"], ["w"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    model = _model(nodes, inits, k, n, [("", 17)])
    adapted, update = _trained(model)
    merged = merge_lora(adapted, quantized="requantize")
    after = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    base = (inits["q"].astype(np.float64) * scale[:, None]).T
    weight = (after["q"].astype(np.float64) * after["qs"][:, None]).T
    step = np.broadcast_to(after["qs"][None, :], weight.shape)
    assert np.all(np.abs(weight - (base + update)) <= 0.5 * step + 1e-7)
    x = RNG.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(run(merged, {"x": x})[0], x @ weight, rtol=1e-4, atol=1e-4)


def _symmetric_weight(k, n, per_axis, dtype, restricted):
    """``DequantizeLinear(q) -> MatMul`` with zero points at the middle of the codes, whose
    lowest code is ``2 z - q_max`` (a restricted range, as onnxruntime's symmetric int8
    weights ``[-127, 127]``) or the type's, in every column; the highest stays below
    ``q_max`` (the negative end sets the scale)."""
    info = np.iinfo(dtype)
    middle = 0 if info.min < 0 else (info.max + 1) // 2
    low = 2 * middle - info.max if restricted else info.min
    model = _dequantize_linear(k, n, per_axis, signed=True)
    inits = {i.name: i for i in model.graph.initializer}
    codes = RNG.integers(low, info.max - 20, (k, n))
    codes[0] = low
    shape = tuple(inits["qz"].dims)
    inits["q"].CopyFrom(numpy_helper.from_array(codes.astype(dtype), "q"))
    inits["qz"].CopyFrom(numpy_helper.from_array(np.full(shape, middle, dtype), "qz"))
    return model


@pytest.mark.parametrize("restricted", [True, False], ids=["restricted", "full_range"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("per_axis", [False, True], ids=["per_tensor", "per_column"])
def test_requantizing_unchanged_symmetric_weights_keeps_their_codes(per_axis, dtype, restricted):
    """Adapters not yet trained (``B = 0``) add nothing: the requantized merge and the
    runtime model updating the weights per run give back the deployed codes and scales,
    whether the deployed quantizer used the type's lowest code or not."""
    from onnxgrad.graph.lora_runtime import runtime_adapter_model

    model = _symmetric_weight(16, 6, per_axis, dtype, restricted)
    adapted = add_lora(model, rank=2)
    merged = merge_lora(adapted, quantized="requantize")
    _, _, before = _dequantized(model)
    _, _, after = _dequantized(merged)
    for name in ("q", "qs", "qz"):
        np.testing.assert_array_equal(after[name], before[name])
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    runtime = runtime_adapter_model(model, adapted, apply="weights")
    np.testing.assert_array_equal(run(runtime, {"x": x})[0], run(model, {"x": x})[0])
