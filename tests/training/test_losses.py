"""Loss values against numpy and scikit-learn; their gradients against finite differences."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.metrics import log_loss

from onnxgrad.training import (
    AbsoluteLearningLoss,
    CrossEntropyLearningLoss,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    LearningRateSGD,
    NegLogLearningLoss,
    SquareLearningLoss,
    make_eval_step,
    make_train_step,
)
from onnxgrad.training.step.losses import select_learning_loss


def shift_model(columns: int):
    """``Y = X + b`` with a zero weight ``b``: the prediction is the input."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "b"], ["Y"])],
        "shift",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, columns])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, columns])],
        [numpy_helper.from_array(np.zeros(columns, np.float32), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def per_sample_square(p, y):
    """The mean over the columns of a sample: ``'mean'`` averages every element."""
    return ((p - y) ** 2).mean(axis=1)


def per_sample_absolute(p, y):
    return np.abs(p - y).mean(axis=1)


def per_sample_elastic(p, y):
    d = p - y
    return (0.3 * np.abs(d) + 0.7 * d * d).mean(axis=1)


def per_sample_logistic(z, y):
    p = sigmoid(z[:, 0])
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def per_sample_two_columns(p, y):
    eps = np.finfo(np.float32).eps
    return -np.log(np.clip(p[np.arange(len(y)), y], eps, 1 - eps))


def per_sample_cross_entropy(z, y):
    return -np.log(softmax(z)[np.arange(len(y)), y])


MEAN = "mean"
#: every loss with the reduction 'mean' (the default 'sum' is checked by
#: test_the_default_reduction_sums_over_the_batch)
CASES = [
    (SquareLearningLoss(reduction=MEAN), 3, "float", per_sample_square),
    (AbsoluteLearningLoss(reduction=MEAN), 2, "float", per_sample_absolute),
    (
        ElasticLearningLoss(l1_weight=0.3, l2_weight=0.7, reduction=MEAN),
        2,
        "float",
        per_sample_elastic,
    ),
    (NegLogLearningLoss(reduction=MEAN), 1, "binary", per_sample_logistic),
    (
        NegLogLearningLoss(probability_function=None, reduction=MEAN),
        2,
        "probabilities",
        per_sample_two_columns,
    ),
    (
        CrossEntropyLearningLoss(probability_function="softmax", reduction=MEAN),
        4,
        "classes",
        per_sample_cross_entropy,
    ),
    (
        CrossEntropyLearningLoss(probability_function=None, reduction=MEAN),
        3,
        "probabilities",
        per_sample_two_columns,
    ),
]


def batch(kind: str, columns: int, n: int = 9, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, columns)).astype(np.float32)
    if kind == "float":
        return X, rng.standard_normal((n, columns)).astype(np.float32)
    if kind == "probabilities":
        X = softmax(X).astype(np.float32)
    return X, rng.integers(0, max(columns, 2), n).astype(np.int64)


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("loss", "columns", "kind", "reference"), CASES)
def test_loss_is_the_weighted_mean_of_the_per_sample_loss(loss, columns, kind, reference, weighted):
    X, y = batch(kind, columns)
    sw = np.random.default_rng(1).uniform(0.5, 2, len(X)).astype(np.float32)
    weight_name = "sw" if weighted else None
    evaluation = make_eval_step(shift_model(columns), ["b"], loss=loss, weight_name=weight_name)
    feeds = {"X": X, evaluation.label: y, "b": np.zeros(columns, np.float32)}
    if weighted:
        feeds["sw"] = sw
    got = run(evaluation.model, feeds)[0]
    per_sample = reference(X.astype(np.float64), y)
    expected = np.average(per_sample, weights=sw if weighted else None)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("loss", "columns", "kind", "reference"), CASES)
def test_one_sgd_step_follows_the_loss_gradient(loss, columns, kind, reference):
    """With ``lr = 1``, ``b' = b - dL/db`` and ``dL/db_k`` is the mean derivative of the
    per-sample loss along column ``k``, checked by central finite differences."""
    X, y = batch(kind, columns, seed=2)
    step = make_train_step(shift_model(columns), ["b"], loss=loss, learning_rate=LearningRateSGD())
    feeds = {"X": X, step.label: y, "b": np.zeros(columns, np.float32)}
    new_b = run(step.model, {**feeds, step.learning_rate: np.array(1.0, np.float32)})[1]

    X64, eps = X.astype(np.float64), 1e-6
    expected = []
    for k in range(columns):
        shift = np.zeros(columns)
        shift[k] = eps
        plus, minus = reference(X64 + shift, y).mean(), reference(X64 - shift, y).mean()
        expected.append((plus - minus) / (2 * eps))
    np.testing.assert_allclose(-new_b, expected, rtol=1e-3, atol=1e-5)


def test_logistic_and_cross_entropy_equal_sklearn_log_loss():
    """The default reduction sums: scikit-learn's log_loss with normalize=False."""
    z, y = batch("binary", 1, n=20)
    evaluation = make_eval_step(shift_model(1), ["b"], loss=NegLogLearningLoss())
    got = run(evaluation.model, {"X": z, evaluation.label: y, "b": np.zeros(1, np.float32)})[0]
    expected = log_loss(y, sigmoid(z[:, 0].astype(np.float64)), normalize=False)
    assert got == pytest.approx(expected, rel=1e-5)

    z, y = batch("classes", 4, n=20)
    evaluation = make_eval_step(
        shift_model(4), ["b"], loss=select_learning_loss("cross_entropy_logits")
    )
    got = run(evaluation.model, {"X": z, evaluation.label: y, "b": np.zeros(4, np.float32)})[0]
    expected = log_loss(y, softmax(z.astype(np.float64)), labels=[0, 1, 2, 3], normalize=False)
    assert got == pytest.approx(expected, rel=1e-5)


