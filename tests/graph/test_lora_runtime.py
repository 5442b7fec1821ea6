"""runtime_adapter_model: the deployed model (a float MatMul and a 4-bit MatMulNBits kept
as they are) with LoRA branches whose matrices are overridable inputs; checked with numpy
against ``x (W + s A B)``, onnxruntime feeding the adapter by name."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, merge_lora
from onnxgrad.graph.lora_runtime import runtime_adapter_model
from onnxgrad.training.artifacts.onnx_adapter import load_onnx_adapter, save_onnx_adapter

K, N, BLOCK = 32, 6, 16
RNG = np.random.default_rng(0)


def _deployed() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """``y = (x W1) W2^T`` with ``W2`` stored as MatMulNBits codes; returns the model and
    the two float weights (``W2`` dequantized with numpy)."""
    w1 = RNG.standard_normal((K, K)).astype(np.float32)
    codes = RNG.integers(0, 16, (N, K)).astype(np.uint8)
    scales = (RNG.random(N * K // BLOCK) * 0.1).astype(np.float32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(N, K // BLOCK, BLOCK // 2)
    w2 = (codes.astype(np.float32) - 8).reshape(N, K // BLOCK, BLOCK)
    w2 = (w2 * scales.reshape(N, K // BLOCK, 1)).reshape(N, K)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node(
            "MatMulNBits",
            ["h", "q", "s"],
            ["y"],
            name="second",
            domain="com.microsoft",
            K=K,
            N=N,
            bits=4,
            block_size=BLOCK,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "deployed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(packed, "q"),
            numpy_helper.from_array(scales, "s"),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8), w1, w2


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def test_branches_compute_the_adapted_weights():
    deployed, w1, w2 = _deployed()
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    before = (deployed.SerializeToString(), adapted.SerializeToString())
    base = runtime_adapter_model(deployed, adapted)
    assert (deployed.SerializeToString(), adapted.SerializeToString()) == before
    assert {n.op_type for n in base.graph.node} >= {"MatMulNBits"}
    x = RNG.standard_normal((3, K)).astype(np.float32)
    np.testing.assert_allclose(_run(base, {"x": x}), x @ w1 @ w2.T, rtol=1e-4, atol=1e-4)

    trained = {
        name: RNG.standard_normal(shape).astype(np.float32)
        for name, shape in [
            ("w1_lora_A", (K, 2)),
            ("w1_lora_B", (2, K)),
            ("q_lora_A", (K, 2)),
            ("q_lora_B", (2, N)),
        ]
    }
    s = 3.0 / 2
    first = w1 + s * trained["w1_lora_A"] @ trained["w1_lora_B"]
    second = w2.T + s * trained["q_lora_A"] @ trained["q_lora_B"]
    got = _run(base, {"x": x, **trained})
    np.testing.assert_allclose(got, x @ first @ second, rtol=1e-4, atol=1e-3)


def test_an_adapter_the_deployed_model_does_not_read_is_named():
    deployed, _, _ = _deployed()
    adapted = add_lora(deployed, rank=2)
    other = onnx.ModelProto()
    other.CopyFrom(deployed)
    other.graph.node[0].input[1] = "w1_renamed"
    other.graph.initializer[0].name = "w1_renamed"
    with pytest.raises(ValueError, match=r"'w1'.*reads that weight in no MatMul"):
        runtime_adapter_model(other, adapted)


def test_onnx_adapter_round_trip(tmp_path):
    values = {"a": RNG.standard_normal((4, 2)).astype(np.float32), "b": np.zeros((2, 3), "f")}
    if not hasattr(ort, "AdapterFormat"):
        with pytest.raises(RuntimeError, match="no AdapterFormat"):
            save_onnx_adapter(values, tmp_path / "x.onnx_adapter")
        return
    path = save_onnx_adapter(values, tmp_path / "x.onnx_adapter")
    read = load_onnx_adapter(path)
    assert sorted(read) == ["a", "b"]
    for name, value in values.items():
        np.testing.assert_array_equal(read[name], value)


def test_a_weight_read_twice_gets_a_branch_at_each_product():
    w = RNG.standard_normal((K, K)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, K])],
        [numpy_helper.from_array(w, "w")],
    )
    deployed = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2))
    a, b = RNG.standard_normal((K, 2)).astype("f"), RNG.standard_normal((2, K)).astype("f")
    x = RNG.standard_normal((3, K)).astype(np.float32)
    adapted = w + a @ b
    got = _run(base, {"x": x, "w_lora_A": a, "w_lora_B": b})
    np.testing.assert_allclose(got, x @ adapted @ adapted, rtol=1e-4, atol=1e-2)


def test_a_weight_other_nodes_read_too_is_updated_for_all_of_them():
    """An embedding ``E`` tied to a product, ``y = E[ids] E``, and a convolution kernel:
    every reader gets ``W + s reshape(A B)`` (a branch beside the ``MatMul`` alone would
    leave the ``Gather`` and the ``Conv`` reading the untrained weight)."""
    e = RNG.standard_normal((K, K)).astype(np.float32)
    kernel = RNG.standard_normal((3, 2, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["e", "ids"], ["h"], name="lookup"),
        helper.make_node("MatMul", ["h", "e"], ["y"], name="head"),
        helper.make_node("Conv", ["signal", "kernel"], ["z"], name="conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("signal", TensorProto.FLOAT, [1, 2, 8]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, K]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, 6]),
        ],
        [numpy_helper.from_array(e, "e"), numpy_helper.from_array(kernel, "kernel")],
    )
    deployed = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2))
    trained = {
        "e_lora_A": RNG.standard_normal((K, 2)).astype(np.float32),
        "e_lora_B": RNG.standard_normal((2, K)).astype(np.float32),
        "kernel_lora_A": RNG.standard_normal((3, 2)).astype(np.float32),
        "kernel_lora_B": RNG.standard_normal((2, 6)).astype(np.float32),
    }
    ids = np.array([3, 0, 7], dtype=np.int64)
    signal = RNG.standard_normal((1, 2, 8)).astype(np.float32)
    session = ort.InferenceSession(base.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(None, {"ids": ids, "signal": signal, **trained})
    tied = e + trained["e_lora_A"] @ trained["e_lora_B"]
    np.testing.assert_allclose(y, tied[ids] @ tied, rtol=1e-4, atol=1e-3)
    moved = kernel + (trained["kernel_lora_A"] @ trained["kernel_lora_B"]).reshape(3, 2, 3)
    want = np.stack([np.einsum("ck,ctk->t", moved[o], _windows(signal[0])) for o in range(3)])
    np.testing.assert_allclose(z[0], want, rtol=1e-4, atol=1e-4)


def _windows(signal: np.ndarray, width: int = 3) -> np.ndarray:
    """``[channels, positions, width]``: the valid sliding windows of ``signal``."""
    positions = signal.shape[-1] - width + 1
    return np.stack([signal[:, t : t + width] for t in range(positions)], axis=1)


def _qdq_deployed(zero_point: int) -> onnx.ModelProto:
    """``y = DQ(Q(DQ(Q(x)) DQ(q2, per column) ))`` after a float ``MatMul`` by ``w1``: the
    QDQ pattern onnxruntime fuses into ``QLinearMatMul``; ``zero_point`` 0 gives symmetric
    int8 codes, another an asymmetric uint8 base."""
    codes_type = np.int8 if zero_point == 0 else np.uint8
    low, high = (-127, 128) if zero_point == 0 else (0, 256)
    initializers = {
        "w1": RNG.standard_normal((K, K)).astype(np.float32),
        "q2": RNG.integers(low, high, (K, N)).astype(codes_type),
        "s2": (RNG.random(N) * 0.01 + 0.005).astype(np.float32),
        "z2": np.full(N, zero_point, codes_type),
        "sx": np.float32(0.05),
        "zx": np.uint8(128),
        "sy": np.float32(0.2),
        "zy": np.uint8(128),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("QuantizeLinear", ["h", "sx", "zx"], ["hq"], name="qh"),
        helper.make_node("DequantizeLinear", ["hq", "sx", "zx"], ["hd"], name="dqh"),
        helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["w2"], name="dqw", axis=1),
        helper.make_node("MatMul", ["hd", "w2"], ["m"], name="second"),
        helper.make_node("QuantizeLinear", ["m", "sy", "zy"], ["mq"], name="qm"),
        helper.make_node("DequantizeLinear", ["mq", "sy", "zy"], ["y"], name="dqm"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _with_adapters(adapted: onnx.ModelProto, trained: dict) -> onnx.ModelProto:
    result = onnx.ModelProto()
    result.CopyFrom(adapted)
    for init in result.graph.initializer:
        if init.name in trained:
            init.CopyFrom(numpy_helper.from_array(trained[init.name], init.name))
    return result


def _trained(adapted: onnx.ModelProto) -> dict:
    return {
        init.name: RNG.standard_normal(tuple(init.dims)).astype(np.float32) * 0.3
        for init in adapted.graph.initializer
        if "_lora_" in init.name
    }


def _outputs(model: onnx.ModelProto, feeds: dict, names: list[str]) -> list[np.ndarray]:
    """``names`` (graph outputs or intermediate values) computed by onnxruntime."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    declared = {o.name for o in copy.graph.output}
    copy.graph.output.extend(
        helper.make_empty_tensor_value_info(n) for n in names if n not in declared
    )
    session = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


