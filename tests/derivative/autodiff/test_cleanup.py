"""The clean-up pass: structural facts (what is left) and unchanged values (numpy, finite
differences in float64)."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative
from onnxgrad.derivative.autodiff.cleanup import clean_graph
from tests.derivative.fd import onnx_numerical_vjp

rng = np.random.default_rng(5)
D = TensorProto.DOUBLE


def model(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def tensor(name, shape, elem=D):
    return helper.make_tensor_value_info(name, elem, shape)


def cleaned(m):
    copy = onnx.ModelProto()
    copy.CopyFrom(m)
    clean_graph(copy.graph)
    onnx.checker.check_model(copy, full_check=True)
    return copy


def run(m, feeds):
    return ReferenceEvaluator(m).run(None, feeds)


def ops(m):
    return [n.op_type for n in m.graph.node]


def test_identity_chain_disappears():
    m = model(
        [
            helper.make_node("Identity", ["x"], ["a"]),
            helper.make_node("Identity", ["a"], ["b"]),
            helper.make_node("Tanh", ["b"], ["t"]),
            helper.make_node("Identity", ["t"], ["y"]),
        ],
        [tensor("x", [2, 3])],
        [tensor("y", [2, 3])],
    )
    x = rng.standard_normal((2, 3))
    result = cleaned(m)
    assert ops(result) == ["Tanh"]
    assert result.graph.node[0].output[0] == "y"
    np.testing.assert_allclose(run(result, {"x": x})[0], np.tanh(x))


def test_cast_to_the_type_a_value_has_disappears():
    m = model(
        [
            helper.make_node("Cast", ["x"], ["a"], to=D),
            helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["b"], ["c"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["c"], ["y"], to=D),
        ],
        [tensor("x", [3])],
        [tensor("y", [3])],
    )
    x = rng.standard_normal(3)
    result = cleaned(m)
    assert ops(result) == ["Cast", "Cast"]
    np.testing.assert_allclose(run(result, {"x": x})[0], x.astype(np.float32))


def test_identity_between_input_and_output_stays():
    m = model([helper.make_node("Identity", ["x"], ["y"])], [tensor("x", [2])], [tensor("y", [2])])
    assert ops(cleaned(m)) == ["Identity"]


def test_one_value_to_two_outputs_keeps_one_identity():
    m = model(
        [
            helper.make_node("Neg", ["x"], ["n"]),
            helper.make_node("Identity", ["n"], ["y1"]),
            helper.make_node("Identity", ["n"], ["y2"]),
        ],
        [tensor("x", [3])],
        [tensor("y1", [3]), tensor("y2", [3])],
    )
    x = rng.standard_normal(3)
    result = cleaned(m)
    assert ops(result) == ["Neg", "Identity"]
    y1, y2 = run(result, {"x": x})
    np.testing.assert_allclose(y1, -x)
    np.testing.assert_allclose(y2, -x)


def test_transposes_compose():
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 2, 0]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[2, 0, 1]),
            helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1]),
            helper.make_node("Transpose", ["c"], ["y"], perm=[1, 0, 2]),
        ],
        [tensor("x", [2, 3, 4])],
        [tensor("y", [4, 2, 3])],
    )
    x = rng.standard_normal((2, 3, 4))
    result = cleaned(m)
    assert ops(result) == ["Transpose"]
    expected = x.transpose(1, 2, 0).transpose(2, 0, 1).transpose(0, 2, 1).transpose(1, 0, 2)
    np.testing.assert_allclose(run(result, {"x": x})[0], expected)


def test_reshape_chain_merges_unless_the_outer_shape_copies_a_dimension():
    shapes = {
        "s1": np.array([6, 4], np.int64),
        "s2": np.array([-1, 2], np.int64),
        "s3": np.array([0, 4], np.int64),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in shapes.items()]
    m = model(
        [
            helper.make_node("Reshape", ["x", "s1"], ["a"]),
            helper.make_node("Reshape", ["a", "s2"], ["y"]),
            helper.make_node("Reshape", ["a", "s3"], ["z"]),
        ],
        [tensor("x", [2, 3, 4])],
        [tensor("y", [12, 2]), tensor("z", [6, 4])],
        inits,
    )
    x = rng.standard_normal((2, 3, 4))
    result = cleaned(m)
    inputs = {n.output[0]: list(n.input) for n in result.graph.node}
    assert inputs["y"][0] == "x"
    assert inputs["z"][0] == "a"
    y, z = run(result, {"x": x})
    np.testing.assert_allclose(y, x.reshape(12, 2))
    np.testing.assert_allclose(z, x.reshape(6, 4))


def test_common_subexpressions_and_equal_constants_merge():
    two = numpy_helper.from_array(np.array(2.0), "c")
    m = model(
        [
            helper.make_node("Constant", [], ["k1"], value=two),
            helper.make_node("Constant", [], ["k2"], value=two),
            helper.make_node("Mul", ["x", "k1"], ["a"]),
            helper.make_node("Mul", ["x", "k2"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["y"]),
        ],
        [tensor("x", [3])],
        [tensor("y", [3])],
    )
    x = rng.standard_normal(3)
    result = cleaned(m)
    assert sorted(ops(result)) == ["Add", "Constant", "Mul"]
    np.testing.assert_allclose(run(result, {"x": x})[0], 4 * x)


def test_random_nodes_are_not_merged():
    m = model(
        [
            helper.make_node("RandomUniformLike", ["x"], ["a"], seed=1.0),
            helper.make_node("RandomUniformLike", ["x"], ["b"], seed=1.0),
            helper.make_node("Add", ["a", "b"], ["y"]),
        ],
        [tensor("x", [3])],
        [tensor("y", [3])],
    )
    assert ops(cleaned(m)).count("RandomUniformLike") == 2


def test_values_read_by_a_subgraph_are_left_alone():
    then = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["t"])], "then", [], [tensor("t", [3])]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["e"])], "else", [], [tensor("e", [3])]
    )
    m = model(
        [
            helper.make_node("Identity", ["x"], ["a"]),
            helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        ],
        [tensor("x", [3]), tensor("c", [], TensorProto.BOOL)],
        [tensor("y", [3])],
    )
    x = rng.standard_normal(3)
    result = cleaned(m)
    assert ops(result) == ["Identity", "If"]
    np.testing.assert_allclose(run(result, {"x": x, "c": np.array(False)})[0], -x)


def _net():
    """Conv (16 channels, small output: the patches kernel gradient), Relu, Identity
    chains, a duplicated Transpose pair, Gemm."""
    weights = {
        "W": rng.standard_normal((4, 16, 3, 3)) * 0.3,
        "B": rng.standard_normal(4),
        "D": rng.standard_normal((3, 4)),
        "shape": np.array([0, -1], np.int64),
    }
    nodes = [
        helper.make_node("Identity", ["X"], ["x1"]),
        helper.make_node("Conv", ["x1", "W", "B"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Identity", ["r"], ["r1"]),
        helper.make_node("Transpose", ["r1"], ["t1"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 3, 1, 2]),
        helper.make_node("GlobalAveragePool", ["t2"], ["p"]),
        helper.make_node("Reshape", ["p", "shape"], ["f"]),
        helper.make_node("Gemm", ["f", "D"], ["Y"], transB=1),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    return model(nodes, [tensor("X", ["N", 16, 5, 5])], [tensor("Y", ["N", 3])], inits)


def test_cleaned_gradient_matches_finite_differences():
    net = _net()
    weights = ["W", "B", "D"]
    grad = onnx_derivative(net, weights=weights, options=DerivativeOptions.Zero)
    assert "Identity" not in ops(grad)
    assert [o.name for o in grad.graph.output] == ["X_grad", "W_grad", "B_grad", "D_grad"]
    values = {i.name: numpy_helper.to_array(i) for i in net.graph.initializer}
    feeds = {"X": rng.standard_normal((2, 16, 5, 5)), **{w: values[w] for w in weights}}
    seed = rng.standard_normal((2, 3))
    names = [o.name for o in grad.graph.output]
    got = dict(zip(names, run(grad, {**feeds, "Y_grad": seed})))
    expected = onnx_numerical_vjp(net, feeds, ["X", *weights], seeds=[seed])
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-5, atol=1e-6)


def _expand_then(op_type: str, other: list) -> onnx.ModelProto:
    """``op(Expand(s, Shape(x)), t)`` with ``t`` computed by ``other`` (nodes giving ``t``)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["s", "shape"], ["e"]),
        *other,
        helper.make_node(op_type, ["t", "e"], ["y"]),
    ]
    return model(nodes, [tensor("x", ["N", 3]), tensor("s", [1, 3])], [tensor("y", ["N", 3])])


