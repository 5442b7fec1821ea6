"""Input models are checked up front: unsorted graphs are sorted (never differentiated as
they are), broken ones are refused naming the node or value at fault."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from onnxgrad import DerivativeOptions, add_loss_output, get_train_initializer, onnx_derivative
from tests.derivative.fd import initializer_values, onnx_numerical_vjp, run_onnxruntime

F = TensorProto.FLOAT
ENTRY_POINTS = {
    "onnx_derivative": lambda m: onnx_derivative(m, weights=[]),
    "add_loss_output": add_loss_output,
    "get_train_initializer": get_train_initializer,
}


def _model(nodes, inits=None, opsets=(("", 18),), inputs=None, outputs=None):
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info("x", F, ["N", 3])],
        outputs or [helper.make_tensor_value_info("y", F, ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=9
    )


def _shuffled(model: onnx.ModelProto, seed: int = 3) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    nodes = list(copy.graph.node)
    order = np.random.default_rng(seed).permutation(len(nodes))
    while list(order) == sorted(order):
        order = order[::-1]
    del copy.graph.node[:]
    copy.graph.node.extend([nodes[i] for i in order])
    return copy


@pytest.fixture(scope="module")
def mlp():
    skl2onnx = pytest.importorskip("skl2onnx")
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPRegressor

    rng = np.random.default_rng(11)
    X = rng.standard_normal((30, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator = MLPRegressor(
            hidden_layer_sizes=(5,), activation="tanh", max_iter=50, random_state=0
        )
        estimator.fit(X, y)
    return skl2onnx.to_onnx(estimator, X[:1], target_opset=15), X[:4]


def test_an_unsorted_real_model_is_sorted_and_its_gradient_matches_finite_differences(mlp):
    model, x = mlp
    shuffled = _shuffled(model)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(shuffled)
    weights = list(get_train_initializer(shuffled))
    assert weights == list(get_train_initializer(model))
    assert weights, "the MLP has weights"
    grad = onnx_derivative(shuffled, options=DerivativeOptions.FillGrad)
    onnx.checker.check_model(grad, full_check=True)
    feeds = {"X": x, **initializer_values(model, weights)}
    got = run_onnxruntime(grad, feeds)
    expected = onnx_numerical_vjp(model, feeds, ["X", *weights])
    for name, value in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], value, rtol=1e-3, atol=1e-4)
        assert np.any(value != 0), name


def test_the_input_model_is_not_sorted_in_place(mlp):
    shuffled = _shuffled(mlp[0])
    before = shuffled.SerializeToString()
    onnx_derivative(shuffled)
    add_loss_output(shuffled)
    get_train_initializer(shuffled)
    assert shuffled.SerializeToString() == before


BROKEN = {
    "undeclared domain": (
        _model([helper.make_node("Foo", ["x"], ["y"], name="custom", domain="my.domain")]),
        r"node 'custom' \(Foo\) is in domain 'my.domain', which the model does not import",
    ),
    "value used but never produced": (
        _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="add")]),
        r"node 'add' \(Add\) reads 'ghost', which no node, graph input or initializer",
    ),
    "missing initializer": (
        _model(
            [
                helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                helper.make_node("Add", ["h", "B"], ["y"], name="bias"),
            ],
            {"W": np.eye(3, dtype=np.float32)},
        ),
        r"node 'bias' \(Add\) reads 'B'",
    ),
    "cycle": (
        _model(
            [
                helper.make_node("Add", ["x", "c"], ["a"], name="first"),
                helper.make_node("Relu", ["a"], ["b"], name="second"),
                helper.make_node("Neg", ["b"], ["c"], name="third"),
                helper.make_node("Identity", ["a"], ["y"], name="out"),
            ]
        ),
        r"cycle: node 'first' \(Add\) -> node 'second' \(Relu\) -> node 'third' \(Neg\)",
    ),
    "value produced twice": (
        _model(
            [
                helper.make_node("Relu", ["x"], ["y"], name="r1"),
                helper.make_node("Neg", ["x"], ["y"], name="r2"),
            ]
        ),
        r"value 'y' is produced twice: by node 'r1' \(Relu\) and by node 'r2' \(Neg\)",
    ),
    "output nobody produces": (
        _model([helper.make_node("Relu", ["x"], ["z"], name="r")]),
        r"graph output 'y' is not produced",
    ),
    "unknown op": (
        _model([helper.make_node("NoSuchOp", ["x"], ["y"], name="weird")]),
        r"not a valid ONNX model.*NoSuchOp",
    ),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_model_is_refused_naming_the_cause(case, entry):
    model, message = BROKEN[case]
    with pytest.raises(ValueError, match=message):
        ENTRY_POINTS[entry](model)


def test_a_cycle_inside_a_subgraph_is_found():
    body = helper.make_graph(
        [
            helper.make_node("Add", ["x", "q"], ["p"], name="inner_p"),
            helper.make_node("Neg", ["p"], ["q"], name="inner_q"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("p", F, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["o"])],
        "else",
        [],
        [helper.make_tensor_value_info("o", F, None)],
    )
    model = _model(
        [
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"]),
            helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=other),
        ],
        {"zero": np.zeros((), np.float32)},
    )
    with pytest.raises(ValueError, match="inner_p"):
        onnx_derivative(model, weights=[])


def test_a_model_proto_whose_external_data_was_not_loaded_is_refused(tmp_path, monkeypatch):
    model = _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        {"W": np.full((3, 3), 2.0, np.float32)},
    )
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save_model(model, tmp_path / "m.onnx")
    unloaded = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(np.ones(9, np.float32).tobytes())  # a decoy
    monkeypatch.chdir(elsewhere)
    for call in (onnx_derivative, get_train_initializer, add_loss_output):
        with pytest.raises(ValueError, match=r"'W'.*external file 'weights.bin'"):
            call(unloaded)
    weights = get_train_initializer(tmp_path / "m.onnx")  # by path: its own folder
    np.testing.assert_array_equal(weights["W"][0], np.full((3, 3), 2.0, np.float32))


@pytest.mark.parametrize(
    ("op", "opset", "inputs", "not_weights"),
    [
        ("Clip", 11, ["x", "lo", "hi"], ["lo", "hi"]),
        ("Clip", 12, ["x", "lo", "hi"], ["lo", "hi"]),
        ("Dropout", 12, ["x", "ratio"], ["ratio"]),
        ("Pad", 11, ["x", "pads", "value"], ["value"]),
        ("Resize", 11, ["x", "roi", "scales"], ["roi", "scales"]),
    ],
)
def test_train_initializer_at_opsets_11_12_leaves_out_op_parameters(op, opset, inputs, not_weights):
    values = {
        "lo": np.array(-1.0, np.float32),
        "hi": np.array(1.0, np.float32),
        "ratio": np.array(0.5, np.float32),
        "pads": np.array([0, 1, 0, 1], np.int64),
        "value": np.array(0.0, np.float32),
        "roi": np.array([], np.float32),
        "scales": np.array([1.0, 2.0], np.float32),
        "w": np.ones(3, np.float32),
    }
    nodes = [
        helper.make_node("Mul", ["x0", "w"], ["x"]),
        helper.make_node(op, inputs, ["y"], name="op"),
    ]
    model = _model(
        nodes,
        {name: values[name] for name in [*inputs[1:], "w"]},
        opsets=(("", opset),),
        inputs=[helper.make_tensor_value_info("x0", F, [2, 3])],
        outputs=[helper.make_tensor_value_info("y", F, None)],
    )
    assert list(get_train_initializer(model)) == ["w"]
    assert not set(not_weights) & set(get_train_initializer(model))


def test_a_valid_model_still_runs_the_same(mlp):
    model, x = mlp
    grad = onnx_derivative(
        model, options=DerivativeOptions.KeepOutputs | DerivativeOptions.FillGrad
    )
    got = run_onnxruntime(grad, {"X": x, **initializer_values(model, get_train_initializer(model))})
    expected = run_onnxruntime(model, {"X": x})
    # the same float32 values up to the order of the sums: onnxruntime may fuse the forward
    # nodes of the larger graph differently (outputs ~0.2, from products of weights ~1)
    np.testing.assert_allclose(got["variable"], expected["variable"], rtol=1e-6, atol=1e-6)


def test_an_input_without_shape_is_named_where_the_result_needs_one():
    """onnxruntime takes an input declared with no shape (skl2onnx's ``DoubleTensorType()``),
    onnx's checker refuses a model holding one: the error names it instead of quoting the
    checker's "Field 'shape' of 'type' is required but missing"."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, None)],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for build in (lambda: add_loss_output(model, "log"), lambda: onnx_derivative(model)):
        with pytest.raises(ValueError, match="input 'X' declares no shape"):
            build()
