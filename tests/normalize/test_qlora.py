"""LoRA adapters over frozen quantized weights (QLoRA): MatMulNBits and QLinearMatMul."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, get_train_initializer, merge_lora, onnx_derivative
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import numerical_vjp
from tests.normalize.integer_products import exact_matmul, requantize, saturation_slack
from tests.normalize.kernels import assert_within, run

RNG = np.random.default_rng(6)
K, N = 32, 6


def _nbits_model():
    packed = RNG.integers(0, 256, (N, K // 16, 8), dtype=np.uint8)
    scales = (RNG.random(N * K // 16) * 0.1 + 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "w", "s"],
        ["y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=4,
        block_size=16,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")],
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=8), "w"


def _qlinear_model():
    w = RNG.integers(-128, 128, (K, N), dtype=np.int8)
    inits = {
        "as": np.array(0.02, np.float32),
        "az": np.array(128, np.uint8),
        "w": w,
        "ws": np.array(0.01, np.float32),
        "wz": np.array(0, np.int8),
        "ys": np.array(0.05, np.float32),
        "yz": np.array(128, np.uint8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
        helper.make_node("QLinearMatMul", ["xq", "as", "az", "w", "ws", "wz", "ys", "yz"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qlinear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), "w"


def _specified_qlinear_output(model, x) -> tuple[np.ndarray, np.ndarray]:
    """``_qlinear_model``'s output as its operators' specification defines it, in exact integer
    arithmetic, and the error onnxruntime's u8s8 kernel may add to it on a CPU without VNNI,
    both in the output's units."""
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    codes = np.clip(np.rint(x / inits["as"]) + inits["az"], 0, 255).astype(np.uint8)
    weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    multiplier = inits["as"] * inits["ws"] / inits["ys"]
    product = exact_matmul(codes, weight, inits["az"], inits["wz"])
    spec = (requantize(product, multiplier, inits["yz"]) - inits["yz"]) * inits["ys"]
    return spec, saturation_slack(codes, weight) * multiplier * inits["ys"]


def _with_values(model, values):
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return model


@pytest.mark.parametrize(
    "make", [_nbits_model, _qlinear_model], ids=["MatMulNBits", "QLinearMatMul"]
)
def test_adapters_over_a_frozen_quantized_weight(make):
    model, weight = make()
    x = (RNG.standard_normal((3, K)) * 2).astype(np.float32)
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    assert adapter["weight"] == weight
    inits = {i.name: i for i in adapted.graph.initializer}
    assert inits[weight].data_type in (TensorProto.UINT8, TensorProto.INT8)
    assert sorted(get_train_initializer(adapted)) == sorted([adapter["a"], adapter["b"]])
    if make is _nbits_model:
        np.testing.assert_allclose(run(adapted, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)
    else:  # the integer product: the lowering within a tie's rounding of the specification,
        # onnxruntime's kernel (the adapted model keeps it) within its CPU path's error too
        spec, slack = _specified_qlinear_output(model, x)
        step = numpy_helper.to_array(inits["ys"]) * 1.0001
        assert_within(run(normalized_model(model), {"x": x})[0], spec, step, "the lowering")
        assert_within(run(model, {"x": x})[0], spec, step + slack, "onnxruntime's kernels")
        assert_within(run(adapted, {"x": x})[0], spec, step + slack, "the adapted model")

    a = numpy_helper.to_array(inits[adapter["a"]])
    b = RNG.standard_normal((2, N)).astype(np.float32)
    trained = _with_values(adapted, {adapter["b"]: b})
    dense = x @ (a @ b) * adapter["scale"]
    if make is _nbits_model:
        np.testing.assert_allclose(
            run(trained, {"x": x})[0], run(model, {"x": x})[0] + dense, rtol=1e-4, atol=1e-4
        )
    else:  # the branch added to the dequantized product, beside the same integer kernel
        branch = run(trained, {"x": x})[0] - run(model, {"x": x})[0]
        np.testing.assert_allclose(branch, dense, rtol=1e-4, atol=1e-4)
        tolerance = step + slack + 1e-5 * np.abs(dense)
        assert_within(run(trained, {"x": x})[0], spec + dense, tolerance, "the trained model")
    seed = RNG.standard_normal((3, N)).astype(np.float32)
    gradient = onnx_derivative(trained, weights=[adapter["a"], adapter["b"]], inputs=[])
    names = [o.name for o in gradient.graph.output]
    got = dict(
        zip(names, run(gradient, {"x": x, "y_grad": seed, adapter["a"]: a, adapter["b"]: b}))
    )
    values = {adapter["a"]: a, adapter["b"]: b}

    def function(point):
        cast = {k: np.asarray(v, dtype=np.float32) for k, v in point.items()}
        return [run(_with_values(trained, cast), {"x": x})[0].astype(np.float64)]

    if make is _nbits_model:
        expected = numerical_vjp(function, values, list(values), [seed], eps=1e-3)
        for name in values:
            np.testing.assert_allclose(got[f"{name}_grad"], expected[name], rtol=5e-3, atol=5e-3)
    else:  # quantized output: straight-through, the float product's gradient masked in range
        assert all(np.isfinite(got[f"{name}_grad"]).all() for name in values)
        assert np.abs(got[f"{adapter['b']}_grad"]).sum() > 0
    merged = merge_lora(trained)
    assert lora_adapters(merged) == [adapter]
    np.testing.assert_array_equal(run(merged, {"x": x})[0], run(trained, {"x": x})[0])
    # folded and quantized again: the deployed operators (the values: test_requantize.py)
    requantized = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in requantized.graph.node] == [n.op_type for n in model.graph.node]
    assert not lora_adapters(requantized)


