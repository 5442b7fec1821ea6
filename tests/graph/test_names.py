"""onnx_rename_weights: alphabetical order of the new names is the order of first use."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.graph import onnx_rename_weights
from tests.graph.sklearn_models import mlp_regressor, run
from tests.models import seed004_function, seed004_model


def first_use(model: onnx.ModelProto) -> list[str]:
    initializers = {i.name for i in model.graph.initializer}
    order = []
    for node in model.graph.node:
        for name in node.input:
            if name in initializers and name not in order:
                order.append(name)
    return order


def renamed(model: onnx.ModelProto) -> onnx.ModelProto:
    before = model.SerializeToString()
    result = onnx_rename_weights(model)
    assert model.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    return result


def test_seed004(rng):
    model = seed004_model()
    result = renamed(model)
    expected = [f"I{k}_{name}" for k, name in enumerate(first_use(model))]
    names = [i.name for i in result.graph.initializer]
    assert names == expected == sorted(expected)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for init in result.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), values[init.name[3:]])
    x = rng.standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose(run(result, {"x": x})["y"], seed004_function(x), rtol=1e-5)


def test_zero_padding_on_a_deep_converted_mlp():
    conv = mlp_regressor(hidden=(3, 3, 3, 3, 3))
    model = conv.onnx
    order = first_use(model)
    assert len(order) > 10
    result = renamed(model)
    names = [i.name for i in result.graph.initializer]
    assert names == [f"I{k:02d}_{name}" for k, name in enumerate(order)]
    assert names == sorted(names)
    got = run(result, {"X": conv.X})["variable"].ravel()
    np.testing.assert_allclose(got, conv.estimator.predict(conv.X), rtol=1e-4, atol=1e-5)


def test_uses_in_subgraphs_are_renamed_unless_shadowed(rng):
    f = TensorProto.FLOAT
    uses_outer = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", f, None)],
    )
    shadows = helper.make_graph(
        [helper.make_node("Mul", ["x", "b"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", f, None)],
        [numpy_helper.from_array(np.full(2, 10.0, np.float32), "b")],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "a"], ["xa"]),
            helper.make_node("If", ["cond"], ["r"], then_branch=uses_outer, else_branch=shadows),
            helper.make_node("Add", ["r", "xa"], ["y"]),
        ],
        "sub",
        [
            helper.make_tensor_value_info("x", f, [2]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", f, [2])],
        [
            numpy_helper.from_array(np.full(2, 3.0, np.float32), "b"),
            numpy_helper.from_array(np.full(2, 2.0, np.float32), "a"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    result = renamed(model)
    assert [i.name for i in result.graph.initializer] == ["I0_a", "I1_b"]
    branches = {a.name: a.g for a in result.graph.node[1].attribute}
    assert list(branches["then_branch"].node[0].input) == ["x", "I1_b"]
    assert list(branches["else_branch"].node[0].input) == ["x", "b"]
    x = rng.standard_normal(2).astype(np.float32)
    for cond, expected in [(True, x + 3 + 2 * x), (False, 10 * x + 2 * x)]:
        got = run(result, {"x": x, "cond": np.array(cond)})["y"]
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_an_initializer_returned_as_output_keeps_its_output_name():
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "out",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [2]),
        ],
        [numpy_helper.from_array(np.array([2.0, 3.0], np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    result = renamed(model)
    assert [o.name for o in result.graph.output] == ["y", "w"]
    assert [i.name for i in result.graph.initializer] == ["I0_w"]
    got = run(result, {"x": np.ones(2, np.float32)})
    np.testing.assert_array_equal(got["w"], [2.0, 3.0])
    np.testing.assert_array_equal(got["y"], [2.0, 3.0])


def test_initializers_listed_as_inputs_are_renamed_there_too():
    model = seed004_model()
    init = next(i for i in model.graph.initializer if i.name == "init")
    model.graph.input.append(helper.make_tensor_value_info("init", init.data_type, init.dims))
    result = renamed(model)
    assert [i.name for i in result.graph.input] == ["x", "I0_init"]


def test_an_output_declared_without_shape_gets_the_inferred_one():
    # skl2onnx's FloatTensorType() output: no shape, which onnx's checker refuses
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["Y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.ones((3, 3), np.float32), "w1"),
            numpy_helper.from_array(np.ones((3, 3), np.float32), "w2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    result = renamed(model)
    assert [i.name for i in result.graph.initializer] == ["I0_w1", "I1_w2"]
    dims = [d.dim_value for d in result.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [3, 3]