@pytest.mark.parametrize("zero_point", [0, 3])
def test_weights_applied_per_run_match_the_requantized_merge(zero_point):
    """``apply="weights"``: the float weight is ``W1 + s A B`` (numpy), the QDQ codes, scales
    and zero points the deployed ``DequantizeLinear`` reads are the ones
    ``merge_lora(quantized="requantize")`` writes for the same adapters."""
    deployed = _qdq_deployed(zero_point)
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    trained = _trained(adapted)
    base = runtime_adapter_model(deployed, adapted, apply="weights")
    assert sorted(n.op_type for n in base.graph.node if n.name in {"first", "second"}) == [
        "MatMul",
        "MatMul",
    ]
    dequantize = next(n for n in base.graph.node if n.name == "dqw")
    x = RNG.standard_normal((5, K)).astype(np.float32)
    feeds = {"x": x, **trained}
    got = _outputs(base, feeds, ["h", *dequantize.input])
    merged = merge_lora(_with_adapters(adapted, trained), quantized="requantize")
    inits = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    s = 3.0 / 2
    w1 = numpy_helper.to_array(deployed.graph.initializer[0]).astype(np.float64)
    want_h = x @ (w1 + s * trained["w1_lora_A"].astype(np.float64) @ trained["w1_lora_B"])
    np.testing.assert_allclose(got[0], want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], inits["q2"])
    np.testing.assert_allclose(got[2], inits["s2"], rtol=1e-6)
    np.testing.assert_array_equal(got[3], inits["z2"])
    assert not np.array_equal(inits["q2"], numpy_helper.to_array(deployed.graph.initializer[1]))
    y = _outputs(base, feeds, ["y"])[0]
    np.testing.assert_allclose(y, _outputs(merged, {"x": x}, ["y"])[0], rtol=1e-5, atol=1e-5)


