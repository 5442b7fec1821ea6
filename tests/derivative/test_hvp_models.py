"""``onnx_hvp`` on graph forms the rule table does not build, each found by the sweep of
``benchmarks/coverage_modes.py`` on real models (docs/coverage.md): the Hessian-vector
product of ``loss = sum |y|^2`` equals central differences, in float64, of the reverse
gradient, which autodiff/test_rules.py checks against the outputs' finite differences."""

from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp

DOUBLE = TensorProto.DOUBLE


def _hvp_and_differences(model, feeds: dict, wrt: list[str], eps: float = 1e-6, run=None):
    """``(H v, (g(x + eps v) - g(x - eps v)) / 2 eps)`` per input of ``wrt``, in float64 (the
    HVP graph run by ``run(model)``, default onnx's reference evaluator)."""
    rng = np.random.default_rng(0)
    direction = {n: rng.standard_normal(feeds[n].shape) for n in wrt}
    hvp = onnx_hvp(model, inputs=wrt)
    tangents = {f"{n}_tangent": v for n, v in direction.items()}
    session = (run or ReferenceEvaluator)(hvp)
    got = dict(zip([o.name for o in hvp.graph.output], session.run(None, {**feeds, **tangents})))
    gradient = onnx_derivative(model, weights=[], inputs=wrt, options=DerivativeOptions.Loss)
    session = ReferenceEvaluator(gradient)
    names = [o.name for o in gradient.graph.output]

    def grads(sign):
        moved = {n: feeds[n] + sign * eps * v for n, v in direction.items()}
        return dict(zip(names, session.run(None, {**feeds, **moved})))

    plus, minus = grads(1.0), grads(-1.0)
    return {
        n: (got[f"{n}_grad_tangent"], (plus[f"{n}_grad"] - minus[f"{n}_grad"]) / (2 * eps))
        for n in wrt
    }


