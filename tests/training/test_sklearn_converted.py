"""scikit-learn models converted by skl2onnx with its default options train and differentiate.

For each model of the matrix (and a second target opset):

1. the lowered model's outputs equal the converted model's (onnxruntime, random inputs);
2. the gradients of a loss with respect to the input and every weight equal float64 central
   finite differences;
3. an estimator trained from a perturbed start reaches a test score (R² or accuracy)
   within 0.02 of scikit-learn's own fit on the same data;
4. ``get_trained_onnx()`` runs in plain onnxruntime with the converter's outputs (same
   names and types, ZipMap included).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pytest
import sklearn

pytest.importorskip("skl2onnx")

from onnx import numpy_helper
from skl2onnx import to_onnx
from sklearn.datasets import make_classification, make_regression
from sklearn.decomposition import PCA
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import (
    ElasticNet,
    Lasso,
    LinearRegression,
    LogisticRegression,
    Ridge,
    SGDClassifier,
    SGDRegressor,
)
from sklearn.metrics import accuracy_score, r2_score
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import (
    MinMaxScaler,
    Normalizer,
    PolynomialFeatures,
    StandardScaler,
)
from sklearn.svm import SVC, SVR, LinearSVC, LinearSVR

from onnxgrad import OrtGradientForwardBackwardOptimizer, onnx_derivative
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.graph import (
    add_loss_output,
    get_train_initializer,
    lower_ml_operators,
    replace_initializers_into_onnx,
)
from tests.derivative.fd import onnx_numerical_vjp

#: target opsets: skl2onnx's default, and one other
OPSETS = [None, 15]
_ORT_MAX_OPSET = 21 if tuple(map(int, ort.__version__.split(".")[:2])) < (1, 20) else 99


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], object]
    task: str  # "regression", "binary", "multiclass"
    #: the learning_loss the estimator trains with (the output the converter exposes)
    loss: str
    #: the add_loss_output score of the gradient check
    score: str
    #: the labels ``learning_loss`` trains on, from the class indices ``y`` (``None``: ``y``)
    target: Callable[[np.ndarray], np.ndarray] | None = None
    #: why training reaches no accuracy near scikit-learn's on this output: check (3) then
    #: asserts that training lowered the loss on the training set instead
    not_sklearn_objective: str = ""


def _mlp(cls, **kwargs):
    return cls(hidden_layer_sizes=(6,), max_iter=2000, random_state=0, **kwargs)


def _svc(kernel: str, probability: bool = False) -> Callable[[], SVC]:
    def make() -> SVC:
        if not probability:
            return SVC(kernel=kernel, random_state=0)
        if "probability" not in SVC().get_params():  # deprecated in 1.9, gone in 1.11
            pytest.skip(f"scikit-learn {sklearn.__version__} has no SVC(probability=True)")
        return SVC(kernel=kernel, probability=True, random_state=0)

    return make


def _swapped(y: np.ndarray) -> np.ndarray:
    """skl2onnx writes a binary SVC's scores as ``[d, -d]``, ``d`` scikit-learn's decision
    function (positive for class 1): column 0 is the logit of class 1."""
    return 1 - y


#: skl2onnx's output of a multi-class SVC without probabilities
_SVC_VOTES = (
    "the output is votes + confidences/3 (one-vs-rest shape computed from the one-vs-one "
    "scores): the votes are piecewise constant, so cross-entropy on it moves only the "
    "bounded confidences; measured, it lowers the accuracy of scikit-learn's own solution "
    "(0.75 to 0.66 on this test set after 150 epochs)"
)


CASES = [
    Case("LinearRegression", LinearRegression, "regression", "squared_error", "squared_error"),
    Case("Ridge", lambda: Ridge(alpha=0.1), "regression", "squared_error", "squared_error"),
    Case("Lasso", lambda: Lasso(alpha=0.01), "regression", "squared_error", "squared_error"),
    Case(
        "ElasticNet",
        lambda: ElasticNet(alpha=0.01),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "SGDRegressor",
        lambda: SGDRegressor(random_state=0),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "LinearSVR",
        lambda: LinearSVR(random_state=0),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "MLPRegressor",
        lambda: _mlp(MLPRegressor),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "PCA+LinearRegression",
        lambda: make_pipeline(PCA(3), LinearRegression()),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "StandardScaler+MLPRegressor",
        lambda: make_pipeline(StandardScaler(), _mlp(MLPRegressor)),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "MinMaxScaler+MLPRegressor",
        lambda: make_pipeline(MinMaxScaler(), _mlp(MLPRegressor)),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "PolynomialFeatures+Ridge",
        lambda: make_pipeline(PolynomialFeatures(2), Ridge(alpha=0.1)),
        "regression",
        "squared_error",
        "squared_error",
    ),
    Case(
        "LogisticRegression-binary",
        LogisticRegression,
        "binary",
        "log",
        "log",
    ),
    Case(
        "LogisticRegression-3",
        LogisticRegression,
        "multiclass",
        "cross_entropy",
        "cross_entropy",
    ),
    Case(
        "SGDClassifier-log_loss",
        lambda: SGDClassifier(loss="log_loss", random_state=0),
        "binary",
        "log",
        "log",
    ),
    Case(
        "LinearSVC",
        lambda: LinearSVC(random_state=0),
        "binary",
        "log_logits",
        "squared_error",
    ),
    Case(
        "MLPClassifier-binary",
        lambda: _mlp(MLPClassifier),
        "binary",
        "log",
        "log",
    ),
    Case(
        "MLPClassifier-3",
        lambda: _mlp(MLPClassifier),
        "multiclass",
        "cross_entropy",
        "cross_entropy",
    ),
    Case(
        "Normalizer+MLPClassifier-3",
        lambda: make_pipeline(Normalizer(), _mlp(MLPClassifier)),
        "multiclass",
        "cross_entropy",
        "cross_entropy",
    ),
]
CASES += [
    Case("SVR-rbf", lambda: SVR(kernel="rbf"), "regression", "squared_error", "squared_error"),
    Case(
        "SVC-linear",
        _svc("linear"),
        "binary",
        "cross_entropy_logits",
        "cross_entropy_logits",
        target=_swapped,
    ),
    Case(
        "SVC-rbf",
        _svc("rbf"),
        "binary",
        "cross_entropy_logits",
        "cross_entropy_logits",
        target=_swapped,
    ),
    Case(
        "SVC-rbf-3",
        _svc("rbf"),
        "multiclass",
        "cross_entropy_logits",
        "cross_entropy_logits",
        not_sklearn_objective=_SVC_VOTES,
    ),
    Case("SVC-poly-probability", _svc("poly", True), "binary", "log", "log"),
    Case(
        "SVC-rbf-probability-3",
        _svc("rbf", True),
        "multiclass",
        "cross_entropy",
        "cross_entropy",
    ),
]
BY_NAME = {case.name: case for case in CASES}


def _data(task: str):
    if task == "regression":
        X, y = make_regression(160, 4, n_informative=4, noise=5.0, random_state=0)
        y = (y - y.mean()) / y.std()
    else:
        n_classes = 2 if task == "binary" else 3
        X, y = make_classification(
            240, 4, n_informative=3, n_redundant=0, n_classes=n_classes, random_state=1
        )
    X = X.astype(np.float32)
    return X[:120], y[:120], X[120:], y[120:]


@dataclass(frozen=True)
class Fitted:
    case: Case
    estimator: object
    onnx: object
    data: tuple

    @property
    def opset(self) -> int:
        return max(op.version for op in self.onnx.opset_import if op.domain in ("", "ai.onnx"))


@functools.cache
def fitted(name: str, target_opset: int | None) -> Fitted:
    case = BY_NAME[name]
    data = _data(case.task)
    estimator = case.make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", FutureWarning)  # SVC(probability=True), scikit-learn 1.9
        estimator.fit(data[0], data[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # SVC.probA_, scikit-learn 1.9
        converted = to_onnx(estimator, data[0][:1], target_opset=target_opset)
    return Fitted(case, estimator, converted, data)


def _get(name: str, target_opset: int | None) -> Fitted:
    model = fitted(name, target_opset)
    if model.opset > _ORT_MAX_OPSET:
        pytest.skip(f"onnxruntime {ort.__version__} loads opsets up to {_ORT_MAX_OPSET}")
    return model


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _outputs(model, X) -> dict:
    session = _session(model)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"X": X})))


def _assert_outputs_equal(got: dict, expected: dict, rtol: float) -> None:
    for name, value in expected.items():
        if isinstance(value, list):  # ZipMap: one dictionary per row
            assert [list(row) for row in got[name]] == [list(row) for row in value]
            np.testing.assert_allclose(
                [list(r.values()) for r in got[name]], [list(r.values()) for r in value], rtol=rtol
            )
        elif value.dtype.kind in "iuO":
            np.testing.assert_array_equal(got[name], value)
        else:
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-5)


NAMES = [case.name for case in CASES]


@pytest.mark.parametrize("target_opset", OPSETS)
@pytest.mark.parametrize("name", NAMES)
def test_lowered_outputs_equal_the_converted_model(name, target_opset, rng):
    model = _get(name, target_opset)
    lowered = lower_ml_operators(model.onnx)
    assert "ai.onnx.ml" not in {n.domain for n in lowered.graph.node if n.op_type != "ZipMap"}
    X = (rng.standard_normal((25, 4)) * 2).astype(np.float32)
    expected = _outputs(model.onnx, X)
    got = _outputs(lowered, X)
    assert list(got)[: len(expected)] == list(expected)
    _assert_outputs_equal(got, expected, rtol=1e-5)


@pytest.mark.parametrize("target_opset", OPSETS)
@pytest.mark.parametrize("name", NAMES)
def test_input_and_weight_gradients_match_finite_differences(name, target_opset):
    model = _get(name, target_opset)
    case = model.case
    X, y = model.data[0][:6], model.data[1][:6]
    label = y.astype(np.int64) if case.task != "regression" else y.reshape(-1, 1).astype(np.float32)
    if case.name == "LinearSVC":
        label = np.where(y > 0, 1.0, -1.0).reshape(-1, 1).astype(np.float32)
    with_loss = add_loss_output(model.onnx, case.score)
    weights = list(get_train_initializer(with_loss))
    assert weights, "a converted model has weights to train"
    grad = onnx_derivative(with_loss, options=DerivativeOptions.Loss, label="label")
    values = {i.name: numpy_helper.to_array(i) for i in with_loss.graph.initializer}
    feeds = {"X": X, "label": label, **{w: values[w] for w in weights}}
    got = dict(zip([o.name for o in grad.graph.output], _session(grad).run(None, feeds)))
    expected = onnx_numerical_vjp(with_loss, feeds, ["X", *weights], outputs=["loss"], eps=1e-6)
    for name_ in ["X", *weights]:
        scale = max(1.0, float(np.abs(expected[name_]).max()))
        np.testing.assert_allclose(
            got[f"{name_}_grad"], expected[name_], rtol=2e-3, atol=2e-3 * scale, err_msg=name_
        )


def _score(case: Case, outputs: dict, y) -> float:
    if case.task == "regression":
        return r2_score(y, next(iter(outputs.values())).ravel())
    return accuracy_score(y, next(iter(outputs.values())))


@pytest.mark.parametrize("target_opset", OPSETS)
@pytest.mark.parametrize("name", NAMES)
def test_training_from_a_perturbed_start_matches_sklearn(name, target_opset):
    model = fitted(name, target_opset)
    if model.opset > _ORT_MAX_OPSET:  # an onnxruntime too old for the model: a clear error
        X, y = model.data[:2]
        estimator = OrtGradientForwardBackwardOptimizer(model.onnx, learning_loss=model.case.loss)
        message = rf"onnxruntime {re.escape(ort.__version__)} does not load .*opset {model.opset}"
        with pytest.raises(ValueError, match=message):
            estimator.fit(
                X, y.reshape(-1, 1).astype(np.float32) if model.case.task == "regression" else y
            )
        return
    case = model.case
    X, y, X_test, y_test = model.data
    lowered = lower_ml_operators(model.onnx)
    rng = np.random.default_rng(3)
    weights = get_train_initializer(lowered)
    perturbed = {
        w: (v + 0.1 * (np.abs(v).mean() + 0.1) * rng.standard_normal(v.shape)).astype(v.dtype)
        for w, (v, _) in weights.items()
    }
    start = replace_initializers_into_onnx(lowered, perturbed)
    estimator = OrtGradientForwardBackwardOptimizer(
        start,
        learning_loss=case.loss,
        learning_rate="Adam",
        max_iter=150,
        batch_size=16,
        random_state=0,
        validation_every=0,
    )
    if case.task == "regression":
        labels = y.reshape(-1, 1).astype(np.float32)
    else:
        labels = (case.target(y) if case.target else y).astype(np.int64)
    estimator.fit(X, labels)

    trained = estimator.get_trained_onnx(model.onnx)
    original = _session(model.onnx)
    session = _session(trained)
    assert [(o.name, o.type) for o in session.get_outputs()] == [
        (o.name, o.type) for o in original.get_outputs()
    ]
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"X": X_test})))
    if case.not_sklearn_objective:
        before, after = (_training_loss(m, case.loss, X, labels) for m in (start, trained))
        assert after < 0.9 * before, case.not_sklearn_objective
        return
    reference = model.estimator.score(X_test, y_test)
    assert _score(case, outputs, y_test) >= reference - 0.02


def _training_loss(model, loss: str, X, labels) -> float:
    session = _session(add_loss_output(model, loss))
    names = [o.name for o in session.get_outputs()]
    return float(dict(zip(names, session.run(None, {"X": X, "label": labels})))["loss"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: __import__("sklearn.ensemble", fromlist=["x"]).RandomForestRegressor(
            n_estimators=3, max_depth=3, random_state=0
        ),
        lambda: __import__("sklearn.neighbors", fromlist=["x"]).KNeighborsRegressor(3),
    ],
    ids=["RandomForestRegressor", "KNeighborsRegressor"],
)
def test_models_without_a_derivative_say_so(make):
    X, y, _, _ = _data("regression")
    converted = to_onnx(make().fit(X, y), X[:1], target_opset=15)
    with pytest.raises(NotImplementedError, match="not differentiable"):
        onnx_derivative(converted, weights=[])
