"""select_model_inputs_outputs and remove_unused_nodes, checked by running the results."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import add_loss_output, remove_unused_nodes, select_model_inputs_outputs
from tests.graph.sklearn_models import logistic_regression, mlp_regressor, run
from tests.models import seed004_function, seed004_model

COEF_X = np.array([[-2.0, 3.0]], dtype=np.float32)
COEF_X2 = np.array([[0.5, -0.33333]], dtype=np.float32)


def checked(model: onnx.ModelProto, **kwargs) -> onnx.ModelProto:
    before = model.SerializeToString()
    result = select_model_inputs_outputs(model, **kwargs)
    assert model.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    return result


def test_intermediate_output(rng):
    result = checked(seed004_model(), outputs=["out_add_0"])
    assert [o.name for o in result.graph.output] == ["out_add_0"]
    assert {n.op_type for n in result.graph.node} == {"Mul", "Add"}
    assert [i.name for i in result.graph.initializer] == ["init", "init_1"]
    out = result.graph.output[0].type.tensor_type
    assert out.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in out.shape.dim] == [0, 2]
    x = rng.standard_normal((4, 2)).astype(np.float32)
    got = run(result, {"x": x})["out_add_0"]
    np.testing.assert_allclose(got, x * COEF_X + x * x * COEF_X2, rtol=1e-6)


def test_intermediate_input(rng):
    result = checked(seed004_model(), inputs=["out_add_0"])
    assert [i.name for i in result.graph.input] == ["out_add_0"]
    assert "Mul" not in {n.op_type for n in result.graph.node}
    assert "init" not in {i.name for i in result.graph.initializer}
    h = rng.standard_normal((3, 2)).astype(np.float32)
    np.testing.assert_allclose(run(result, {"out_add_0": h})["y"], h.sum(axis=1, keepdims=True) - 1)


def test_several_outputs_and_explicit_inputs(rng):
    result = checked(seed004_model(), inputs=["x"], outputs=["out_mul_0", "y"])
    x = rng.standard_normal((3, 2)).astype(np.float32)
    got = run(result, {"x": x})
    np.testing.assert_allclose(got["out_mul_0"], x * x, rtol=1e-6)
    np.testing.assert_allclose(got["y"], seed004_function(x), rtol=1e-5, atol=1e-6)


def test_loss_only_drops_the_prediction_as_in_seed_004(rng):
    with_loss = add_loss_output(seed004_model(), reduction="sum")
    result = checked(with_loss, outputs=["loss"])
    assert [o.name for o in result.graph.output] == ["loss"]
    assert [i.name for i in result.graph.input] == ["x", "label"]
    x = rng.standard_normal((5, 2)).astype(np.float32)
    label = rng.standard_normal((5, 1)).astype(np.float32)
    got = run(result, {"x": x, "label": label})["loss"]
    np.testing.assert_allclose(got, ((seed004_function(x) - label) ** 2).sum(), rtol=1e-5)


def test_positional_arguments_are_outputs_then_inputs_as_in_the_seeds(rng):
    """``select_model_inputs_outputs(onx, ['out_add_0'])`` keeps the output 'out_add_0' (the
    seeds' order ``(model, outputs=None, inputs=None)``), never makes it an input."""
    result = select_model_inputs_outputs(seed004_model(), ["out_add_0"])
    assert [o.name for o in result.graph.output] == ["out_add_0"]
    assert [i.name for i in result.graph.input] == ["x"]
    both = select_model_inputs_outputs(seed004_model(), ["y"], ["out_add_0"])
    assert [i.name for i in both.graph.input] == ["out_add_0"]
    h = rng.standard_normal((3, 2)).astype(np.float32)
    np.testing.assert_allclose(run(both, {"out_add_0": h})["y"], h.sum(axis=1, keepdims=True) - 1)


def test_unused_inputs_go_when_inputs_are_not_given():
    model = seed004_model()
    model.graph.input.append(helper.make_tensor_value_info("spare", TensorProto.FLOAT, [3]))
    assert [i.name for i in checked(model).graph.input] == ["x"]
    assert [i.name for i in checked(model, inputs=["x", "spare"]).graph.input] == ["x", "spare"]


def test_converted_classifier_probabilities_only():
    conv = logistic_regression()
    result = checked(conv.onnx, outputs="probabilities")
    assert {n.domain for n in result.graph.node} == {""}
    assert {i.name for i in result.graph.initializer} == {"coef", "intercept", "axis"}
    got = run(result, {"X": conv.X})["probabilities"]
    np.testing.assert_allclose(got, conv.estimator.predict_proba(conv.X), rtol=1e-12)


def test_hidden_layer_of_a_converted_mlp():
    conv = mlp_regressor()
    result = checked(conv.onnx, outputs=["next_activations"])
    est = conv.estimator
    expected = np.maximum(conv.X @ est.coefs_[0] + est.intercepts_[0], 0)
    got = run(result, {"X": conv.X})["next_activations"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"outputs": ["nope"]}, ValueError, r"unknown output \['nope'\]"),
        ({"inputs": ["nope"]}, ValueError, r"unknown input \['nope'\]"),
        ({"inputs": ["init"]}, ValueError, r"unknown input \['init'\]"),
        ({"outputs": ["y", "y"]}, ValueError, "more than once"),
        ({"outputs": [3]}, TypeError, "non-empty names"),
        (
            {"inputs": ["out_add_0"], "outputs": ["out_mul_0"]},
            ValueError,
            r"needs \['x'\].*add them to inputs",
        ),
    ],
)
def test_errors(kwargs, error, match):
    model = seed004_model()
    before = model.SerializeToString()
    with pytest.raises(error, match=match):
        select_model_inputs_outputs(model, **kwargs)
    assert model.SerializeToString() == before


