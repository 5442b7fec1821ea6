"""add_loss_output: every loss against numpy, scikit-learn or torch, run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.metrics import log_loss

from onnxgrad.graph import add_loss_output
from tests.graph.sklearn_models import (
    linear_regression,
    logistic_regression,
    mlp_classifier,
    mlp_regressor,
    run,
)
from tests.models import linear_regression_model, seed004_function, seed004_model

OPSETS = [13, 17, 18, 21]
REGRESSION_SCORES = ["squared_error", "l2", "absolute_error", "l1", "elastic"]


def regression_reference(
    score, prediction, label, weight=None, l1_weight=0.5, l2_weight=0.5, reduction="sum"
):
    d = (prediction - label).reshape((prediction.shape[0], -1)).astype(np.float64)
    per_element = {
        "squared_error": d**2,
        "l2": d**2,
        "absolute_error": np.abs(d),
        "l1": np.abs(d),
        "elastic": l1_weight * np.abs(d) + l2_weight * d**2,
    }[score]
    if reduction == "sum":
        per_sample = per_element.sum(axis=1)
        return per_sample.sum() if weight is None else (weight * per_sample).sum()
    return np.average(per_element.mean(axis=1), weights=weight)


def softmax_model(opset: int, n_classes: int = 3, dtype=np.float32) -> onnx.ModelProto:
    """p = softmax(x @ W + b) with outputs [p, z] (z the logits)."""
    rng = np.random.default_rng(3)
    W = rng.standard_normal((4, n_classes)).astype(dtype)
    b = rng.standard_normal((n_classes,)).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["z"]),
            helper.make_node("Softmax", ["z"], ["p"], axis=1),
        ],
        "softmax",
        [helper.make_tensor_value_info("x", elem, [None, 4])],
        [
            helper.make_tensor_value_info("p", elem, [None, n_classes]),
            helper.make_tensor_value_info("z", elem, [None, n_classes]),
        ],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def softmax_reference(model, x):
    W, b = (numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer)
    z = x.astype(np.float64) @ W + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True), z


def check_pure_and_valid(before: bytes, original: onnx.ModelProto, result: onnx.ModelProto):
    assert original.SerializeToString() == before
    onnx.checker.check_model(result, full_check=True)
    assert result.ir_version <= 10
    assert [(o.domain, o.version) for o in result.opset_import] == [
        (o.domain, o.version) for o in original.opset_import
    ]


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("score", REGRESSION_SCORES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_regression_losses_on_seed004(rng, opset, score, weighted, reduction):
    model = seed004_model(opset)
    before = model.SerializeToString()
    x = rng.standard_normal((7, 2)).astype(np.float32)
    label = rng.standard_normal((7, 1)).astype(np.float32)
    weight = rng.uniform(0.1, 2.0, 7).astype(np.float32) if weighted else None

    result = add_loss_output(
        model, score_name=score, weight_name="w" if weighted else None, reduction=reduction
    )

    check_pure_and_valid(before, model, result)
    assert [o.name for o in result.graph.output] == ["loss", "y"]
    assert [i.name for i in result.graph.input] == ["x", "label", *(["w"] if weighted else [])]
    feeds = {"x": x, "label": label, **({"w": weight} if weighted else {})}
    got = run(result, feeds)
    assert got["loss"].shape == ()
    expected = regression_reference(score, seed004_function(x), label, weight, reduction=reduction)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-4)
    np.testing.assert_allclose(got["y"], seed004_function(x), rtol=1e-4, atol=1e-5)


def test_elastic_coefficients_and_rank1_output(rng):
    model = linear_regression().onnx
    X, y = linear_regression().X, linear_regression().y
    result = add_loss_output(model, "elastic", weight_name="w", l1_weight=0.1, l2_weight=0.9)
    label_info = next(i for i in result.graph.input if i.name == "label")
    assert label_info.type.tensor_type.elem_type == TensorProto.DOUBLE
    w = rng.uniform(0.5, 1.5, len(X))
    got = run(result, {"X": X, "label": y.reshape((-1, 1)), "w": w})
    prediction = linear_regression().estimator.predict(X).reshape((-1, 1))
    expected = regression_reference("elastic", prediction, y.reshape((-1, 1)), w, 0.1, 0.9)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-10)


def test_label_copies_the_prediction_type_and_weight_is_one_dimensional():
    result = add_loss_output(seed004_model(), weight_name="w")
    inputs = {i.name: i for i in result.graph.input}
    output = next(o for o in seed004_model().graph.output if o.name == "y")
    assert inputs["label"].type == output.type
    weight_shape = inputs["w"].type.tensor_type.shape.dim
    assert len(weight_shape) == 1
    assert inputs["w"].type.tensor_type.elem_type == TensorProto.FLOAT


def test_squared_error_on_mlp_regressor_with_penalties():
    conv = mlp_regressor()
    est = conv.estimator
    penalty = {"coefficient": {"l1": 0.01, "l2": 0.02}, "intercepts1": 0.5}
    result = add_loss_output(conv.onnx, penalty=penalty, reduction="sum")
    got = run(result, {"X": conv.X, "label": conv.y.reshape((-1, 1))})
    prediction = est.predict(conv.X).reshape((-1, 1))
    W, b1 = est.coefs_[0], est.intercepts_[1]
    expected = (
        ((prediction - conv.y.reshape((-1, 1))) ** 2).sum()
        + 0.01 * np.abs(W).sum()
        + 0.02 * (W**2).sum()
        + 0.5 * (b1**2).sum()
    )
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-4)


def test_penalty_on_a_double_weight_of_a_float_loss_is_cast(rng):
    W = np.array([[0.5], [-1.0]], dtype=np.float32)
    b = np.array([1.5, -2.0])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Cast", ["b"], ["b32"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["xw", "b32"], ["y"]),
        ],
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    result = add_loss_output(model, penalty={"b": {"l1": 2.0}}, reduction="sum")
    x = rng.standard_normal((3, 2)).astype(np.float32)
    label = np.zeros((3, 2), dtype=np.float32)
    got = run(result, {"x": x, "label": label})
    expected = ((x @ W + b) ** 2).sum() + 2.0 * 3.5
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_log_loss_on_logistic_regression_matches_sklearn(rng, weighted):
    conv = logistic_regression()
    before = conv.onnx.SerializeToString()
    result = add_loss_output(
        conv.onnx, "log", weight_name="w" if weighted else None, output_index="probabilities"
    )
    check_pure_and_valid(before, conv.onnx, result)
    assert [o.name for o in result.graph.output] == ["loss", "probabilities"]
    assert {n.domain for n in result.graph.node} == {""}
    label_info = next(i for i in result.graph.input if i.name == "label")
    assert label_info.type.tensor_type.elem_type == TensorProto.INT64
    w = rng.uniform(0.1, 3.0, len(conv.y)) if weighted else None
    feeds = {"X": conv.X, "label": conv.y.astype(np.int64), **({"w": w} if weighted else {})}
    got = run(result, feeds)
    expected = log_loss(
        conv.y, conv.estimator.predict_proba(conv.X), sample_weight=w, normalize=False
    )
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-9)


def test_log_loss_on_mlp_classifier_defaults_to_the_probability_output():
    conv = mlp_classifier()
    result = add_loss_output(conv.onnx, "log")
    assert [o.name for o in result.graph.output] == ["loss", "probabilities"]
    got = run(result, {"X": conv.X, "label": conv.y.astype(np.int64)})
    expected = log_loss(conv.y, conv.estimator.predict_proba(conv.X), normalize=False)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)


def test_log_loss_clips_probabilities():
    conv = logistic_regression()
    result = add_loss_output(conv.onnx, "log", eps=0.2)
    proba = conv.estimator.predict_proba(conv.X)
    got = run(result, {"X": conv.X, "label": conv.y.astype(np.int64)})
    clipped = np.clip(proba, 0.2, 0.8)
    expected = -np.sum(np.log(clipped[np.arange(len(conv.y)), conv.y]))
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-9)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_on_probabilities(rng, opset, weighted):
    model = softmax_model(opset)
    x = rng.standard_normal((9, 4)).astype(np.float32)
    y = rng.integers(0, 3, 9)
    w = rng.uniform(0.1, 2.0, 9).astype(np.float32) if weighted else None
    result = add_loss_output(model, "cross_entropy", weight_name="w" if weighted else None)
    feeds = {"x": x, "label": y.astype(np.int64), **({"w": w} if weighted else {})}
    got = run(result, feeds)
    p, _ = softmax_reference(model, x)
    expected = log_loss(y, p, sample_weight=w, labels=[0, 1, 2], normalize=False)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)


@pytest.mark.parametrize("opset", [13, 18])
def test_cross_entropy_on_logits_matches_torch(rng, opset):
    torch = pytest.importorskip("torch")
    model = softmax_model(opset, n_classes=4)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    w = rng.uniform(0.1, 2.0, 6).astype(np.float32)
    result = add_loss_output(model, "cross_entropy_logits", weight_name="w", output_index=1)
    assert [o.name for o in result.graph.output] == ["loss", "z"]
    got = run(result, {"x": x, "label": y.astype(np.int64), "w": w})
    _, z = softmax_reference(model, x)
    per_sample = torch.nn.functional.cross_entropy(
        torch.tensor(z), torch.tensor(y), reduction="none"
    ).numpy()
    np.testing.assert_allclose(got["loss"], (w * per_sample).sum(), rtol=1e-5)


def test_label_of_shape_n_by_1_is_accepted_at_run_time_through_reshape(rng):
    result = add_loss_output(softmax_model(13), "cross_entropy")
    label = next(i for i in result.graph.input if i.name == "label")
    assert len(label.type.tensor_type.shape.dim) == 1


@pytest.mark.parametrize(
    "score", ["squared_error", "absolute_error", "elastic", "cross_entropy", "logits"]
)
def test_loss_graph_is_differentiable_by_onnxruntime_training(rng, tmp_path, score):
    """onnxruntime-training's builder differentiates the loss graph; its gradient matches torch."""
    torch = pytest.importorskip("torch")
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    model = softmax_model(15)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 5).astype(np.float32)
    classification = score in ("cross_entropy", "logits")
    label = rng.integers(0, 3, 5) if classification else rng.random((5, 3)).astype(np.float32)
    kwargs = {"output_index": "z"} if score == "logits" else {}
    names = {"cross_entropy": "cross_entropy", "logits": "cross_entropy_logits"}
    result = add_loss_output(
        model,
        names.get(score, score),
        weight_name="w",
        penalty={"W": {"l1": 0.1, "l2": 0.2}},
        **kwargs,
    )
    builder = GradientGraphBuilder(result.SerializeToString(), {"loss"}, {"W", "b"}, "loss")
    builder.build()
    path = str(tmp_path / "grad.onnx")
    builder.save(path)
    feeds = {"x": x, "label": label.astype(np.int64) if classification else label, "w": w}
    got = run(onnx.load(path), feeds)

    W0, b0 = (numpy_helper.to_array(i) for i in model.graph.initializer)
    W = torch.tensor(W0.astype(np.float64), requires_grad=True)
    b = torch.tensor(b0.astype(np.float64), requires_grad=True)
    z = torch.tensor(x.astype(np.float64)) @ W + b
    tw = torch.tensor(w.astype(np.float64))
    if classification:
        per_sample = torch.nn.functional.cross_entropy(z, torch.tensor(label), reduction="none")
        data = (tw * per_sample).sum()
    else:
        d = torch.softmax(z, dim=1) - torch.tensor(label.astype(np.float64))
        e = {
            "squared_error": d**2,
            "absolute_error": d.abs(),
            "elastic": 0.5 * d.abs() + 0.5 * d**2,
        }
        data = (tw * e[score].sum(dim=1)).sum()
    loss = data + 0.1 * W.abs().sum() + 0.2 * (W**2).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["W_grad"], W.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["b_grad"], b.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_other_outputs_and_their_nodes_are_dropped():
    conv = logistic_regression(3)
    result = add_loss_output(conv.onnx, "cross_entropy", output_index="probabilities")
    ops = {n.op_type for n in result.graph.node}
    assert "ArgMax" not in ops
    assert "ArrayFeatureExtractor" not in ops
    got = run(result, {"X": conv.X, "label": conv.y.astype(np.int64)})
    expected = log_loss(conv.y, conv.estimator.predict_proba(conv.X), normalize=False)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-9)