def test_if_branch_keeps_the_ranks_its_declarations_give():
    """Inside an ``If``, ``r = Reshape(x, shape)`` with a shape of unknown length has no
    inferred rank; the branch declares it (as normalisation does where inference stops, in
    silero's VAD the LSTM state). The first derivative's branch recomputes ``r``; without
    the declaration there, differentiating that gradient again (the HVP) refused the
    ``Gather`` of ``r`` for want of its rank."""
    then_branch = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Gather", ["r", "index"], ["g"], axis=1),
            helper.make_node("Mul", ["g", "g"], ["y_then"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("y_then", DOUBLE, [2, 2])],
        [helper.make_tensor("index", TensorProto.INT64, [2], [2, 0])],
        value_info=[helper.make_tensor_value_info("r", DOUBLE, [2, 3])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Slice", ["x", "start", "end", "axis"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", DOUBLE, [2, 2])],
        [
            helper.make_tensor(n, TensorProto.INT64, [1], [v])
            for n, v in (("start", 0), ("end", 2), ("axis", 1))
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch
            ),
            helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0),
        ],
        "if_rank",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", DOUBLE, [2, 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = np.random.default_rng(1).standard_normal((2, 3))
    feeds = {"cond": np.array(True), "x": x, "shape": np.array([2, 3], np.int64)}
    ((got, expected),) = _hvp_and_differences(model, feeds, ["x"]).values()
    assert np.abs(expected).max() > 1e-2
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_gradient_keeps_the_ranks_declared_where_inference_stops():
    """``r = Reshape(x, shape)`` with a shape of unknown length: the model declares the rank
    of ``r`` (paddle2onnx's OCR recogniser: a ``Conv`` after such a ``Reshape``), the reverse
    gradient reads it; the gradient graph lost the declaration, and differentiating it again
    (the HVP) refused the ``Gather`` of ``r`` for want of its rank."""
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Gather", ["r", "index"], ["g"], axis=1),
            helper.make_node("Mul", ["g", "g"], ["y"]),
            helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0),
        ],
        "declared_rank",
        [
            helper.make_tensor_value_info("x", DOUBLE, [2, 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
        [helper.make_tensor("index", TensorProto.INT64, [2], [2, 0])],
        value_info=[helper.make_tensor_value_info("r", DOUBLE, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = np.random.default_rng(2).standard_normal((2, 3))
    feeds = {"x": x, "shape": np.array([2, 3], np.int64)}
    ((got, expected),) = _hvp_and_differences(model, feeds, ["x"]).values()
    assert np.abs(expected).max() > 1e-2
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_reverse_graph_ranks_declared_before_the_transposition():
    """A paddle2onnx classifier's head at its opset 13 (ch_ppocr_mobile_v2.0_cls): MaxPool,
    global pooling,
    a flatten to ``[batch, -1]`` whose batch goes through an int32 ``Cast``, a linear layer,
    Softmax over a ``Flatten`` reshaped back by a computed shape. The gradients come back
    through ``Reshape(g, Shape(x))``, of static length but no rank for onnx's inference;
    differentiating the first derivative's reverse graph again (the transposition) refused
    the ``GatherElements`` of MaxPool's second derivative for want of that rank."""
    constants = [
        helper.make_node(
            "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], [value])
        )
        for name, value in (("zero", 0), ("one", 1), ("features", 4))
    ]
    rng = np.random.default_rng(3)
    weight = helper.make_tensor("w", DOUBLE, [4, 3], rng.standard_normal(12).tolist())
    bias = helper.make_tensor("b", DOUBLE, [3], rng.standard_normal(3).tolist())
    nodes = [
        *constants,
        helper.make_node("MaxPool", ["x"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["pooled"], ["mean"]),
        helper.make_node("Shape", ["mean"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_int32"], to=TensorProto.INT32),
        helper.make_node("Slice", ["shape_int32", "zero", "one", "zero", "one"], ["batch"]),
        helper.make_node("Cast", ["batch"], ["batch64"], to=TensorProto.INT64),
        helper.make_node("Concat", ["batch64", "features"], ["target"], axis=-1),
        helper.make_node("Reshape", ["mean", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["linear"]),
        helper.make_node("Add", ["linear", "b"], ["logits"]),
        helper.make_node("Shape", ["logits"], ["logits_shape"]),
        helper.make_node("Flatten", ["logits"], ["rows"], axis=1),
        helper.make_node("Softmax", ["rows"], ["probabilities"], axis=-1),
        helper.make_node("Reshape", ["probabilities", "logits_shape"], ["y"]),
        helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier_head",
        [helper.make_tensor_value_info("x", DOUBLE, ["batch", 4, "height", "width"])],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=9)
    feeds = {"x": rng.standard_normal((1, 4, 2, 4))}  # MaxPool's tangent gathers 32 values
    ((got, expected),) = _hvp_and_differences(model, feeds, ["x"]).values()
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_layer_normalization_statistics_against_numpy_differences():
    """``LayerNormalization`` with its ``Mean`` and ``InvStdDev`` outputs used: float32 by the
    specification (``stash_type=1``) beside a float64 ``Y``. onnx's reference evaluator returns
    them in float64, so it cannot run the gradient graph (a float64 statistic times a float32
    constant); onnxruntime runs the HVP, and the reference is numpy: mixed central differences
    of the loss in float64, ``(L(+e v + d u) - L(+e v - d u) - L(-e v + d u) + L(-e v - d u)) /
    4 e d`` along each coordinate ``u``."""
    import onnxruntime

    shape, axes = (2, 3, 2), (1, 2)
    nodes = [
        helper.make_node(
            "LayerNormalization", ["X", "scale", "B"], ["y", "mean", "inv_std"], axis=1
        ),
        *[
            helper.make_node("ReduceSumSquare", [name], [f"{name}_sq"], keepdims=0)
            for name in ("y", "mean", "inv_std")
        ],
        helper.make_node("Cast", ["mean_sq"], ["mean_sq64"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["inv_std_sq"], ["inv_std_sq64"], to=TensorProto.DOUBLE),
        helper.make_node("Sum", ["y_sq", "mean_sq64", "inv_std_sq64"], ["loss"]),
    ]
    inputs = {"X": shape, "scale": shape[1:], "B": shape[1:]}
    graph = helper.make_graph(
        nodes,
        "layer_norm_statistics",
        [helper.make_tensor_value_info(n, DOUBLE, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal(s) for n, s in inputs.items()}
    direction = {n: rng.standard_normal(s) for n, s in inputs.items()}

    def loss(values):
        x = values["X"]
        mean = x.mean(axis=axes, keepdims=True)
        inv_std = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
        y = (x - mean) * inv_std * values["scale"] + values["B"]
        return np.sum(y**2) + np.sum(mean**2) + np.sum(inv_std**2)

    def moved(e, name, index, d):
        values = {n: v + e * direction[n] for n, v in feeds.items()}
        values[name] = values[name].copy()
        values[name][index] += d
        return loss(values)

    step = 1e-4
    hvp = onnx_hvp(model, inputs=list(inputs))
    session = onnxruntime.InferenceSession(
        hvp.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    tangents = {f"{n}_tangent": v for n, v in direction.items()}
    names = [o.name for o in hvp.graph.output]
    got = dict(zip(names, session.run(None, {**feeds, **tangents})))
    for name in inputs:
        expected = np.zeros(feeds[name].shape)
        for index in np.ndindex(*expected.shape):
            corners = [moved(e, name, index, d) for e in (step, -step) for d in (step, -step)]
            expected[index] = (corners[0] - corners[1] - corners[2] + corners[3]) / (4 * step**2)
        np.testing.assert_allclose(
            got[f"{name}_grad_tangent"], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max()
        )


def _silero_tail() -> tuple:
    """The end of silero_vad_half.onnx: ``p = Sigmoid(x)`` (``[batch, 1, T]``), an ``If``
    whose branches give different ranks (``Squeeze`` of axis 1 when it has size 1, else
    ``p``), ``ReduceMean`` over axis 1 without keepdims and an ``Unsqueeze`` back to
    ``[batch, 1]``; the loss weights its square, ``sum r y^2``."""
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    then_branch = helper.make_graph(
        [helper.make_node("Squeeze", ["p", "axis"], ["y_then"])],
        "then",
        [],
        [helper.make_tensor_value_info("y_then", DOUBLE, None)],
        [axis],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["p"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", DOUBLE, None)],
    )
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["p"]),
        helper.make_node("Shape", ["p"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["width"], axis=0),
        helper.make_node("Equal", ["width", "one"], ["cond"]),
        helper.make_node(
            "If", ["cond"], ["branch"], then_branch=then_branch, else_branch=else_branch
        ),
        helper.make_node("ReduceMean", ["branch"], ["mean"], axes=[1], keepdims=0),
        helper.make_node("Unsqueeze", ["mean", "axis"], ["y"]),
        helper.make_node("Mul", ["y", "y"], ["square"]),
        helper.make_node("Mul", ["square", "r"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "silero_tail",
        [helper.make_tensor_value_info("x", DOUBLE, ["batch", 1, 5])],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
        [
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
            axis,
            helper.make_tensor("r", DOUBLE, [1], [0.7]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 1, 5))}
    return model, feeds


def test_unbroadcast_of_a_size_one_cotangent_keeps_its_rank():
    """silero_vad_half.onnx's HVP (by transposition: the ``If`` has no tangent rule) failed
    in onnxruntime: the third-order graph squeezed the ``[1, 1]`` cotangent of the
    ``Unsqueeze`` output to a scalar. The loss's gradient undoes a broadcast with a
    ReduceSum over axes computed at run time (none here); differentiated, that ReduceSum
    unsqueezes by those axes, and the Unsqueeze's gradient was a Squeeze by the same empty
    axes tensor, which removes every size-1 axis. It is a Reshape to the input there."""
    model, feeds = _silero_tail()
    compared = _hvp_and_differences(model, feeds, ["x"], run=_onnxruntime)
    for name, (got, expected) in compared.items():
        assert got.shape == feeds[name].shape
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def _onnxruntime(model):
    return onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
