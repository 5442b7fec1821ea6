"""get_train_initializer: float weights on a differentiable path to an output."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import add_loss_output, get_train_initializer
from tests.graph.sklearn_models import (
    linear_regression,
    logistic_regression,
    mlp_classifier,
    mlp_regressor,
)
from tests.models import linear_regression_model, seed004_model

F = TensorProto.FLOAT


def make(nodes, inits, inputs=None, outputs=None, opset=18, value_info=()):
    inputs = inputs or [helper.make_tensor_value_info("x", F, [None, 4])]
    outputs = outputs or [helper.make_tensor_value_info("y", F, None)]
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        outputs,
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
        value_info=list(value_info),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def weights(model) -> list[str]:
    return list(get_train_initializer(model))


def f32(*values):
    return np.array(values, dtype=np.float32)


def test_seed004_weights_are_the_three_float_coefficients():
    model = seed004_model()
    before = model.SerializeToString()
    expected = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = get_train_initializer(model)
    assert model.SerializeToString() == before
    assert list(found) == ["init", "init_1", "init_b10"]
    for name, (array, proto) in found.items():
        np.testing.assert_array_equal(array, expected[name])
        assert proto.name == name


def test_linear_regression_weights():
    found = get_train_initializer(linear_regression_model(np.array([1.0, 2.0]), np.array([3.0])))
    assert list(found) == ["coefs", "intercept"]
    np.testing.assert_array_equal(found["coefs"][0], np.array([[1.0], [2.0]], dtype=np.float32))


def test_converted_regressors_keep_coefficients_not_shapes():
    lr = linear_regression()
    found = get_train_initializer(lr.onnx)
    assert list(found) == ["coef", "intercept"]
    np.testing.assert_allclose(found["coef"][0].ravel(), lr.estimator.coef_)
    np.testing.assert_allclose(found["intercept"][0].ravel(), [lr.estimator.intercept_])

    mlp = mlp_regressor()
    found = get_train_initializer(mlp.onnx)
    assert list(found) == ["coefficient", "intercepts", "coefficient1", "intercepts1"]
    np.testing.assert_allclose(found["coefficient1"][0], mlp.estimator.coefs_[1], rtol=1e-6)


def test_converted_classifiers_skip_the_label_branch():
    logreg = logistic_regression()
    assert weights(logreg.onnx) == ["coef", "intercept"]
    # skl2onnx writes P(class 0) = unity - P(class 1): ``unity`` is added to a sigmoid (not an
    # affine value), a post-processing constant, not a weight.
    assert weights(mlp_classifier().onnx) == [
        "coefficient",
        "intercepts",
        "coefficient1",
        "intercepts1",
    ]


@pytest.mark.parametrize(
    ("op", "inputs", "attrs"),
    [
        ("Clip", ["x", "low", "high"], {}),
        ("Dropout", ["x", "ratio"], {}),
        ("Pad", ["x", "pads", "value"], {}),
        ("Resize", ["x", "", "scales"], {}),
    ],
)
def test_non_differentiable_float_inputs_are_not_weights(op, inputs, attrs):
    inits = {
        "low": np.float32(-1),
        "high": np.float32(1),
        "ratio": np.float32(0.1),
        "pads": np.array([0, 1, 0, 1], dtype=np.int64),
        "value": np.float32(2.0),
        "scales": f32(1, 2),
        "w": f32(1, 2, 3, 4),
    }
    used = {k: v for k, v in inits.items() if k in inputs or k == "w"}
    model = make(
        [
            helper.make_node(op, inputs, ["h"], **attrs),
            helper.make_node("Mul", ["h", "w"], ["y"]),
        ],
        used,
    )
    assert weights(model) == ["w"]


def test_float_shape_constants_cast_to_int_are_not_weights():
    model = make(
        [
            helper.make_node("Cast", ["float_shape"], ["shape"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["x", "shape"], ["h"]),
            helper.make_node("Add", ["h", "bias"], ["y"]),
        ],
        {"float_shape": f32(-1, 2, 2), "bias": f32(0.5)},
    )
    assert weights(model) == ["bias"]


def test_batch_norm_statistics_are_not_weights_but_scale_and_bias_are():
    model = make(
        [helper.make_node("BatchNormalization", ["x", "scale", "B", "mean", "var"], ["y"])],
        {"scale": f32(1, 1), "B": f32(0, 0), "mean": f32(0, 0), "var": f32(1, 1)},
        inputs=[helper.make_tensor_value_info("x", F, [None, 2])],
    )
    assert weights(model) == ["scale", "B"]


def test_unknown_category_counts_as_differentiable():
    model = make(
        [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)],
        {"gamma": f32(1, 1, 1, 1), "beta": f32(0, 0, 0, 0)},
        opset=17,
    )
    assert weights(model) == ["gamma", "beta"]


def test_variadic_inputs_and_non_differentiable_outputs():
    model = make(
        [
            helper.make_node("Sum", ["x", "a", "b"], ["s"]),
            helper.make_node("TopK", ["s", "k"], ["values", "indices"], axis=1),
            helper.make_node("Cast", ["indices"], ["y"], to=F),
            helper.make_node("Mul", ["values", "c"], ["z"]),
        ],
        # c scales each of the two top values (one number scaling both would be a constant)
        {"a": f32(1, 1, 1, 1), "b": f32(2, 2, 2, 2), "k": np.array([2], np.int64), "c": f32(3, 4)},
        outputs=[
            helper.make_tensor_value_info("y", F, None),
            helper.make_tensor_value_info("z", F, None),
        ],
    )
    assert weights(model) == ["a", "b", "c"]


def test_only_the_index_path_is_not_enough():
    model = make(
        [
            helper.make_node("Add", ["x", "a"], ["s"]),
            helper.make_node("ArgMax", ["s"], ["i"], axis=1),
            helper.make_node("Cast", ["i"], ["y"], to=F),
        ],
        {"a": f32(1, 1, 1, 1)},
    )
    assert weights(model) == []


def test_unused_and_integer_initializers_are_not_weights():
    model = make(
        [helper.make_node("Gather", ["w", "idx"], ["y"], axis=0)],
        {"w": f32(1, 2, 3), "idx": np.array([0, 2], np.int64), "unused": f32(5)},
        inputs=[],
    )
    assert weights(model) == ["w"]


def test_initializers_used_in_subgraphs_count():
    """An ``If`` branch's read of an outer initializer counts, by its role there (a
    per-feature scale of ``x [N, 4]``: a weight; one number scaling every feature would not
    be)."""
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "outer"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", F, None)],
    )
    else_graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["two"], value_float=2.0),
            helper.make_node("Mul", ["x", "two"], ["e"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e", F, None)],
    )
    model = make(
        [
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
            helper.make_node("Greater", ["total", "zero"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph),
        ],
        {"outer": f32(3, 1, 2, 5), "unused": f32(4), "zero": f32(0)},
    )
    assert weights(model) == ["outer"]


def test_a_subgraph_shadowing_an_initializer_is_refused_naming_it():
    """onnx's checker and onnxruntime refuse it (names are single assignment across scopes)."""
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "outer"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", F, None)],
    )
    shadowed = helper.make_graph(
        [
            helper.make_node("Constant", [], ["shadow"], value_float=2.0),
            helper.make_node("Mul", ["x", "shadow"], ["e"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e", F, None)],
    )
    model = make(
        [
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
            helper.make_node("Greater", ["total", "zero"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=shadowed),
        ],
        {"outer": f32(3), "shadow": f32(4), "zero": f32(0)},
    )
    with pytest.raises(ValueError, match="'shadow'"):
        weights(model)


def test_initializers_listed_as_inputs_count():
    model = make(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        {"w": f32(1, 2, 3, 4)},
        inputs=[
            helper.make_tensor_value_info("x", F, [None, 4]),
            helper.make_tensor_value_info("w", F, [4]),
        ],
    )
    assert weights(model) == ["w"]


def test_custom_domain_ops_count_as_differentiable():
    graph = helper.make_graph(
        [helper.make_node("Scale", ["x", "w"], ["y"], domain="my.domain")],
        "custom",
        [helper.make_tensor_value_info("x", F, [None, 4])],
        [helper.make_tensor_value_info("y", F, [None, 4])],
        [numpy_helper.from_array(f32(2), "w")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("my.domain", 1)],
        ir_version=9,
    )
    assert weights(model) == ["w"]


def test_accepts_a_path_and_rejects_other_types(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(seed004_model(), path)
    assert weights(str(path)) == ["init", "init_1", "init_b10"]
    with pytest.raises(TypeError, match=r"expected an onnx\.ModelProto or a path"):
        get_train_initializer(42)


def test_loss_coefficients_and_pow_exponents_are_not_weights():
    """add_loss_output's coefficients are Constant nodes, and a Pow exponent is a constant:
    training them would move a penalty coefficient or produce z log(x) = NaN for x < 0."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["xw"]), helper.make_node("Pow", ["xw", "P"], ["Y"])],
        "pow",
        [x],
        [y],
        [
            numpy_helper.from_array(np.array([1.0, -2.0, 0.5], np.float32), "W"),
            numpy_helper.from_array(np.array(2.0, np.float32), "P"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    assert list(get_train_initializer(model)) == ["W"]
    with_loss = add_loss_output(model, "elastic", penalty={"W": {"l1": 0.1, "l2": 0.2}})
    assert list(get_train_initializer(with_loss)) == ["W"]
