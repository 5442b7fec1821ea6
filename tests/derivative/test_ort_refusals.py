"""The ``ort`` backend refuses the builder cases known to be wrong, which the native engine
computes right (both checked against float64 finite differences), and checks its results."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.derivative.ort.checks import check_built_gradients, check_gradient_shapes
from tests.derivative.fd import onnx_numerical_vjp

F = TensorProto.FLOAT
rng = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _r(*shape):
    return rng.standard_normal(shape).astype(np.float32)


X4, X5, X2 = _r(2, 3, 6, 6), _r(1, 2, 4, 4, 4), _r(4, 5)
W = _r(4, 3, 2, 2)
Y4 = [("y", F, [None] * 4)]
CASES = {
    "BatchNormalization in inference mode": (
        _model(
            [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])],
            [("x", [2, 3, 6, 6])],
            Y4,
            [("s", _r(3) + 2), ("b", _r(3)), ("m", _r(3)), ("v", np.abs(_r(3)) + 0.5)],
            opset=15,
        ),
        {"x": X4},
    ),
    "AveragePool with dilations": (
        _model(
            [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], dilations=[2, 2])],
            [("x", [2, 3, 6, 6])],
            Y4,
            opset=19,
        ),
        {"x": X4},
    ),
    "AveragePool with auto_pad": (
        _model(
            [
                helper.make_node(
                    "AveragePool", ["x"], ["y"], kernel_shape=[3, 3], auto_pad="SAME_UPPER"
                )
            ],
            [("x", [2, 3, 6, 6])],
            Y4,
        ),
        {"x": X4},
    ),
    "3-D AveragePool": (
        _model(
            [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2, 2])],
            [("x", [1, 2, 4, 4, 4])],
            [("y", F, [None] * 5)],
        ),
        {"x": X5},
    ),
    "Conv with auto_pad=SAME_LOWER": (
        _model(
            [helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_LOWER")],
            [("x", [2, 3, 6, 6])],
            Y4,
            [("w", W)],
        ),
        {"x": X4},
    ),
    "Dropout with a mask output in inference mode": (
        _model(
            [helper.make_node("Dropout", ["x", "r"], ["y", "mask"])],
            [("x", [4, 5])],
            [("y", F, [4, 5]), ("mask", TensorProto.BOOL, [4, 5])],
            [("r", np.array(0.5, np.float32))],
            opset=13,
        ),
        {"x": X2},
    ),
    "ScatterElements with reduction=add": (
        _model(
            [helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=0, reduction="add")],
            [("x", [4, 5]), ("u", [1, 5])],
            [("y", F, [4, 5])],
            [("i", np.array([[0, 1, 0, 2, 1]], np.int64))],
            opset=16,
        ),
        {"x": X2, "u": _r(1, 5)},
    ),
    "ScatterND with reduction=add": (
        _model(
            [helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="add")],
            [("x", [4, 5]), ("u", [2, 5])],
            [("y", F, [4, 5])],
            [("i", np.array([[1], [1]], np.int64))],
            opset=16,
        ),
        {"x": X2, "u": _r(2, 5)},
    ),
    "Split with unused outputs": (
        _model(
            [
                helper.make_node("Split", ["x", "split"], ["a", "b"], axis=1),
                helper.make_node("Relu", ["a"], ["y"]),
            ],
            [("x", [4, 5])],
            [("y", F, [4, 2])],
            [("split", np.array([2, 3], np.int64))],
            opset=13,
        ),
        {"x": X2},
    ),
    "the intermediate value 'h', also a graph output": (
        _model(
            [helper.make_node("Tanh", ["x"], ["h"]), helper.make_node("Mul", ["h", "h"], ["y"])],
            [("x", [4, 5])],
            [("h", F, [4, 5]), ("y", F, [4, 5])],
        ),
        {"x": X2},
    ),
}


@pytest.mark.ort_training
@pytest.mark.parametrize("case", list(CASES))
def test_known_wrong_builder_cases_are_refused(case):
    model, feeds = CASES[case]
    with pytest.raises(NotImplementedError, match=f"wrong gradient for {case}.*backend='onnx'"):
        onnx_derivative(model, weights=[], inputs=list(feeds), backend="ort")


@pytest.mark.parametrize("case", list(CASES))
def test_the_native_backend_computes_them_right(case):
    model, feeds = CASES[case]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    seeds = [_r(*y.shape) if y.dtype == np.float32 else np.zeros(y.shape, y.dtype) for y in outputs]
    grad = onnx_derivative(model, weights=[], inputs=list(feeds))
    grad_session = ort.InferenceSession(
        grad.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    grad_feeds = {**feeds, **{f"{o.name}_grad": s for o, s in zip(model.graph.output, seeds)}}
    names = [i.name for i in grad_session.get_inputs()]
    got = grad_session.run(None, {k: v for k, v in grad_feeds.items() if k in names})
    expected = onnx_numerical_vjp(model, feeds, list(feeds), seeds=seeds, eps=1e-4)
    for name, value in zip(feeds, got):
        np.testing.assert_allclose(value, expected[name], rtol=1e-3, atol=1e-3, err_msg=name)


def test_zeros_for_a_source_that_reaches_an_output_are_refused():
    model = _model([helper.make_node("Tanh", ["x"], ["y"])], [("x", [4, 5])], [("y", F, [4, 5])])
    with pytest.raises(NotImplementedError, match=r"no gradient for \['x'\], which reach"):
        check_built_gradients(model, {}, ["x"])
    shape_only = _model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=F)],
        [("x", [4, 5])],
        [("y", F, [2])],
    )
    check_built_gradients(shape_only, {}, ["x"])  # zeros are right: no float path


def test_a_gradient_shaped_unlike_its_source_is_refused():
    model = _model([helper.make_node("Tanh", ["x"], ["y"])], [("x", [4, 5])], [("y", F, [4, 5])])
    result = _model(
        [helper.make_node("Tanh", ["x"], ["x_grad"])], [("x", [4, 5])], [("x_grad", F, [4, 2])]
    )
    with pytest.raises(NotImplementedError, match=r"gradient of 'x' has shape \[4, 2\]"):
        check_gradient_shapes(result, model, ["x"])
