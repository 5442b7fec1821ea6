"""The models and estimators the data-parallel tests train, built the same way by the
pytest process (one process, global batch) and by every torchrun rank (per-rank batch)."""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxgrad import (
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    add_loss_output,
)
from onnxgrad.training import ElasticLearningPenalty

#: rows per rank and per batch; one process takes RANKS times as many
BATCH = 8
RANKS = 2
EPOCHS = 2


def _model(nodes, inputs, outputs, weights, opset: int = 18) -> ModelProto:
    graph = helper.make_graph(
        nodes, "case", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in weights.items()]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mlp_regression() -> tuple[ModelProto, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = {
        "W1": rng.standard_normal((4, 8)).astype(np.float32) * 0.5,
        "b1": np.zeros(8, np.float32),
        "W2": rng.standard_normal((8, 1)).astype(np.float32) * 0.5,
        "b2": np.zeros(1, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["t"]),
        helper.make_node("MatMul", ["t", "W2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["Y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])],
        weights,
    )
    X = rng.standard_normal((75, 4)).astype(np.float32)
    y = np.sin(X).sum(axis=1, keepdims=True).astype(np.float32)
    return model, X, y


def small_cnn() -> tuple[ModelProto, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    weights = {
        "conv_w": rng.standard_normal((3, 1, 3, 3)).astype(np.float32) * 0.3,
        "conv_b": np.zeros(3, np.float32),
        "fc_w": rng.standard_normal((48, 3)).astype(np.float32) * 0.2,
        "fc_b": np.zeros(3, np.float32),
        "shape": np.array([0, -1], dtype=np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["X", "conv_w", "conv_b"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "shape"], ["f"]),
        helper.make_node("MatMul", ["f", "fc_w"], ["m"]),
        helper.make_node("Add", ["m", "fc_b"], ["logits"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 1, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 3])],
        weights,
    )
    X = rng.standard_normal((61, 1, 6, 6)).astype(np.float32)
    y = (X[:, 0, :3].sum(axis=(1, 2)) > 0).astype(np.int64) + (X[:, 0, 3:].mean(axis=(1, 2)) > 0.2)
    return model, X, y.astype(np.int64)


def sklearn_classifier() -> tuple[ModelProto, np.ndarray, np.ndarray]:
    from skl2onnx import to_onnx
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression

    X, y = make_classification(
        70, n_features=5, n_informative=4, n_redundant=0, n_classes=3, random_state=0
    )
    X = X.astype(np.float32)
    est = LogisticRegression().fit(X[:20], y[:20])
    model = to_onnx(est, X[:1], options={id(est): {"zipmap": False}}, target_opset=15)
    return model, X, y.astype(np.int64)


CASES = ("mlp", "classifier", "classifier_column_labels", "cnn", "model_loss_sum")


def estimators(batch_size: int, names=CASES) -> dict:
    """``{case: (estimator, X, y)}`` for the cases ``names``, each exercising another part:
    Nesterov with a penalty and early stopping; Adam on a converted classifier (labels
    ``[N]``, then ``[N, 1]``); a CNN with momentum; a loss summed over the batch that the
    model computes itself (told apart on the data)."""
    common = {"batch_size": batch_size, "random_state": 5, "intra_op_num_threads": 1}
    return {name: _CASES[name](common) for name in names}


def _mlp(common):
    mlp, X, y = mlp_regression()
    estimator = OrtGradientForwardBackwardOptimizer(
        mlp,
        max_iter=3,
        learning_rate="Nesterov",
        learning_penalty=ElasticLearningPenalty(l1=1e-3, l2=1e-2),
        early_stopping=True,
        n_iter_no_change=1,
        **common,
    )
    return estimator, X, y


def _classifier(common):
    clf, X, y = sklearn_classifier()
    estimator = OrtGradientForwardBackwardOptimizer(
        clf,
        max_iter=EPOCHS,
        learning_rate="Adam",
        learning_loss="cross_entropy",
        output="probabilities",
        **common,
    )
    return estimator, X, y


def _classifier_column_labels(common):
    estimator, X, y = _classifier(common)
    return estimator, X, y.reshape(-1, 1)


def _cnn(common):
    cnn, X, y = small_cnn()
    estimator = OrtGradientForwardBackwardOptimizer(
        cnn,
        max_iter=EPOCHS,
        learning_rate="Momentum",
        learning_loss="cross_entropy_logits",
        **common,
    )
    return estimator, X, y


def _model_loss_sum(common):
    mlp, X, y = mlp_regression()
    summed = add_loss_output(mlp, score_name="squared_error", reduction="sum")
    estimator = OrtGradientOptimizer(
        summed, ["W1", "b1", "W2", "b2"], max_iter=EPOCHS, learning_rate=1e-3, **common
    )
    return estimator, X, y


_CASES = {
    "mlp": _mlp,
    "classifier": _classifier,
    "classifier_column_labels": _classifier_column_labels,
    "cnn": _cnn,
    "model_loss_sum": _model_loss_sum,
}