def test_elastic_penalty_value_and_gradient():
    X, y = batch("float", 2)
    b = np.array([0.5, -2.0], np.float32)
    penalty = ElasticLearningPenalty(l1=0.2, l2=0.3)
    step = make_train_step(shift_model(2), ["b"], penalty=penalty, learning_rate=LearningRateSGD())
    feeds = {"X": X, step.label: y, "b": b, step.learning_rate: np.array(1.0, np.float32)}
    loss, new_b = run(step.model, feeds)
    residual = X.astype(np.float64) + b - y
    expected_loss = (residual**2).sum() + 0.2 * np.abs(b).sum() + 0.3 * (b**2).sum()
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    gradient = 2 * residual.sum(axis=0) + 0.2 * np.sign(b) + 0.6 * b
    np.testing.assert_allclose(b - new_b, gradient, rtol=1e-5)


def test_select_learning_loss():
    for alias in ("square_error", "squared_error", "l2", "mse"):
        assert select_learning_loss(alias).loss_name == "squared_error"
    assert select_learning_loss("cross_entropy").loss_name == "cross_entropy"
    assert select_learning_loss("softmax_cross_entropy").loss_name == "cross_entropy_logits"
    assert select_learning_loss("log").loss_name == "log"
    assert NegLogLearningLoss().loss_name == "log_logits"
    original = ElasticLearningLoss(0.1, 0.9)
    copy = select_learning_loss(original, reduction="sum")
    assert copy is not original
    assert copy.get_params() == {"l1_weight": 0.1, "l2_weight": 0.9, "reduction": "sum"}
    with pytest.raises(ValueError, match="unknown learning_loss 'hinge'"):
        select_learning_loss("hinge")
    with pytest.raises(ValueError, match="reduction must be one of"):
        select_learning_loss("l1", reduction="average")


def test_bad_loss_configurations():
    with pytest.raises(ValueError, match="'log_logits' needs 1 column"):
        make_eval_step(shift_model(3), ["b"], loss=NegLogLearningLoss())
    with pytest.raises(ValueError, match="unknown probability_function 'tanh'"):
        make_eval_step(shift_model(1), ["b"], loss=NegLogLearningLoss(probability_function="tanh"))
    with pytest.raises(ValueError, match="l1 must be a finite number >= 0"):
        make_train_step(shift_model(1), ["b"], penalty=ElasticLearningPenalty(l1=-1.0))


def test_mean_over_samples_with_symbolic_output_shape():
    """Outputs of unknown width: the number of samples comes from the label's shape."""
    model = shift_model(2)
    for info in (*model.graph.input, *model.graph.output):
        info.type.tensor_type.shape.dim[1].dim_param = "k"
    X, y = batch("float", 2)
    evaluation = make_eval_step(model, ["b"], loss=SquareLearningLoss(reduction=MEAN))
    got = run(evaluation.model, {"X": X, evaluation.label: y, "b": np.zeros(2, np.float32)})[0]
    assert got == pytest.approx(per_sample_square(X.astype(np.float64), y).mean(), rel=1e-5)


@pytest.mark.parametrize("backend", ["onnx", "ort"])
@pytest.mark.parametrize(("loss", "columns", "kind", "reference"), CASES[:3])
def test_zero_sample_weights_do_not_divide_zero_by_zero(loss, columns, kind, reference, backend):
    """scikit-learn allows zero sample weights: a batch of them has the loss 0 and leaves
    the weights as they are; a batch with some is the mean over the others."""
    X, y = batch(kind, columns)
    step = make_train_step(
        shift_model(columns),
        ["b"],
        loss=loss,
        learning_rate=LearningRateSGD(),
        weight_name="sw",
        backend=backend,
    )
    b = np.linspace(-1, 1, columns).astype(np.float32)
    feeds = {"X": X, step.label: y, "b": b, step.learning_rate: np.array(1.0, np.float32)}
    value, new_b = run(step.model, {**feeds, "sw": np.zeros(len(X), np.float32)})
    assert value == 0
    np.testing.assert_array_equal(new_b, b)

    kept = np.arange(len(X)) % 3 == 0
    value = run(step.model, {**feeds, "sw": kept.astype(np.float32)})[0]
    expected = reference(X[kept].astype(np.float64) + b, y[kept]).mean()
    assert value == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("loss", "columns", "kind", "reference"), CASES)
def test_the_default_reduction_sums_over_the_batch(loss, columns, kind, reference):
    """A loss object built without ``reduction`` sums its pointwise loss over every element
    of the batch (the seeds' ``ReduceSum``): the mean case times the number of elements."""
    X, y = batch(kind, columns)
    default = type(loss)(**{**loss.get_params(), "reduction": "sum"})
    assert type(loss)().reduction == "sum"
    evaluation = make_eval_step(shift_model(columns), ["b"], loss=default)
    feeds = {"X": X, evaluation.label: y, "b": np.zeros(columns, np.float32)}
    elements = y.size
    expected = reference(X.astype(np.float64), y).mean() * elements
    assert run(evaluation.model, feeds)[0] == pytest.approx(expected, rel=1e-5)