def dead_code_model() -> onnx.ModelProto:
    """y = If(cond, x + a, x * 2) with dead nodes and initializers at both levels."""
    f = TensorProto.FLOAT
    then_graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "a"], ["t"]),
            helper.make_node("Neg", ["x"], ["dead_inner"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t", f, None)],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", f, None)],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["dead"]),
            helper.make_node("Abs", ["dead"], ["dead2"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph),
        ],
        "dead",
        [
            helper.make_tensor_value_info("x", f, [3]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("unused_input", f, [3]),
        ],
        [helper.make_tensor_value_info("y", f, [3])],
        [
            numpy_helper.from_array(np.ones(3, np.float32), "a"),
            numpy_helper.from_array(np.ones(3, np.float32), "unused_init"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_remove_unused_nodes_at_every_level(rng):
    model = dead_code_model()
    before = model.SerializeToString()
    result = remove_unused_nodes(model)
    assert model.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    assert [n.op_type for n in result.graph.node] == ["If"]
    assert [i.name for i in result.graph.initializer] == ["a"]
    then_branch = next(a.g for a in result.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then_branch.node] == ["Add"]
    assert [i.name for i in result.graph.input] == ["x", "cond", "unused_input"]
    x = rng.standard_normal(3).astype(np.float32)
    spare = np.zeros(3, np.float32)
    for cond, expected in [(True, x + 1), (False, x * 2)]:
        feeds = {"x": x, "cond": np.array(cond), "unused_input": spare}
        np.testing.assert_allclose(run(result, feeds)["y"], expected, rtol=1e-6)


def test_remove_unused_nodes_keeps_a_clean_model_unchanged():
    model = seed004_model()
    result = remove_unused_nodes(model)
    assert [n.output[0] for n in result.graph.node] == [n.output[0] for n in model.graph.node]
    assert len(result.graph.initializer) == len(model.graph.initializer)


def test_infer_shapes_false_types_from_the_declarations_only():
    model = seed004_model()
    with pytest.raises(ValueError, match=r"'out_add_0'.*no type"):
        select_model_inputs_outputs(model, ["out_add_0"], infer_shapes=False)
    declared = onnx.ModelProto()
    declared.CopyFrom(model)
    declared.graph.value_info.append(
        helper.make_tensor_value_info("out_add_0", TensorProto.FLOAT, ["N", 2])
    )
    result = checked(declared, outputs=["out_add_0"], infer_shapes=False)
    dims = [d.dim_param or d.dim_value for d in result.graph.output[0].type.tensor_type.shape.dim]
    assert dims == ["N", 2]  # inference would say [0, 2]: the declaration is kept