def test_expand_to_the_shape_of_the_other_operand_is_skipped():
    x, s = rng.standard_normal((4, 3)), rng.standard_normal((1, 3))
    for op_type in ("Add", "Sub", "Mul", "Div"):
        m = _expand_then(
            op_type,
            [helper.make_node("Exp", ["x"], ["ex"]), helper.make_node("Add", ["ex", "x"], ["t"])],
        )
        result = cleaned(m)
        assert "Expand" not in ops(result) and "Shape" not in ops(result), op_type
        expected = run(m, {"x": x, "s": s})[0]
        got = run(result, {"x": x, "s": s})[0]
        assert got.shape == expected.shape == (4, 3)
        np.testing.assert_array_equal(got, expected)


def test_expand_stays_when_the_other_operand_may_have_another_shape():
    other = [helper.make_node("ReduceSum", ["x"], ["t"], keepdims=1)]
    m = _expand_then("Mul", other)
    assert "Expand" in ops(cleaned(m))
    x, s = rng.standard_normal((4, 3)), rng.standard_normal((1, 3))
    np.testing.assert_array_equal(run(cleaned(m), {"x": x, "s": s})[0], run(m, {"x": x, "s": s})[0])


def test_mean_squared_error_and_rms_norm_gradients_match_finite_differences():
    """The mean's broadcast gradient meets the square's (no Expand left), a Reshape that
    keeps its input's shape passes its gradient through (no Reshape left)."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["p"]),
        helper.make_node("Reshape", ["p", "minus_one_one"], ["q"]),
        helper.make_node("Pow", ["q", "two"], ["q2"]),
        helper.make_node("ReduceMean", ["q2", "last"], ["ms"], keepdims=1),
        helper.make_node("Sqrt", ["ms"], ["rms"]),
        helper.make_node("Div", ["q", "rms"], ["n"]),
        helper.make_node("Sub", ["n", "y"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((5, 2)), "W"),
        numpy_helper.from_array(np.array([-1, 2], np.int64), "minus_one_one"),
        numpy_helper.from_array(np.array(2.0), "two"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
    ]
    net = model(nodes, [tensor("X", ["N", 5]), tensor("y", ["N", 2])], [tensor("loss", [])], inits)
    grad = onnx_derivative(net, weights=["W"], inputs=["X"], options=DerivativeOptions.Zero)
    assert "Expand" not in ops(grad)
    assert ops(grad).count("Reshape") == 1
    feeds = {"X": rng.standard_normal((3, 5)), "y": rng.standard_normal((3, 2))}
    seed = np.array(1.3)
    weight = numpy_helper.to_array(inits[0])
    names = [o.name for o in grad.graph.output]
    got = dict(zip(names, run(grad, {**feeds, "W": weight, "loss_grad": seed})))
    expected = onnx_numerical_vjp(net, {**feeds, "W": weight}, ["X", "W"], seeds=[seed])
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-5, atol=1e-7)