def test_accepts_a_path(tmp_path, rng):
    path = tmp_path / "seed.onnx"
    onnx.save(seed004_model(), path)
    result = add_loss_output(str(path), "l1", reduction="sum")
    x = rng.standard_normal((4, 2)).astype(np.float32)
    label = rng.standard_normal((4, 1)).astype(np.float32)
    got = run(result, {"x": x, "label": label})
    np.testing.assert_allclose(got["loss"], np.abs(seed004_function(x) - label).sum(), rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"score_name": "hinge"}, ValueError, "unknown loss 'hinge'"),
        ({"score_name": 3}, TypeError, "loss name must be a string"),
        ({"reduction": "avg"}, ValueError, r"reduction must be one of \['sum', 'mean'\]"),
        ({"output_index": "nope"}, ValueError, "unknown output 'nope'"),
        ({"output_index": 5}, ValueError, "out of range"),
        ({"output_index": 1.5}, TypeError, "output_index"),
        ({"label_name": "x"}, ValueError, "label_name='x' already exists"),
        ({"loss_name": "out_add_0"}, ValueError, "loss_name='out_add_0' already exists"),
        ({"weight_name": "init"}, ValueError, "weight_name='init' already exists"),
        ({"weight_name": "label"}, ValueError, "different names"),
        ({"penalty": {"coef": 0.1}}, ValueError, r"unknown initializers \['coef'\]"),
        ({"penalty": {"init_2": 0.1}}, ValueError, "'init_2', which is not a float"),
        ({"penalty": {"init": {"l3": 1.0}}}, ValueError, "keys 'l1', 'l2'"),
        ({"penalty": {"init": -1.0}}, ValueError, "must be a number >= 0"),
        ({"penalty": [0.1]}, TypeError, "penalty must be a dict"),
        ({"output_index": "out_add_0"}, ValueError, "unknown output 'out_add_0'"),
        ({"l1_weight": 0.1}, TypeError, r"no options \['l1_weight'\]"),
        ({"score_name": "elastic", "l1_weight": "a"}, ValueError, "l1_weight"),
        ({"score_name": "log", "eps": 0.7}, ValueError, "eps must be"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    model = seed004_model()
    before = model.SerializeToString()
    with pytest.raises(error, match=match):
        add_loss_output(model, **kwargs)
    assert model.SerializeToString() == before


def test_classification_errors():
    with pytest.raises(
        ValueError, match=r"'log' needs 1 or 2 column.*'p' has shape.*cross_entropy"
    ):
        add_loss_output(softmax_model(15), "log")
    with pytest.raises(ValueError, match="eps must be"):
        add_loss_output(softmax_model(15), "cross_entropy", eps=0.7)
    with pytest.raises(TypeError, match="'cross_entropy_logits' on logits"):
        add_loss_output(softmax_model(15), "cross_entropy", probabilities=False)
    with pytest.raises(ValueError, match=r"computed by (the )?Softmax node.*use 'cross_entropy'"):
        add_loss_output(softmax_model(15), "cross_entropy_logits", output_index="p")
    with pytest.raises(ValueError, match=r"'log_logits' needs 1 column.*cross_entropy_logits"):
        add_loss_output(softmax_model(15), "log_logits", output_index="z")
    with pytest.raises(ValueError, match="output 'label' is not a float tensor"):
        add_loss_output(logistic_regression().onnx, "log", output_index="label")


def test_old_opsets_are_converted_to_13(rng):
    fresh = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    model = helper.make_model(fresh.graph, opset_imports=[helper.make_opsetid("", 12)])
    result = add_loss_output(model)
    assert {o.domain: o.version for o in result.opset_import}[""] == 13
    x = rng.standard_normal((5, 2)).astype(np.float32)
    label = rng.standard_normal((5, 1)).astype(np.float32)
    got = run(result, {"X": x, "label": label})
    expected = ((x @ np.array([[1.0], [-1.0]]) + 0.5 - label) ** 2).sum()
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)


