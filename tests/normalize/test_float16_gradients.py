"""float16 gradient graphs that onnxruntime's CPU provider runs: the scatter-adds of the
Gather family's gradients are computed in float32 there (no float16 kernel); LoRA adapters
over a float16 weight are float32, as the loss of a model with float32 outputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative
from tests.normalize.kernels import run

RNG = np.random.default_rng(5)


def _gather_model(op: str, indices: np.ndarray, opset: int = 17, **attrs):
    graph = helper.make_graph(
        [helper.make_node(op, ["data", "idx"], ["y"], **attrs)],
        op,
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT16, [6, 4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, list(indices.shape)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize(
    ("op", "indices", "attrs"),
    [
        ("Gather", np.array([[0, 2], [2, 5]]), {}),
        ("Gather", np.array([1, 1, 3]), {"axis": 1}),
        ("GatherND", np.array([[0], [0], [4]]), {}),
        ("GatherElements", np.array([[0, 1, 1, 3], [5, 5, 0, 2]]), {}),
    ],
)
def test_gather_family_gradient_in_float16(op, indices, attrs):
    data = RNG.standard_normal((6, 4)).astype(np.float16)
    model = _gather_model(op, indices, **attrs)
    y = run(model, {"data": data, "idx": indices})[0]
    seed = RNG.standard_normal(y.shape).astype(np.float16)
    gradient = onnx_derivative(model, inputs=["data"], weights=[])
    got = run(gradient, {"data": data, "idx": indices, "y_grad": seed})[0]
    assert got.dtype == np.float16
    expected = np.zeros((6, 4))
    if op == "Gather" and not attrs:
        np.add.at(expected, indices, seed.astype(np.float64))
    elif op == "Gather":
        np.add.at(expected.T, indices, np.moveaxis(seed.astype(np.float64), 1, 0))
    elif op == "GatherND":
        np.add.at(expected, indices[:, 0], seed.astype(np.float64))
    else:
        np.add.at(expected, (indices, np.arange(4)[None, :].repeat(2, 0)), seed.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2e-3, atol=2e-3)


def _float16_linear():
    w = (RNG.standard_normal((8, 3)) * 0.5).astype(np.float16)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
            helper.make_node("MatMul", ["x16", "w"], ["y16"]),
            helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT),
        ],
        "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [_tensor(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _tensor(value, name):
    from onnx import numpy_helper

    return numpy_helper.from_array(value, name)


def test_float32_adapters_over_a_float16_base(tmp_path):
    from onnx import numpy_helper

    from onnxgrad import add_lora, generate_artifacts, merge_lora

    model = _float16_linear()
    adapted = add_lora(model, rank=2)
    inits = {i.name: numpy_helper.to_array(i) for i in adapted.graph.initializer}
    a, b = inits["w_lora_A"], inits["w_lora_B"]
    assert a.dtype == b.dtype == np.float32 and inits["w"].dtype == np.float16
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(adapted, {"x": x})[0], run(model, {"x": x})[0])
    b = RNG.standard_normal(b.shape).astype(np.float32)
    seed = RNG.standard_normal((4, 3)).astype(np.float32)
    gradient = onnx_derivative(adapted, weights=["w_lora_A", "w_lora_B"], inputs=[])
    names = [o.name for o in gradient.graph.output]
    got = dict(zip(names, run(gradient, {"x": x, "y_grad": seed, "w_lora_A": a, "w_lora_B": b})))
    outer = x.astype(np.float64).T @ seed  # d<seed, x W'>/dW'
    np.testing.assert_allclose(got["w_lora_B_grad"], a.T @ outer, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(got["w_lora_A_grad"], outer @ b.T, rtol=2e-2, atol=2e-2)
    artifacts = generate_artifacts(adapted, artifact_directory=tmp_path / "artifacts")
    assert artifacts.directory.is_dir()
    merged = merge_lora(adapted)
    assert {i.name for i in merged.graph.initializer} == {"w"}
