"""Updates written over their inputs: which ones may be, and runs that share those buffers
ending where the step graph fed its own outputs (one buffer per value, no binding) ends."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import (
    LearningRateAdam,
    LearningRateSGDNesterov,
    OrtDataLoader,
    TrainingRunner,
    check_device,
    make_train_step,
)
from onnxgrad.training.running.runner import in_place
from onnxgrad.training.step._in_place import in_place_inputs

rng = np.random.default_rng(5)


def graph_of(nodes, inputs, outputs):
    float_info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in inputs]
    out_info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in outputs]
    graph = helper.make_graph(nodes, "g", float_info, out_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_readers_must_run_before_the_write():
    node = helper.make_node
    model = graph_of(
        [
            node("Mul", ["w", "x"], ["h"]),  # an ancestor of w_new: runs first
            node("Sub", ["w", "h"], ["w_new"]),  # reads w elementwise where it writes
            node("Mul", ["v", "x"], ["late"]),  # not an ancestor of v_new
            node("Add", ["v", "x"], ["v_new"]),
            node("Reshape", ["u", "shape"], ["u_new"]),  # not elementwise
        ],
        ["w", "x", "v", "u", "shape"],
        ["w_new", "late", "v_new", "u_new"],
    )
    got = in_place_inputs(model, {"w": "w_new", "v": "v_new", "u": "u_new"})
    assert got == {"w"}


def float_model(name, nodes, x_shape, y_shape, weights):
    """A float32 model of ``nodes`` from ``X`` to ``Y``, ``weights`` its initializers."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def mlp(n_features=4, hidden=5, generator=rng):
    """``y = relu(X W1 + b1) W2``: the backward reads ``W2`` (to pass the gradient to the
    hidden layer, a ``Transpose`` and a ``MatMul`` onnxruntime fuses), never ``W1`` (``X``
    needs no gradient) nor ``b1``."""
    weights = {
        "W1": generator.standard_normal((n_features, hidden)).astype(np.float32),
        "b1": generator.standard_normal(hidden).astype(np.float32),
        "W2": generator.standard_normal((hidden, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["Y"]),
    ]
    return float_model("mlp", nodes, ["N", n_features], ["N", 1], weights), weights


def squared_error(weights, X, y) -> float:
    """The mlp's ``sum((y_hat - y)^2)`` in float64 numpy."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    hidden = np.maximum(X @ w["W1"] + w["b1"], 0)
    return float(((hidden @ w["W2"] - y) ** 2).sum())


def reference(step, X, y, weights, lr, n_steps):
    """The step graph fed its own outputs (the runner shuffles the rows of its one batch:
    the sums differ in rounding only)."""
    session = ort.InferenceSession(
        step.model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    state, values = step.initial_state(), dict(weights)
    for _ in range(n_steps):
        feeds = {"X": X, step.label: y, step.learning_rate: np.array(lr, np.float32)}
        feeds.update(step.weight_inputs(values))
        feeds.update(state)
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        values = step.unpack_weights(outputs)
        state = {s: outputs[n] for s, n in zip(step.state, step.new_state)}
    return values, state


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_runner_sharing_buffers_equals_the_graph_fed_back(layout, optimizer):
    """Five steps that descend (the loss sums over the batch: a larger rate diverges and
    the rounding of the shuffled sums grows with the weights)."""
    generator = np.random.default_rng(5)
    model, weights = mlp(generator=generator)
    lr = LearningRateAdam() if optimizer == "adam" else LearningRateSGDNesterov()
    step = make_train_step(model, learning_rate=lr, layout=layout)
    shared = in_place(step)
    assert set(step.state) <= shared
    if layout == "per_weight":  # W2, read by the backward, through the update's gate
        assert set(step.weights) <= shared
    X = generator.standard_normal((6, 4)).astype(np.float32)
    y = generator.standard_normal((6, 1)).astype(np.float32)
    runner = TrainingRunner(step, check_device("cpu"), weights)
    first, second = runner._sets
    for name in shared:
        assert first.values[name] is second.values[name]
    loader = OrtDataLoader(X, y, batch_size=6, random_state=0)
    for _ in range(5):
        runner.run_epoch(loader, 0.01)
    values, state = reference(step, X, y, weights, 0.01, 5)
    assert squared_error(values, X, y) < squared_error(weights, X, y)
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, values[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for name, value in runner.get_state().items():
        np.testing.assert_allclose(value, state[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_default_layout_by_size():
    """The flat update holds a second copy of the weights: only small models get it."""
    from onnxgrad.training.step.train_step import FLAT_MAX_ELEMENTS, default_layout

    model, _ = mlp()
    assert default_layout(model, ["W1", "b1", "W2"], "cpu") == "flat"
    assert default_layout(model, ["W1", "b1", "W2"], "cuda") == "per_weight"
    big = mlp(n_features=FLAT_MAX_ELEMENTS // 5 + 1)[0]
    assert default_layout(big, ["W1", "b1", "W2"], "cpu") == "per_weight"


def test_rank0_weight_keeps_its_shape_on_the_device():
    """``y = s * (X W)`` with a 0-d ``s`` (dynamo exports hold such initializers)."""
    model, weights = scaled_mlp()
    step = make_train_step(model, learning_rate=LearningRateAdam(), layout="per_weight")
    X = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 1)).astype(np.float32)
    runner = TrainingRunner(step, check_device("cpu"), weights)
    assert runner.current.values["s"].shape() == []
    runner.run_epoch(OrtDataLoader(X, y, batch_size=6, random_state=0), 0.05)
    values, _ = reference(step, X, y, weights, 0.05, 1)
    assert runner.get_weights()["s"].shape == ()
    np.testing.assert_allclose(runner.get_weights()["s"], values["s"], rtol=1e-5)


def test_train_initializer_names_equal_get_train_initializer():
    """Found without copying a weight, the same names in the same order."""
    from onnxgrad import get_train_initializer
    from onnxgrad.graph.initializers import train_initializer_names

    model, _ = mlp(n_features=4096)  # W1 above the weightless view's threshold
    assert (
        train_initializer_names(model) == list(get_train_initializer(model)) == ["W1", "b1", "W2"]
    )


def token_mlp(generator=rng):
    """``y = relu(X W1) W2`` on ``X`` of shape ``[N, T, 4]``: the backward's ``dY W2^T`` is a
    ``Transpose`` of ``W2`` and a batched ``MatMul``, which onnxruntime fuses into one
    ``FusedMatMul`` reading ``W2`` itself, where the ``MatMul`` was."""
    weights = {
        "W1": generator.standard_normal((4, 5)).astype(np.float32),
        "W2": generator.standard_normal((5, 1)).astype(np.float32),
    }
    node = helper.make_node
    nodes = [
        node("MatMul", ["X", "W1"], ["h"]),
        node("Relu", ["h"], ["r"]),
        node("MatMul", ["r", "W2"], ["Y"]),
    ]
    return float_model("token_mlp", nodes, ["N", 3, 4], ["N", 3, 1], weights), weights


def cnn(generator=rng):
    """``y = Gemm(Flatten(relu(Conv(relu(Conv(X, K1)), K2))), W, b, transB=1)``: the
    backward reads ``K2`` (a transposed convolution) and ``W`` (a transposed ``Gemm``)."""
    weights = {
        "K1": generator.standard_normal((3, 1, 3, 3)).astype(np.float32),
        "K2": generator.standard_normal((2, 3, 3, 3)).astype(np.float32),
        "W": generator.standard_normal((1, 2 * 4 * 4)).astype(np.float32),
        "b": generator.standard_normal(1).astype(np.float32),
    }
    node = helper.make_node
    nodes = [
        node("Conv", ["X", "K1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Relu", ["c1"], ["r1"]),
        node("Conv", ["r1", "K2"], ["c2"], pads=[1, 1, 1, 1]),
        node("Relu", ["c2"], ["r2"]),
        node("Flatten", ["r2"], ["f"]),
        node("Gemm", ["f", "W", "b"], ["Y"], transB=1),
    ]
    return float_model("cnn", nodes, ["N", 1, 4, 4], ["N", 1], weights), weights


def scaled_mlp(generator=rng):
    """:func:`mlp` times a rank-0 weight ``s``, read by the backward (``dY s``) and updated
    through a ``Reshape`` back to rank 0: onnxruntime 1.32 fuses a gate placed on that
    ``Reshape``'s data (a ``Reshape`` before a ``Reshape``) and drops it."""
    model, weights = mlp(generator=generator)
    graph = model.graph
    graph.node[-1].output[0] = "Y0"
    graph.node.append(helper.make_node("Mul", ["Y0", "s"], ["Y"]))
    graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "s"))
    return model, {**weights, "s": np.array(0.5, np.float32)}


