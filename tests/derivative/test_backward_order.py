"""The order in which onnxruntime runs a gradient graph's backward.

* Backward nodes computed from forward values only wait for the output gradient (with
  ``recompute``): on the gradient graphs of a LayerNorm MLP and of an attention block every
  backward node with a float output depends on the seed ``loss_grad`` (only shape
  computations may run before it), and the gradients equal those of the graph without the
  pass (onnxruntime) and float64 finite differences.
* Weight gradients run as soon as the backward reaches them (always): checked on the
  graph's leaf order and on onnxruntime's profile, for gradient graphs and for train steps
  of both layouts whose weights come in any order.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from onnxgrad.derivative import DerivativeOptions, late_backward
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime
from tests.derivative.test_attention_tiles import WEIGHTS, attention_model

FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE}


def layer_norm_mlp(dtype=np.float64) -> onnx.ModelProto:
    """``loss = sum(LayerNorm(tanh(x W1)) W2)``: LayerNorm's gradient recomputes the
    normalised input from forward values, and the MatMuls' from transposed weights."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 6)).astype(dtype), "W1"),
        numpy_helper.from_array(rng.standard_normal((6, 2)).astype(dtype), "W2"),
        numpy_helper.from_array((1 + rng.random(6)).astype(dtype), "gamma"),
        numpy_helper.from_array(rng.standard_normal(6).astype(dtype), "beta"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="h"),
        helper.make_node("Tanh", ["h"], ["t"], name="t"),
        helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], name="n", axis=-1),
        helper.make_node("MatMul", ["n", "W2"], ["y"], name="y"),
        helper.make_node("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "ln_mlp",
        [helper.make_tensor_value_info("x", elem, ["batch", 4])],
        [helper.make_tensor_value_info("loss", elem, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _float_backward_nodes_independent_of(gradient, forward, seed) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(gradient)
    elem = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    elem.update({o.name: o.type.tensor_type.elem_type for o in inferred.graph.output})
    depends = {seed}
    early = []
    for node in gradient.graph.node:
        if depends.intersection(node.input):
            depends.update(node.output)
        elif (
            node.name not in forward
            and node.op_type != "Constant"
            and node.op_type not in late_backward.ALIASES  # views hold no memory
            and any(elem.get(o) in FLOATS for o in node.output)
        ):
            early.append(f"{node.op_type} {node.name}")
    return early


def _gradients(model, weights, recompute):
    return onnx_derivative(model, weights, ["x"], DerivativeOptions.Zero, recompute=recompute)


def test_layer_norm_backward_waits_for_the_gradient():
    model = layer_norm_mlp()
    weights = ["W1", "W2", "gamma", "beta"]
    plain = _gradients(model, weights, None)
    delayed = _gradients(model, weights, "attention")
    forward = {n.name for n in model.graph.node}
    assert _float_backward_nodes_independent_of(plain, forward, "loss_grad")
    assert not _float_backward_nodes_independent_of(delayed, forward, "loss_grad")
    feeds = {
        "x": np.random.default_rng(1).standard_normal((3, 4)),
        "loss_grad": np.array(1.5),
        **{i.name: numpy_helper.to_array(i) for i in model.graph.initializer},
    }
    names = [o.name for o in delayed.graph.output]
    result = dict(zip(names, ReferenceEvaluator(delayed).run(None, feeds)))
    expected = onnx_numerical_vjp(model, feeds, ["x", *weights], seeds=[np.array(1.5)])
    for name, value in expected.items():
        np.testing.assert_allclose(result[f"{name}_grad"], value, rtol=1e-6, atol=1e-8)


def test_attention_backward_waits_for_the_gradient_in_onnxruntime():
    model = attention_model("causal", np.float32)
    for index, node in enumerate(model.graph.node):
        node.name = node.name or f"forward{index}"
    delayed = _gradients(model, WEIGHTS, "attention")
    forward = {n.name for n in model.graph.node}
    forward |= {n.name for n in delayed.graph.node if n.name.startswith("attention/softmax")}
    assert not _float_backward_nodes_independent_of(delayed, forward, "loss_grad")
    x = np.random.default_rng(2).standard_normal((2, 5, 6)).astype(np.float32)
    feeds = {
        "x": x,
        "loss_grad": np.array(0.5, np.float32),
        **{i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in WEIGHTS},
    }
    plain = run_onnxruntime(_gradients(model, WEIGHTS, None), feeds)
    result = run_onnxruntime(delayed, feeds)
    for name, value in plain.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-6)


def tanh_mlp(layers: int = 4, reduce: bool = True) -> onnx.ModelProto:
    """``loss = sum(tanh(... tanh(x W0) ... W{layers-1}))`` in float64 (without the sum,
    output ``y``, if not ``reduce``)."""
    rng = np.random.default_rng(0)
    sizes = [4] + [8] * (layers - 1) + [2]
    inits, nodes, last = [], [], "x"
    for k in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal(sizes[k : k + 2]), f"W{k}"))
        nodes += [
            helper.make_node("MatMul", [last, f"W{k}"], [f"h{k}"], name=f"h{k}"),
            helper.make_node("Tanh", [f"h{k}"], [f"t{k}"], name=f"t{k}"),
        ]
        last = f"t{k}"
    if reduce:
        nodes.append(helper.make_node("ReduceSum", [last], ["loss"], name="loss", keepdims=0))
        output = helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"], name="y"))
        output = helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 2])
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 4])],
        [output],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _onnxruntime_order(model: onnx.ModelProto, feeds: dict) -> dict[str, int]:
    """Node name -> rank in which onnxruntime ran it (its profile, written to a temporary
    folder: not the working directory)."""
    import json
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = f"{folder}/order"
        session = ort.InferenceSession(model.SerializeToString(), options)
        session.run(None, feeds)
        with open(session.end_profiling()) as profile:
            events = json.load(profile)
    ran = [
        e["name"].removesuffix("_kernel_time")
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    return {name: i for i, name in enumerate(ran)}


def _each_gradient_before_the_next_layers(model, when: dict[str, int], layers: int) -> None:
    """dW_k runs before dW_{k-1}: the gradient reaching layer k - 1 (which dW_{k-1} needs)
    does not run first and keep dW_k's inputs alive."""
    producer = {o: n.name for n in model.graph.node for o in n.output}
    for k in range(1, layers):
        assert when[producer[f"W{k}_grad"]] < when[producer[f"W{k - 1}_grad"]], k


def test_weight_gradients_are_leaves_in_order_of_readiness():
    """onnxruntime walks back from the leaf of highest position first: the weight nearest
    the loss must be last, so its gradient runs as soon as the backward reaches it (checked
    on onnxruntime's profile: each layer's weight gradient runs before the next layer's
    input gradient)."""
    model = tanh_mlp()
    weights = [f"W{k}" for k in range(4)]
    gradient = onnx_derivative(model, weights, ["x"], DerivativeOptions.Loss, loss="loss")
    producer = {o: n.name for n in gradient.graph.node for o in n.output}
    positions = {n.name: i for i, n in enumerate(gradient.graph.node)}
    order = [positions[producer[f"{w}_grad"]] for w in weights]
    assert order == sorted(order)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 4))}
    feeds |= {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    when = _onnxruntime_order(gradient, feeds)
    _each_gradient_before_the_next_layers(gradient, when, 4)


@pytest.mark.parametrize("recompute", [None, "attention"])
@pytest.mark.parametrize("layout", ["flat", "per_weight"])
@pytest.mark.parametrize("weight_order", ["forward", "backward", "shuffled"])
def test_train_step_runs_each_weight_gradient_when_reached(layout, weight_order, recompute):
    """The update reads every gradient: emitted in the weights' order, the walk reached the
    first listed weight's gradient first and, through it, the whole backward (the flat
    layout's ``Concat`` of every gradient, the per-weight updates alike); emitted in order
    of readiness, each weight's gradient runs when the backward reaches its layer whatever
    the weights' order (with ``recompute='attention'``, the late backward's gates also
    order them). The step's results do not depend on that order."""
    from onnxgrad.training import make_train_step
    from onnxgrad.training.step.learning_rate import LearningRateAdam

    layers = 5
    model = tanh_mlp(layers, reduce=False)
    weights = {
        "forward": [f"W{k}" for k in range(layers)],
        "backward": [f"W{k}" for k in reversed(range(layers))],
        "shuffled": ["W2", "W0", "W4", "W1", "W3"],
    }[weight_order]
    step = make_train_step(
        model, weights, learning_rate=LearningRateAdam(), layout=layout, recompute=recompute
    )
    initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rng = np.random.default_rng(3)
    x, label = rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    when = _onnxruntime_order(step.model, _step_feeds(step, initial, x, label))
    _each_gradient_before_the_next_layers(step.model, when, layers)
    reference = make_train_step(model, learning_rate=LearningRateAdam())
    expected = _new_weights(reference, _step_feeds(reference, initial, x, label))
    for name, value in _new_weights(step, _step_feeds(step, initial, x, label)).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-12)


