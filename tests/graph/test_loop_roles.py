"""Weight roles inside ``Loop`` and ``Scan`` bodies (onnxgrad.graph._loop_roles).

Before, every initializer a body read counted as a weight (epsilons, fill values, scales,
a recurrence's initial state). The bodies are walked now, their inputs bound to the outer
values; the default weights' gradient is checked against float64 central differences.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.graph import get_train_initializer
from tests.derivative.fd import onnx_numerical_vjp

F = TensorProto.FLOAT
node = helper.make_node
T, B, D, H = 4, 2, 3, 5


def _f32(rng, *shape, scale=0.5):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inits, inputs, outputs):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _rnn_scan(rng, weight_in_body: bool = False, kernels_in_body: bool = False):
    """An RNN cell as a ``Scan`` body: ``h' = tanh(x_t W + h R + b)``, masked by ``Where``
    (fill 0), RMS-normalised (epsilon) and halved; a head after the ``Scan``. With
    ``weight_in_body`` the kernel ``W`` is a ``Constant`` node of the body; with
    ``kernels_in_body`` ``W``, ``R``, ``b`` and the epsilon are initializers of the body."""
    w = _f32(rng, D, H)
    body_nodes = [
        node("MatMul", ["x_t", "W"], ["xw"]),
        node("MatMul", ["h_in", "R"], ["hr"]),
        node("Add", ["xw", "hr"], ["pre"]),
        node("Add", ["pre", "b"], ["pre_b"]),
        node("Tanh", ["pre_b"], ["h_out"]),
        node("Where", ["keep", "h_out", "fill"], ["masked"]),
        node("Mul", ["masked", "masked"], ["square"]),
        node("ReduceMean", ["square", "last"], ["mean"]),
        node("Add", ["mean", "eps"], ["guarded"]),
        node("Sqrt", ["guarded"], ["rms"]),
        node("Div", ["masked", "rms"], ["normed"]),
        node("Mul", ["normed", "half"], ["y_t"]),
    ]
    if weight_in_body:
        body_nodes.insert(0, node("Constant", [], ["W"], value=numpy_helper.from_array(w)))
    inits = {
        "h0": np.zeros((B, H), np.float32),
        "R": _f32(rng, H, H),
        "b": _f32(rng, H),
        "keep": np.array([True, False, True, True, True]),
        "fill": np.float32(0.0),
        "last": np.array([-1], np.int64),
        "eps": np.float32(1e-5),
        "half": np.float32(0.5),
        "head": _f32(rng, H, 2),
    }
    if not weight_in_body:
        inits["W"] = w
    inner = {k: inits.pop(k) for k in ("W", "R", "b", "eps")} if kernels_in_body else {}
    body = helper.make_graph(
        body_nodes,
        "cell",
        [
            helper.make_tensor_value_info("h_in", F, [B, H]),
            helper.make_tensor_value_info("x_t", F, [B, D]),
        ],
        [
            helper.make_tensor_value_info("h_out", F, [B, H]),
            helper.make_tensor_value_info("y_t", F, [B, H]),
        ],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inner.items()],
    )
    nodes = [
        node("Scan", ["h0", "x"], ["h_last", "ys"], body=body, num_scan_inputs=1),
        node("MatMul", ["h_last", "head"], ["y"]),
    ]
    return _model(nodes, inits, [("x", F, [T, B, D])], [("y", [B, 2]), ("ys", [T, B, H])])


def _counted_loop(rng):
    """A ``Loop`` over the rows of ``x`` (its trip count read from ``x``'s shape, a condition
    given: the reference evaluator runs no iteration without one) summing
    ``x_i W + c`` plus a position ``i * step`` into a carried value ``s' = s R + ...``
    starting at zeros of a shape read from ``x``; a head after the ``Loop``."""
    body = helper.make_graph(
        [
            node("Gather", ["x", "i"], ["row"], axis=0),
            node("MatMul", ["row", "W"], ["rw"]),
            node("Add", ["rw", "c"], ["rwc"]),
            node("MatMul", ["acc_in", "R"], ["carried"]),
            node("Add", ["carried", "rwc"], ["summed"]),
            node("Cast", ["i"], ["i_float"], to=F),
            node("Mul", ["i_float", "step"], ["position"]),
            node("Add", ["summed", "position"], ["acc_out"]),
            node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "loop",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", F, [B, H]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", F, [B, H]),
        ],
    )
    nodes = [
        node("Shape", ["x"], ["shape"]),
        node("Gather", ["shape", "zero"], ["trips"], axis=0),
        node("Slice", ["shape", "one", "two"], ["batch"]),
        node("Concat", ["batch", "width"], ["start_shape"], axis=0),
        node(
            "ConstantOfShape",
            ["start_shape"],
            ["acc0"],
            value=numpy_helper.from_array(np.zeros(1, np.float32)),
        ),
        node("Loop", ["trips", "go", "acc0"], ["acc_last"], body=body),
        node("MatMul", ["acc_last", "head"], ["y"]),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "go": np.array(True),
        "one": np.array([1], np.int64),
        "two": np.array([2], np.int64),
        "width": np.array([H], np.int64),
        "W": _f32(rng, D, H),
        "R": _f32(rng, H, H),
        "c": _f32(rng, H),
        "step": np.float32(0.25),
        "head": _f32(rng, H, 2),
    }
    return _model(nodes, inits, [("x", F, [T, B, D])], [("y", [B, 2])])


def test_a_scan_bodys_kernels_and_bias_are_weights_its_constants_are_not():
    """``W``, ``R``, ``b`` (and the head) are weights; the initial state, the mask's fill,
    the epsilon and the scale are not (before: all of them were weights)."""
    rng = np.random.default_rng(0)
    assert set(get_train_initializer(_rnn_scan(rng))) == {"W", "R", "b", "head"}
    promoted = get_train_initializer(_rnn_scan(rng, weight_in_body=True))
    assert set(promoted) == {"W", "R", "b", "head"}


def test_a_loops_kernel_and_bias_are_weights_its_counter_scale_and_start_are_not():
    rng = np.random.default_rng(1)
    assert set(get_train_initializer(_counted_loop(rng))) == {"W", "R", "c", "head"}


@pytest.mark.parametrize("build", [_rnn_scan, _counted_loop], ids=["scan", "loop"])
def test_the_gradient_of_body_weights_against_float64_differences(build):
    """The default weights of a body differentiate: onnx_derivative's gradient equals
    float64 central differences of the file."""
    rng = np.random.default_rng(2)
    model = build(rng)
    names = list(get_train_initializer(model))
    gradient = onnx_derivative(model, inputs=[], weights=names)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {"x": _f32(rng, T, B, D, scale=1.0)}
    outputs = [o.name for o in model.graph.output]
    shapes = {"y": (B, 2), "ys": (T, B, H)}
    seeds = [rng.standard_normal(shapes[o]).astype(np.float32) for o in outputs]
    fed = {**feeds, **{f"{o}_grad": s for o, s in zip(outputs, seeds)}}
    fed.update((n, values[n]) for n in names)
    declared = [i.name for i in gradient.graph.input]
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(
        zip(
            [o.name for o in gradient.graph.output],
            session.run(None, {k: fed[k] for k in declared}),
            strict=True,
        )
    )
    point = {**feeds, **{n: values[n] for n in names}}
    want = onnx_numerical_vjp(model, point, names, seeds=seeds, eps=1e-6)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-6)
        assert np.abs(want[name]).max() > 1e-2


def test_a_scan_bodys_own_initializers_are_weights_by_their_role_and_go_back_there():
    """Kernels stored as initializers of the body itself (before: never weights, the main
    graph's alone were) are lifted to the main graph by normalisation and read by role (the
    body's scalar epsilon is not lifted); their gradient equals float64 differences of the
    same model with them in the main graph, and trained values go back into the body."""
    from onnxgrad.normalize.trained import trained_model

    model = _rnn_scan(np.random.default_rng(3), kernels_in_body=True)
    flat = _rnn_scan(np.random.default_rng(3))
    names = list(get_train_initializer(model))
    assert set(names) == {"W", "R", "b", "head"}
    rng = np.random.default_rng(4)
    gradient = onnx_derivative(model, inputs=[], weights=names)
    values = {i.name: numpy_helper.to_array(i) for i in flat.graph.initializer}
    feeds = {"x": _f32(rng, T, B, D, scale=1.0)}
    seeds = [
        rng.standard_normal((B, 2)).astype(np.float32),
        rng.standard_normal((T, B, H)).astype(np.float32),
    ]
    fed = {**feeds, "y_grad": seeds[0], "ys_grad": seeds[1], **{n: values[n] for n in names}}
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    declared = [i.name for i in gradient.graph.input]
    outputs = session.run(None, {k: fed[k] for k in declared})
    got = dict(zip([o.name for o in gradient.graph.output], outputs, strict=True))
    want = onnx_numerical_vjp(flat, {**feeds, **{n: values[n] for n in names}}, names, seeds=seeds)
    for name in names:
        np.testing.assert_allclose(got[f"{name}_grad"], want[name], rtol=1e-4, atol=1e-6)
    new = {n: values[n] + np.float32(1) for n in names}
    back = trained_model(model, new)
    body = back.graph.node[0].attribute[0].g
    assert sorted(i.name for i in body.initializer) == ["R", "W", "b", "eps"]
    assert sorted(i.name for i in back.graph.initializer) == sorted(
        i.name for i in model.graph.initializer
    )
    inner = {i.name: numpy_helper.to_array(i) for i in body.initializer}
    for name in ("W", "R", "b"):
        np.testing.assert_array_equal(inner[name], new[name])