#: builder -> operators onnxruntime's fusions put in its optimized graph
FUSED = {
    "mlp": {"FusedGemm"},
    "token_mlp": {"FusedMatMul"},
    "cnn": {"FusedConv"},
    "scaled_mlp": set(),
}


@pytest.mark.parametrize("build", [mlp, token_mlp, cnn, scaled_mlp])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_every_weight_in_place_in_the_graph_onnxruntime_runs(build, optimizer, tmp_path):
    """The update of each weight waits for the backward's reads of it (gates,
    :mod:`onnxgrad.training.step.update_gates`), so every weight has one buffer; and it still
    does in the graph onnxruntime runs after its fusions (the transposed weight folded into
    a ``FusedMatMul`` reading the weight itself): every node reading a weight's buffer
    there is an ancestor of the node writing its new value."""
    model, _ = build(generator=np.random.default_rng(2))
    lr = LearningRateAdam() if optimizer == "adam" else LearningRateSGDNesterov()
    step = make_train_step(model, learning_rate=lr, layout="per_weight")
    assert set(step.weights) <= in_place(step)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(
        step.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    optimized = onnx.load(tmp_path / "optimized.onnx")
    fused = {n.op_type for n in optimized.graph.node if n.domain.startswith("com.microsoft")}
    assert fused >= FUSED[build.__name__]
    updates = dict(zip(step.weights, step.new_weights))
    assert in_place_inputs(optimized, updates) == set(step.weights)


def test_cnn_sharing_every_weight_buffer_equals_the_graph_fed_back():
    """Five momentum steps of the CNN, every weight written over itself, against the step
    graph fed its own outputs."""
    generator = np.random.default_rng(4)
    model, weights = cnn(generator=generator)
    step = make_train_step(model, learning_rate=LearningRateSGDNesterov(), layout="per_weight")
    X = generator.standard_normal((6, 1, 4, 4)).astype(np.float32)
    y = generator.standard_normal((6, 1)).astype(np.float32)
    runner = TrainingRunner(step, check_device("cpu"), weights)
    first, second = runner._sets
    assert all(first.values[w] is second.values[w] for w in step.weights)
    loader = OrtDataLoader(X, y, batch_size=6, random_state=0)
    for _ in range(5):
        runner.run_epoch(loader, 0.001)
    values, _ = reference(step, X, y, weights, 0.001, 5)
    for name, value in runner.get_weights().items():
        np.testing.assert_allclose(value, values[name], rtol=1e-5, atol=1e-6, err_msg=name)