def test_qlora_artifacts_train_in_plain_onnxruntime_steps(tmp_path):
    """generate_artifacts trains only the adapters of a 4-bit model; plain onnxruntime steps
    lower the loss; merge_checkpoint keeps the adapters over the untouched 4-bit base or,
    with "requantize", folds them into a MatMulNBits node again."""
    import onnxruntime as ort

    from onnxgrad.training import (
        Checkpoint,
        generate_artifacts,
        load_train_step,
        merge_checkpoint,
        save_checkpoint,
    )

    model, weight = _nbits_model()
    adapted = add_lora(model, rank=2)
    art = generate_artifacts(adapted, optimizer="adam", artifact_directory=tmp_path / "art")
    assert sorted(art.checkpoint.weights) == [f"{weight}_lora_A", f"{weight}_lora_B"]
    step = load_train_step(art.directory)
    x = RNG.standard_normal((64, K)).astype(np.float32)
    target = run(model, {"x": x})[0] + x @ RNG.standard_normal((K, N)).astype(np.float32) * 0.1
    session = ort.InferenceSession(
        str(art.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    losses = []
    for _ in range(60):
        feeds = {"x": x, "label": target, "learning_rate": np.array(0.05, np.float32), **values}
        loss, *new = session.run([step.loss, *step.new_weights, *step.new_state], feeds)
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert losses[-1] < 0.5 * losses[0]
    trained = Checkpoint({w: values[w] for w in step.weights}, {s: values[s] for s in step.state})
    save_checkpoint(trained, tmp_path / "trained.json")
    merged = merge_checkpoint(art.directory, tmp_path / "trained.json")
    packed = {i.name: i for i in merged.graph.initializer}[weight]
    assert packed.data_type == TensorProto.UINT8
    before = np.mean((run(model, {"x": x})[0] - target) ** 2)
    assert np.mean((run(merged, {"x": x})[0] - target) ** 2) < 0.5 * before
    requantized = merge_checkpoint(art.directory, tmp_path / "trained.json", "requantize")
    assert [n.op_type for n in requantized.graph.node] == ["MatMulNBits"]
    # quantized again at 4 bits: the gain survives, up to the new rounding of W + s A B
    assert np.mean((run(requantized, {"x": x})[0] - target) ** 2) < 0.6 * before


def _qdq_model():
    """``x -> Q -> DQ -> MatMul(., DQ(w)) -> Q -> DQ -> y``: the pattern onnxruntime fuses
    into ``QLinearMatMul`` (uint8 activations, int8 weights within +-64: no pair of products
    saturates int16, so its kernel is exact on every CPU)."""
    inits = {
        "xs": np.array(0.02, np.float32),
        "xz": np.array(128, np.uint8),
        "w": RNG.integers(-64, 64, (K, N), dtype=np.int8),
        "ws": np.array(0.01, np.float32),
        "wz": np.array(0, np.int8),
        "ys": np.array(0.05, np.float32),
        "yz": np.array(128, np.uint8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
        helper.make_node("MatMul", ["xd", "wd"], ["p"]),
        helper.make_node("QuantizeLinear", ["p", "ys", "yz"], ["pq"]),
        helper.make_node("DequantizeLinear", ["pq", "ys", "yz"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_qdq_branch_leaves_the_product_to_onnxruntimes_fusion(tmp_path):
    """The branch reads the float activation before its ``QuantizeLinear`` and is added after
    the output's ``DequantizeLinear``, then quantized again with the output's scale:
    ``y' = DQ(Q(DQ(Q(x W)) + s x A B))``. A second reader of the activation's
    ``DequantizeLinear``, or an ``Add`` between the ``MatMul`` and its ``QuantizeLinear``,
    would leave onnxruntime a float ``MatMul`` over dequantized weights."""
    import onnxruntime as ort

    model = _qdq_model()
    adapted = add_lora(model, rank=2, alpha=4)
    (adapter,) = lora_adapters(adapted)
    inits = {i.name: numpy_helper.to_array(i) for i in adapted.graph.initializer}
    b = RNG.standard_normal((2, N)).astype(np.float32) * 0.3
    trained = _with_values(adapted, {adapter["b"]: b})

    def fused(m, name):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
        return sorted(n.op_type for n in optimized.graph.node if n.op_type.startswith("QLinear"))

    assert fused(model, "deployed") == ["QLinearMatMul"]
    assert fused(trained, "trained") == ["QLinearMatMul"]

    x = (RNG.standard_normal((5, K)) * 1.5).astype(np.float32)
    f64 = {k: np.asarray(v, np.float64) for k, v in inits.items()}
    codes = np.clip(np.rint(x / f64["xs"]) + f64["xz"], 0, 255)
    product = exact_matmul(codes, inits["w"], f64["xz"], f64["wz"])
    y_codes = requantize(product, f64["xs"] * f64["ws"] / f64["ys"], f64["yz"])
    y = (y_codes - f64["yz"]) * f64["ys"]
    dense = adapter["scale"] * (x.astype(np.float64) @ f64[adapter["a"]] @ b)
    assert np.abs(dense).max() > 10 * f64["ys"]  # the branch moves the output many steps
    expected = (requantize(y + dense, 1 / f64["ys"], f64["yz"]) - f64["yz"]) * f64["ys"]
    step = f64["ys"] * 1.0001  # a tie's rounding (the kernel's fixed-point scale, float32)
    for level in ("disabled", "default"):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        if level == "disabled":
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(
            trained.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        assert_within(session.run(None, {"x": x})[0], expected, step, f"optimization {level}")
    requantized = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in requantized.graph.node] == [n.op_type for n in model.graph.node]


def _two_nbits_reading_one_x():
    """Two 4-bit products of one ``x`` (query and key, gate and up), then a third of their
    sum (another ``x``)."""
    inits, nodes = [], []
    for name, x, y in (("wq", "x", "q"), ("wk", "x", "k"), ("wo", "h", "y")):
        inits += [
            numpy_helper.from_array(RNG.integers(0, 256, (K, 2, 8), dtype=np.uint8), name),
            numpy_helper.from_array(
                (RNG.random(2 * K) * 0.1 + 0.01).astype(np.float32), f"{name}_s"
            ),
        ]
        attrs = {"K": K, "N": K, "bits": 4, "block_size": 16}
        nodes.append(
            helper.make_node(
                "MatMulNBits", [x, name, f"{name}_s"], [y], domain="com.microsoft", **attrs
            )
        )
        if y == "k":
            nodes.append(helper.make_node("Add", ["q", "k"], ["h"]))
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, K])],
        inits,
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=8)


def test_branches_reading_one_x_share_its_first_product():
    """``x [A_q | A_k]`` once, split into ``x A_q`` and ``x A_k``: the values and the
    adapters' gradients (float64 central differences of the model) are those of separate
    branches."""
    model = _two_nbits_reading_one_x()
    adapted = add_lora(model, rank=3, alpha=6)
    readers = [n.op_type for n in adapted.graph.node if "x" in n.input]
    assert sorted(readers) == ["MatMul", "MatMulNBits", "MatMulNBits"], readers
    adapters = {a["weight"]: a for a in lora_adapters(adapted)}
    values = {a[k]: None for a in adapters.values() for k in ("a", "b")}
    inits = {i.name: numpy_helper.to_array(i) for i in adapted.graph.initializer}
    for name in values:
        values[name] = (
            inits[name]
            if name.endswith("_A")
            else RNG.standard_normal(inits[name].shape).astype(np.float32)
        )
    trained = _with_values(adapted, values)
    x = RNG.standard_normal((4, K)).astype(np.float32)

    def base(weight, inputs):  # the 4-bit product alone, by onnxruntime
        return run(_nbits_alone(model, weight), {"x": inputs})[0].astype(np.float64)

    def delta(weight, inputs):
        a = adapters[weight]
        return a["scale"] * (inputs.astype(np.float64) @ values[a["a"]] @ values[a["b"]])

    h = base("wq", x) + delta("wq", x) + base("wk", x) + delta("wk", x)
    expected = base("wo", h.astype(np.float32)) + delta("wo", h)
    np.testing.assert_allclose(run(trained, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)

    seed = RNG.standard_normal((4, K)).astype(np.float32)
    gradient = onnx_derivative(trained, weights=list(values), inputs=[])
    names = [o.name for o in gradient.graph.output]
    got = dict(zip(names, run(gradient, {"x": x, "y_grad": seed, **values})))

    def function(point):
        cast = {k: np.asarray(v, dtype=np.float32) for k, v in point.items()}
        return [run(_with_values(trained, cast), {"x": x})[0].astype(np.float64)]

    # y is affine in each single parameter: central differences are exact for any step, a
    # large one keeps float32 rounding out of them
    expected = numerical_vjp(function, values, list(values), [seed], eps=0.25)
    for name in values:
        np.testing.assert_allclose(got[f"{name}_grad"], expected[name], rtol=1e-3, atol=1e-3)
    merged = merge_lora(trained)  # kept beside: the shared nodes stay, then go together
    np.testing.assert_array_equal(run(merged, {"x": x})[0], run(trained, {"x": x})[0])
    requantized = merge_lora(trained, quantized="requantize")
    assert [n.op_type for n in requantized.graph.node] == [n.op_type for n in model.graph.node]


def _nbits_alone(model, weight):
    """The ``MatMulNBits`` of ``weight`` as a model of its own reading ``x``."""
    node = next(n for n in model.graph.node if n.input[1:2] == [weight])
    alone = helper.make_node(node.op_type, ["x", *node.input[1:]], ["y"], domain=node.domain)
    alone.attribute.extend(node.attribute)
    inits = [i for i in model.graph.initializer if i.name in node.input]
    graph = helper.make_graph(
        [alone],
        "alone",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, K])],
        inits,
    )
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=8)
