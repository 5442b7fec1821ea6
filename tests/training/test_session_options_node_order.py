"""The ready order of :mod:`onnxgrad.training.step.node_order`: a topological order with short
waits for onnxruntime 1.19's sorts, computing what the graph as built computes (a deep train
step rearranged trains as the step as built)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad.training import (
    LearningRateAdam,
    OrtDataLoader,
    TrainingRunner,
    make_train_step,
)
from onnxgrad.training.running.devices import check_device
from onnxgrad.training.step.node_order import (
    after_producers,
    place_after_producers,
    producers,
    put_in_ready_order,
    ready_order,
    waiting,
)

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, FLOAT, [2, 2]) for name in inputs],
        [helper.make_tensor_value_info(name, FLOAT, [2, 2]) for name in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_node_reading_only_inputs_moves_to_the_front():
    """``Transpose(w)`` is ready at once: it goes before ``Relu``, which waits for MatMul."""
    node = helper.make_node
    model = _model(
        [
            node("MatMul", ["x", "w"], ["a"]),
            node("Relu", ["a"], ["b"]),
            node("Transpose", ["w"], ["wt"]),
            node("MatMul", ["b", "wt"], ["y"]),
        ],
        ["x", "w"],
        ["y"],
    )
    sources = producers(model.graph.node)
    assert ready_order(sources) == [0, 2, 1, 3]
    assert waiting(sources) == 0 + 0 + 2 + 0
    x = np.array([[1, -2], [3, 4]], np.float32)
    w = np.array([[0.5, -1], [2, 1]], np.float32)
    (y,) = ReferenceEvaluator(put_in_ready_order(model)).run(None, {"x": x, "w": w})
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Transpose", "Relu", "MatMul"]
    np.testing.assert_allclose(y, np.maximum(x @ w, 0) @ w.T, rtol=1e-6)


def test_a_subgraph_waits_for_the_outer_values_it_reads():
    """The ``If`` reads nothing but a graph input, yet its branch reads ``p``: it stays after
    the node computing ``p``."""
    node = helper.make_node
    branch = helper.make_graph(
        [node("Identity", ["p"], ["r"])],
        "then",
        [],
        [helper.make_tensor_value_info("r", FLOAT, [2, 2])],
    )
    other = helper.make_graph(
        [node("Identity", ["x"], ["s"])],
        "else",
        [],
        [helper.make_tensor_value_info("s", FLOAT, [2, 2])],
    )
    model = _model(
        [
            node("Relu", ["x"], ["a"]),
            node("Neg", ["a"], ["p"]),
            node("If", ["c"], ["y"], then_branch=branch, else_branch=other),
        ],
        ["x"],
        ["y"],
    )
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    sources = producers(model.graph.node)
    assert sources == [set(), {0}, {1}]
    assert ready_order(sources) == [0, 1, 2]
    x = np.array([[1, -2], [3, -4]], np.float32)
    (y,) = ReferenceEvaluator(put_in_ready_order(model)).run(None, {"x": x, "c": np.array(True)})
    np.testing.assert_array_equal(y, -np.maximum(x, 0))


def _deep_mlp(depth: int, width: int = 6):
    """``y = tanh(...tanh(x W0 + b0)... ) V``, float32, ``depth`` hidden layers."""
    rng = np.random.default_rng(0)
    node = helper.make_node
    nodes, weights, h = [], [], "x"
    for i in range(depth):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        weights += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(0 * w[0], f"b{i}")]
        nodes += [
            node("MatMul", [h, f"W{i}"], [f"m{i}"]),
            node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            node("Tanh", [f"a{i}"], [f"h{i}"]),
        ]
        h = f"h{i}"
    v = (rng.standard_normal((width, 1)) / np.sqrt(width)).astype(np.float32)
    weights.append(numpy_helper.from_array(v, "V"))
    nodes.append(node("MatMul", [h, "V"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "deep",
        [helper.make_tensor_value_info("x", FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", FLOAT, ["N", 1])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model, {t.name: numpy_helper.to_array(t) for t in weights}


def _in_ready_order(nodes) -> bool:
    return ready_order(producers(nodes)) == list(range(len(nodes)))


def test_a_deep_step_waits_less_in_ready_order():
    """96 layers updated per weight: ``W`` = 1.1 million cells as built, 0.11 rearranged."""
    model, _ = _deep_mlp(96)
    step = make_train_step(model, learning_rate=LearningRateAdam())
    built = list(step.model.graph.node)
    ordered = put_in_ready_order(copy.deepcopy(step.model)).graph.node
    assert _in_ready_order(ordered)
    assert not _in_ready_order(built)
    assert 5 * waiting(producers(ordered)) < waiting(producers(built))
    assert sorted(n.SerializeToString() for n in ordered) == sorted(
        n.SerializeToString() for n in built
    )


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
def test_a_deep_step_in_ready_order_trains_as_the_step_as_built(layout):
    """Three Adam steps of a 24-layer MLP rearranged, through the runner: the losses and
    weights of a plain onnxruntime session on the step as built, fed by hand."""
    model, weights = _deep_mlp(24)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((16, 6)).astype(np.float32)
    y = np.sin(X.sum(axis=1, keepdims=True)).astype(np.float32)
    step = make_train_step(model, learning_rate=LearningRateAdam(), layout=layout)
    lr = 1e-2

    ordered = dataclasses.replace(step, model=put_in_ready_order(copy.deepcopy(step.model)))
    assert not _in_ready_order(step.model.graph.node)
    runner = TrainingRunner(ordered, check_device("cpu"), weights)
    loader = OrtDataLoader(X, y, batch_size=len(X), random_iter=False)
    losses = [float(runner.run_epoch(loader, lr)[0]) for _ in range(3)]

    session = ort.InferenceSession(
        step.model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    lr_input = next(i for i in step.model.graph.input if i.name == step.learning_rate)
    lr_shape = [d.dim_value for d in lr_input.type.tensor_type.shape.dim]
    current, state, expected = dict(weights), step.initial_state(), []
    for _ in range(3):
        feeds = {
            step.features[0]: X,
            step.label: y,
            **step.weight_inputs(current),
            **state,
            step.learning_rate: np.full(lr_shape, lr, np.float32),
        }
        outputs = dict(zip(names, session.run(None, feeds)))
        expected.append(float(outputs[step.loss]))
        current = step.unpack_weights(outputs)
        state = {s: outputs[n] for s, n in zip(step.state, step.new_state)}

    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert expected[2] < expected[0]
    trained = runner.get_weights()
    for name, value in current.items():
        np.testing.assert_allclose(trained[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_movable_nodes_follow_their_last_producer():
    """``c`` (read by ``y``) goes right after ``b``, its last producer; ``k`` reads only an
    input and goes first; the leaves ``y`` and ``z`` keep their places."""
    node = helper.make_node
    model = _model(
        [
            node("Relu", ["x"], ["a"]),
            node("Neg", ["a"], ["b"]),
            node("Abs", ["b"], ["d"]),
            node("Exp", ["d"], ["e"]),
            node("Add", ["b", "a"], ["c"]),  # movable
            node("Neg", ["w"], ["k"]),  # movable, reads an input only
            node("Mul", ["c", "k"], ["y"]),  # a leaf: stays
            node("Sum", ["e", "b"], ["z"]),
        ],
        ["x", "w"],
        ["y", "z"],
    )
    sources = producers(model.graph.node)
    assert after_producers(sources, [4, 5, 6]) == [5, 0, 1, 4, 6, 2, 3, 7]
    place_after_producers(model.graph, lambda n: n.output[0] in {"c", "k", "y"})
    assert [n.output[0] for n in model.graph.node] == ["k", "a", "b", "c", "d", "e", "y", "z"]


def test_a_deep_steps_update_follows_its_gradients(monkeypatch):
    """The per-weight update's nodes other than its leaves come right after what they read
    (Adam's ``(1 - beta) g`` after the gradient, ``beta m`` first): onnxruntime 1.19's sorts
    walk fewer than half the cells of the update emitted at the end, and the step computes
    the same values."""
    import onnxgrad.training.step.composition as composition

    model, weights = _deep_mlp(48)
    step = make_train_step(model, learning_rate=LearningRateAdam())
    monkeypatch.setattr(composition, "place_after_producers", lambda graph, movable: None)
    emitted = make_train_step(model, learning_rate=LearningRateAdam())
    assert 2 * waiting(producers(step.model.graph.node)) < waiting(
        producers(emitted.model.graph.node)
    )
    rng = np.random.default_rng(2)
    feeds = {
        step.features[0]: rng.standard_normal((5, 6)).astype(np.float32),
        step.label: rng.standard_normal((5, 1)).astype(np.float32),
        **step.weight_inputs(weights),
        **step.initial_state(),
        step.learning_rate: np.array(0.01, np.float32),
    }
    results = []
    for built in (step, emitted):
        session = ort.InferenceSession(
            built.model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in session.get_outputs()]
        results.append(dict(zip(names, session.run(None, feeds))))
    for name, value in results[1].items():
        np.testing.assert_array_equal(results[0][name], value, err_msg=name)