def _step_feeds(step, weights: dict, x: np.ndarray, label: np.ndarray) -> dict:
    feeds = {"x": x, step.label: label, "learning_rate": np.array(0.01), **step.initial_state()}
    return feeds | step.weight_inputs({w: weights[w] for w in step.weights})


def _new_weights(step, feeds: dict) -> dict[str, np.ndarray]:
    outputs = run_onnxruntime(step.model, {i.name: feeds[i.name] for i in step.model.graph.input})
    return step.unpack_weights(outputs)


def sigmoid_mlp(layers: int = 3) -> onnx.ModelProto:
    """``loss = sum(sigmoid(... sigmoid(x W0) ... W{layers-1}))`` in float32: each
    Sigmoid's gradient ``g s (1 - s)`` has a ``1 - s`` computed from forward values only."""
    model = tanh_mlp(layers)
    for node in model.graph.node:
        if node.op_type == "Tanh":
            node.op_type = "Sigmoid"
    return _retyped(model, np.float32)


def _retyped(model: onnx.ModelProto, dtype) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs, outputs and initializers are of ``dtype``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for info in [*copy.graph.input, *copy.graph.output]:
        info.type.tensor_type.elem_type = elem
    for index, tensor in enumerate(copy.graph.initializer):
        array = numpy_helper.to_array(tensor).astype(dtype)
        copy.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))
    return copy


