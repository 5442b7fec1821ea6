"""Real converter output: scikit-learn models converted by skl2onnx (cached, small).

* ``LinearRegression`` with float64 input: skl2onnx writes standard ops (MatMul, Add,
  Reshape) for doubles, whereas float32 input gives the ``ai.onnx.ml`` LinearRegressor.
* ``MLPRegressor`` (float32): Cast, MatMul, Add, Relu, Reshape.
* ``LogisticRegression`` with float64 input and ``zipmap=False``: the probabilities come from
  standard ops (MatMul, Add, Sigmoid or Softmax, ReduceSum, Div); only the label branch uses
  ``ai.onnx.ml`` ArrayFeatureExtractor. Float32 input gives the ``ai.onnx.ml``
  LinearClassifier instead.
* ``MLPClassifier`` (float32, ``zipmap=False``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnx import ModelProto
from skl2onnx import to_onnx
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.neural_network import MLPClassifier, MLPRegressor

OPSET = 15


@dataclass(frozen=True)
class Converted:
    estimator: object
    onnx: ModelProto
    X: np.ndarray
    y: np.ndarray


def _data(n_classes: int | None, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    X = rng.standard_normal((40, 3))
    score = X @ np.array([1.0, -2.0, 0.5]) + 0.3 + 0.1 * rng.standard_normal(40)
    if n_classes is None:
        return X.astype(dtype), score
    edges = np.quantile(score, np.linspace(0, 1, n_classes + 1)[1:-1])
    return X.astype(dtype), np.searchsorted(edges, score)


def _fit(estimator, X, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return estimator.fit(X, y)


@functools.cache
def linear_regression() -> Converted:
    X, y = _data(None, np.float64)
    est = _fit(LinearRegression(), X, y)
    return Converted(est, to_onnx(est, X[:1], target_opset=OPSET), X, y)


@functools.cache
def mlp_regressor(hidden: tuple[int, ...] = (4,)) -> Converted:
    X, y = _data(None)
    est = _fit(MLPRegressor(hidden_layer_sizes=hidden, max_iter=50, random_state=0), X, y)
    return Converted(est, to_onnx(est, X[:1], target_opset=OPSET), X, y.astype(np.float32))


@functools.cache
def logistic_regression(n_classes: int = 2) -> Converted:
    X, y = _data(n_classes, np.float64)
    est = _fit(LogisticRegression(), X, y)
    options = {id(est): {"zipmap": False}}
    return Converted(est, to_onnx(est, X[:1], target_opset=OPSET, options=options), X, y)


@functools.cache
def mlp_classifier() -> Converted:
    X, y = _data(2)
    est = _fit(MLPClassifier(hidden_layer_sizes=(4,), max_iter=50, random_state=0), X, y)
    options = {id(est): {"zipmap": False}}
    return Converted(est, to_onnx(est, X[:1], target_opset=OPSET, options=options), X, y)


def run(model: ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of ``model`` computed by onnxruntime on CPU, by name."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))
