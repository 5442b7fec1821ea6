"""The seeds' names onnxgrad keeps (docs/migrating-from-onnxcustom.md), each checked against
numpy, finite differences or onnxruntime itself."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnxruntime.capi._pybind_state import OrtDevice
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad import (
    add_loss_output,
    device_to_providers,
    get_ort_device,
    numpy_to_ort_value,
    ort_device_to_string,
    unreduced_onnx_loss,
)
from onnxgrad.training import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    BaseLearningPenalty,
    BaseLearningRate,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    NoLearningPenalty,
    OrtDataLoader,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    SquareLearningLoss,
    make_eval_step,
)
from tests.derivative.fd import onnx_numerical_vjp, run_onnxruntime
from tests.models import linear_regression_model, seed004_function, seed004_model


def linear_data(n=30):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.1).astype(np.float32)
    return X, y


def test_neg_log_loss_clips_probabilities_at_the_seeds_eps():
    assert NegLogLearningLoss().eps == 1e-5
    model = linear_regression_model(np.zeros((1, 2)), np.zeros(1))
    model.graph.node.append(onnx.helper.make_node("Sigmoid", ["Y"], ["P"]))
    model.graph.output[0].name = "P"
    loss = NegLogLearningLoss(probability_function=None)
    evaluation = make_eval_step(model, ["coefs", "intercept"], loss=loss)
    X = np.array([[40.0, 0.0], [-1.0, 0.5]], np.float32)  # p = 1 - 4e-18: clipped
    y = np.array([0, 1], np.int64)
    feeds = {"X": X, evaluation.label: y, "coefs": np.ones((2, 1), np.float32)}
    feeds["intercept"] = np.zeros(1, np.float32)
    got = run_onnxruntime(evaluation.model, feeds)[evaluation.loss]
    p = np.clip(1 / (1 + np.exp(-X.astype(np.float64).sum(axis=1))), 1e-5, 1 - 1e-5)
    assert got == pytest.approx(-np.log(1 - p[0]) - np.log(p[1]), rel=1e-4)


def test_use_numpy_trains_the_same_weights():
    X, y = linear_data()
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    fitted = [
        OrtGradientForwardBackwardOptimizer(
            model, max_iter=3, learning_rate=0.01, random_state=0
        ).fit(X, y, use_numpy=use_numpy)
        for use_numpy in (False, True)
    ]
    for name, value in fitted[0].get_state().items():
        np.testing.assert_array_equal(fitted[1].get_state()[name], value)


def test_enable_logging_logs_every_epoch(caplog):
    X, y = linear_data()
    est = OrtGradientForwardBackwardOptimizer(
        linear_regression_model(np.zeros((1, 3)), np.zeros(1)),
        max_iter=2,
        learning_rate=0.01,
        enable_logging=True,
    )
    with caplog.at_level(logging.INFO, logger="onnxgrad.training"):
        est.fit(X, y)
    lines = [r.getMessage() for r in caplog.records if r.name == "onnxgrad.training"]
    assert len(lines) == 2 and lines[0].startswith("epoch 1 loss ")
    assert float(lines[1].split()[3]) == pytest.approx(est.train_losses_[1], rel=1e-5)


def test_saved_gradient_is_the_loss_gradient(tmp_path, rng):
    model = add_loss_output(seed004_model())
    path = tmp_path / "gradient.onnx"
    weights = ["init", "init_1", "init_b10"]
    x = rng.standard_normal((5, 2)).astype(np.float32)
    y = seed004_function(x).astype(np.float32) + 0.5
    OrtGradientOptimizer(model, weights, max_iter=1, saved_gradient=str(path)).fit(x, y)
    gradient = onnx.load(path)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    feeds = {"x": x, "label": y, **{w: values[w] for w in weights}}
    got = run_onnxruntime(gradient, feeds)
    expected = onnx_numerical_vjp(
        onnx.utils.Extractor(model).extract_model(["x", "label"], ["loss"]), feeds, weights
    )
    for name in weights:
        np.testing.assert_allclose(got[f"{name}_grad"], expected[name], rtol=1e-4)


def test_random_iter_false_keeps_the_rows_in_order():
    X, y = linear_data(7)
    loader = OrtDataLoader(X, y, batch_size=3, random_iter=False)
    batches = [b[0] for b in loader.iter_numpy()]
    np.testing.assert_array_equal(np.concatenate(batches), X)
    assert [len(b) for b in batches] == [3, 3, 1]
    shuffled = np.concatenate([b[0] for b in OrtDataLoader(X, y, batch_size=3).iter_numpy()])
    assert sorted(shuffled[:, 0]) == sorted(X[:, 0])


def test_select_factories():
    assert isinstance(BaseLearningRate.select("SGD", eta0=0.2), LearningRateSGD)
    assert BaseLearningRate.select(0.3).eta0 == 0.3
    nesterov = BaseLearningRate.select("SGDNesterov", momentum=0.5)
    assert isinstance(nesterov, LearningRateSGDNesterov) and nesterov.momentum == 0.5
    lr = LearningRateSGD()
    assert BaseLearningRate.select(lr) is lr
    with pytest.raises(ValueError, match="unknown learning rate 'rmsprop'"):
        BaseLearningRate.select("rmsprop")
    assert isinstance(BaseLearningLoss.select("square_error"), SquareLearningLoss)
    assert isinstance(BaseLearningLoss.select("absolute_error"), AbsoluteLearningLoss)
    elastic = BaseLearningLoss.select("elastic_error", l1_weight=0.2)
    assert isinstance(elastic, ElasticLearningLoss) and elastic.l1_weight == 0.2
    assert BaseLearningLoss.select("neglog").loss_name == "log_logits"
    assert isinstance(BaseLearningPenalty.select(None), NoLearningPenalty)
    penalty = BaseLearningPenalty.select("elastic", l1=0.1, l2=0.0)
    assert isinstance(penalty, ElasticLearningPenalty) and penalty.l1 == 0.1


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_unreduced_loss_gives_each_observation_its_loss(rng, reduction):
    with_loss = add_loss_output(seed004_model(), reduction=reduction)
    scores = unreduced_onnx_loss(with_loss)
    assert [o.name for o in scores.graph.output] == ["score"]
    x = rng.standard_normal((6, 2)).astype(np.float32)
    label = rng.standard_normal((6, 1)).astype(np.float32)
    got = run_onnxruntime(scores, {"x": x, "label": label})["score"]
    expected = (seed004_function(x) - label) ** 2
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    weighted = add_loss_output(seed004_model(), weight_name="w")
    w = rng.uniform(0.5, 2, 6).astype(np.float32)
    got = run_onnxruntime(unreduced_onnx_loss(weighted), {"x": x, "label": label, "w": w})
    np.testing.assert_allclose(got["score"].ravel(), w * expected.ravel(), rtol=1e-4)


def test_unreduced_loss_refuses_a_penalised_loss():
    with_penalty = add_loss_output(seed004_model(), penalty={"init": 0.1})
    with pytest.raises(ValueError, match="not by one reduction over every axis"):
        unreduced_onnx_loss(with_penalty)


def test_device_helpers():
    device = get_ort_device("cpu")
    assert isinstance(device, OrtDevice) and device.device_type() == OrtDevice.cpu()
    assert get_ort_device(device) is device
    assert ort_device_to_string(device) == "cpu"
    assert device_to_providers("cpu") == device_to_providers(device) == ["CPUExecutionProvider"]
    assert device_to_providers("cuda:1") == ["CUDAExecutionProvider"]
    cuda = get_ort_device("cuda:1")
    assert cuda.device_type() == OrtDevice.cuda() and cuda.device_id() == 1
    assert ort_device_to_string(cuda) == "cuda:1"
    array = np.arange(6, dtype=np.float32).reshape((2, 3))
    value = numpy_to_ort_value(array)
    assert isinstance(value, C_OrtValue) and value.device_name().lower() == "cpu"
    np.testing.assert_array_equal(value.numpy(), array)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_ort_device("tpu")


def _squared_error_graph(columns):
    """loss = ReduceSum((x1 - x2)^2) over inputs of shape [N, columns]."""
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, columns]) for n in ("X1", "X2")
    ]
    nodes = [
        helper.make_node("Sub", ["X1", "X2"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("columns", [1, 3])
def test_unreduced_loss_reduces_rows_only_when_there_are_several_columns(rng, columns):
    scores = unreduced_onnx_loss(_squared_error_graph(columns))
    ops = [n.op_type for n in scores.graph.node]
    assert ("ReduceSum" in ops) == (columns > 1)
    x1 = rng.standard_normal((5, columns)).astype(np.float32)
    x2 = rng.standard_normal((5, columns)).astype(np.float32)
    got = run_onnxruntime(scores, {"X1": x1, "X2": x2})["score"]
    expected = ((x1.astype(np.float64) - x2) ** 2).sum(axis=1, keepdims=True)
    assert got.shape == (5, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