def test_weights_applied_per_run_keep_the_fused_product(tmp_path):
    """onnxruntime still runs the QDQ product as one ``QLinearMatMul`` reading the codes
    computed per run."""
    deployed = _qdq_deployed(0)
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply="weights")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(base.SerializeToString(), options, providers=["CPUExecutionProvider"])
    nodes = onnx.load(options.optimized_model_filepath).graph.node
    (product,) = [n for n in nodes if n.op_type == "QLinearMatMul"]
    assert product.input[3] != "q2"  # the codes computed per run
    assert [n.op_type for n in nodes if "x" in n.input] == ["MatMul"]  # no branch beside
    assert [n.op_type for n in nodes if "h" in n.input] == ["QuantizeLinear"]


@pytest.mark.parametrize(("apply", "error"), [("weight", ValueError), (1, TypeError)])
def test_a_bad_apply_is_refused(apply, error):
    deployed, _, _ = _deployed()
    with pytest.raises(error, match="apply must be"):
        runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply=apply)


def _int8_deployed() -> onnx.ModelProto:
    """``quantize_dynamic``'s product: ``Cast(MatMulInteger(DynamicQuantizeLinear(x), q))``
    times the activation's and the weight's per-column scales."""
    initializers = {
        "q": RNG.integers(-127, 128, (K, N)).astype(np.int8),
        "q_scale": (RNG.random(N) * 0.01 + 0.005).astype(np.float32),
        "q_zero": np.zeros(N, np.int8),
    }
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dq"),
        helper.make_node("MatMulInteger", ["xq", "q", "xz", "q_zero"], ["p"], name="product"),
        helper.make_node("Cast", ["p"], ["pf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "q_scale"], ["scales"], name="scales"),
        helper.make_node("Mul", ["pf", "scales"], ["y"], name="scaled"),
    ]
    graph = helper.make_graph(
        nodes,
        "int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_int8_codes_are_requantized_per_run(tmp_path):
    """``apply="weights"`` over ``quantize_dynamic``'s ``MatMulInteger``: the codes and the
    scales it reads are the requantized merge's, and onnxruntime still fuses the chain."""
    deployed = _int8_deployed()
    adapted = add_lora(deployed, rank=2, alpha=3.0)
    trained = _trained(adapted)
    base = runtime_adapter_model(deployed, adapted, apply="weights")
    product = next(n for n in base.graph.node if n.name == "product")
    scales = next(n for n in base.graph.node if n.name == "scales")
    x = RNG.standard_normal((5, K)).astype(np.float32)
    feeds = {"x": x, **trained}
    codes, scale, y = _outputs(base, feeds, [product.input[1], scales.input[1], "y"])
    merged = merge_lora(_with_adapters(adapted, trained), quantized="requantize")
    inits = {i.name: numpy_helper.to_array(i) for i in merged.graph.initializer}
    np.testing.assert_array_equal(codes, inits["q"])
    assert not np.array_equal(codes, numpy_helper.to_array(deployed.graph.initializer[0]))
    np.testing.assert_allclose(scale, inits["q_scale"], rtol=1e-6)
    np.testing.assert_allclose(y, _outputs(merged, {"x": x}, ["y"])[0], rtol=1e-5, atol=1e-5)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(base.SerializeToString(), options, providers=["CPUExecutionProvider"])
    kernels = {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}
    assert kernels & {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
    assert "MatMulInteger" not in kernels


def test_weights_applied_per_run_over_a_transposed_qdq_gemm():
    """A QDQ ``Gemm`` with ``transB``, per-channel codes ``N x K`` and ``alpha``: the update
    ``s A B`` (in the ``N x K`` layout the ``Gemm`` reads) quantized again gives the
    requantized merge's outputs."""
    from tests.graph.test_qdq_gemm_products import _qdq_gemm

    deployed = _qdq_gemm()
    deployed.ir_version = 8  # what onnxruntime 1.19 loads
    adapted = add_lora(deployed, rank=2)
    trained = _trained(adapted)
    base = runtime_adapter_model(deployed, adapted, apply="weights")
    merged = merge_lora(_with_adapters(adapted, trained), quantized="requantize")
    x = RNG.standard_normal((5, deployed.graph.input[0].type.tensor_type.shape.dim[1].dim_value))
    x = x.astype(np.float32)
    got = _outputs(base, {"x": x, **trained}, ["y"])[0]
    want = _outputs(merged, {"x": x}, ["y"])[0]
    assert np.abs(want - _outputs(deployed, {"x": x}, ["y"])[0]).max() > 0.1
    np.testing.assert_array_equal(got, want)


def test_four_bit_qdq_codes_keep_the_branch():
    """``apply="weights"`` over int4 QDQ codes (no 4-bit quantization built per run): the
    ``DequantizeLinear`` still reads the deployed codes and a branch reads the activation."""
    codes = helper.make_tensor("q", TensorProto.INT4, (K, N), RNG.integers(-8, 8, K * N))
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dqw"),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="product"),
    ]
    graph = helper.make_graph(
        nodes,
        "int4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [codes, numpy_helper.from_array(np.float32(0.1), "s")],
    )
    deployed = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    base = runtime_adapter_model(deployed, add_lora(deployed, rank=2), apply="weights")
    dequantize = next(n for n in base.graph.node if n.name == "dqw")
    assert list(dequantize.input) == ["q", "s"]
    assert sorted(n.op_type for n in base.graph.node if "x" in n.input) == ["MatMul", "MatMul"]