def test_backward_reading_the_loss_seed_constant_waits_for_the_gradient():
    """With a scalar loss the output gradient is a constant 1, equal to the ``1`` of the
    Sigmoid rule's ``1 - s``: the two were merged, the ``Sub`` read the seed, counted as
    depending on it and was left ungated, and onnxruntime ran it in the forward (each
    layer's ``1 - s`` and ``s (1 - s)`` alive from the forward to their layer's backward: 2
    of the 6 activations a layer an 8-layer Llama held at its step's peak). The seed now
    stays its own value: no ``Sub`` reads it, each ``1 - s`` reads a gated value, and the
    gradients are the finite differences'."""
    layers = 3
    model = sigmoid_mlp(layers)
    weights = [f"W{k}" for k in range(layers)]
    gradient = onnx_derivative(
        model, weights, [], DerivativeOptions.Loss, loss="loss", recompute="attention"
    )
    seed = {o for n in gradient.graph.node if n.name.startswith("loss_seed/") for o in n.output}
    assert len(seed) == 1
    readers = [n for n in gradient.graph.node if seed.intersection(n.input)]
    assert readers and all(n.op_type != "Sub" for n in readers)
    gated = {
        n.name
        for n in gradient.graph.node
        if n.op_type == "Sub" and any("_gated" in name for name in n.input)
    }
    # the last layer's backward starts from the seed: nothing deeper to wait for
    assert gated == {f"t{k}_Grad/Sub" for k in range(layers - 1)}
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    result = run_onnxruntime(gradient, {"x": x, **values})
    feeds = {"x": x.astype(np.float64), **{k: v.astype(np.float64) for k, v in values.items()}}
    expected = onnx_numerical_vjp(
        _retyped(model, np.float64), feeds, weights, seeds=[np.array(1.0)]
    )
    for name, value in expected.items():
        np.testing.assert_allclose(result[f"{name}_grad"], value, rtol=1e-4, atol=1e-5)