def test_penalty_on_a_weight_the_prediction_does_not_use():
    model = seed004_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "spare"))
    with pytest.raises(ValueError, match=r"penalty on initializers \['spare'\], which 'y'"):
        add_loss_output(model, penalty={"spare": 1.0})


def test_log_loss_accepts_bfloat16_probabilities():
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "bf16",
        [helper.make_tensor_value_info("X", TensorProto.BFLOAT16, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.BFLOAT16, ["N", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(add_loss_output(model, "log"), full_check=True)


@pytest.mark.parametrize("score", ["log", "cross_entropy"])
def test_weighted_class_losses_are_zero_not_nan_when_every_weight_is_zero(score):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["P"])],
        "probabilities",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["N", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with_loss = add_loss_output(model, score, weight_name="weight")
    feeds = {
        "X": np.array([[0.3, 0.7], [0.9, 0.1]], np.float32),
        "label": np.array([1, 0], np.int64),
        "weight": np.zeros(2, np.float32),
    }
    loss = ort.InferenceSession(
        with_loss.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(["loss"], feeds)[0]
    assert loss == 0


@pytest.mark.parametrize("bad", [3, -1, 7])
@pytest.mark.parametrize("score", ["cross_entropy", "cross_entropy_logits"])
def test_an_out_of_range_class_label_makes_the_loss_nan_not_zero(rng, score, bad):
    model = softmax_model(17)
    result = add_loss_output(model, score, output_index="p" if score == "cross_entropy" else "z")
    x = rng.standard_normal((4, 4)).astype(np.float32)
    y = np.array([0, 1, bad, 2], np.int64)
    assert np.isnan(run(result, {"x": x, "label": y})["loss"])


@pytest.mark.parametrize("bad", [2, -1])
@pytest.mark.parametrize("score", ["log", "log_logits"])
def test_an_out_of_range_binary_label_makes_the_loss_nan(score, bad):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["P"])],
        "column",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("P", TensorProto.FLOAT, ["N", 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    result = add_loss_output(model, score)
    feeds = {"X": np.array([[0.3], [0.6]], np.float32), "label": np.array([1, bad], np.int64)}
    assert np.isnan(run(result, feeds)["loss"])
    feeds["label"] = np.array([1, 0], np.int64)
    p = np.array([0.3, 0.6]) if score == "log" else 1 / (1 + np.exp(-np.array([0.3, 0.6])))
    expected = log_loss([1, 0], p, normalize=False)
    np.testing.assert_allclose(run(result, feeds)["loss"], expected, rtol=1e-6)


def _identity_model(dims) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "identity",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, dims)],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, dims)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def test_log_loss_on_an_output_of_unknown_columns_reads_one_or_two():
    model = add_loss_output(_identity_model([None, None]), "log", eps=1e-6)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    p = np.array([0.0, 0.0, 0.2, 0.5, 0.8, 1.0, 1.0])
    y = np.array([0, 1, 0, 1, 1, 1, 0], dtype=np.int64)
    expected = log_loss(y, np.clip(p, 1e-6, 1 - 1e-6), normalize=False)
    for columns in (np.vstack([1 - p, p]).T, p.reshape((-1, 1))):
        got = session.run(None, {"X": columns, "label": y})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-9)
    three = np.full((7, 3), 1 / 3)  # not a binary prediction: NaN, never a silent number
    assert np.isnan(session.run(None, {"X": three, "label": y})[0])
